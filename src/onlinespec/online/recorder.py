"""Turn a request's verification trace into distillation records, without running the target again.

Alignment (the official prototype got it wrong): trace row ``j`` of a round holds the target's
distribution FOR the token at sequence position ``t = round.position + j``, computed from the
logits at position ``t - 1``. A record names ``t``; the trainer compares it with the draft's
logits at ``t - 1``, the ones that predicted the token at ``t`` (for a rejection: the logits that
proposed the rejected token, which is where the draft was wrong).

Which rows are kept:
- ``"rejected"`` (the paper): the row of each round's first rejection, the position where the
  target's correction replaced the draft's proposal. A round whose proposals were all accepted
  has no error: its bonus row is not one.
- ``"verified"``: every row whose context is the request's final text: the accepted proposals,
  the rejected one, and the bonus row. Rows after a rejection are conditioned on rejected
  tokens, so they are never kept.
Positions at or past the end of the final output (cut by EOS, a stop string or max_new_tokens)
are dropped too.

Feature heads (:mod:`onlinespec.decoding.feature_head`) learn along chains of consecutive
positions, so when the trace carries the target's features the record keeps EVERY verified row
(with the feature at ``t - 1`` of each and a flag for the rejection rows); the position policy
is then applied by the learner when it picks the chains' starting points.

Sampling mode (arXiv 2310.07177, section 4.1, honoured online, unlike the prototype):
- ``"teacher"``: rows whose context is the served text, which the target wrote (above).
- ``"student"``: rows whose context is the DRAFT's text. A round's verification also scored the
  proposals after its first rejection: row ``j > n_accepted`` is the target's distribution given
  the draft's own proposals up to ``j``. Each such branch becomes its own record (the request's
  text up to the round, then the proposals), with every row kept, under either position policy:
  all of them lie where the draft had already gone wrong. Rounds whose proposals were all
  accepted hold no student rows beyond the teacher's (their context is the served text).
- ``"mixed"``: both, i.e. every row the verification passes scored.
"""

from __future__ import annotations

import torch

from onlinespec.decoding.speculative import Generation
from onlinespec.distill.records import DistillRecord

POSITION_POLICIES = ("rejected", "verified")
STUDENT_MARK = "#student@"  # a student record's id: <request id>#student@<position>
SAMPLING_MODES = ("teacher", "student", "mixed")


def record_from_generation(
    generation: Generation, policy: str = "rejected", domain: str = "default", request_id: str = ""
) -> DistillRecord | None:
    """The record of one traced request (``generate(..., trace=True)``), or None if it has no positions."""
    if policy not in POSITION_POLICIES:
        raise ValueError(f"unknown position policy {policy!r}: use one of {POSITION_POLICIES}")
    if not generation.trace and generation.token_ids:
        raise ValueError("this generation carries no verification trace: decode with trace=True")
    tokens = generation.prompt_ids + generation.token_ids
    with_features = bool(generation.trace) and generation.trace[0].target_features is not None
    positions, ids, logprobs, features, rejected = [], [], [], [], []
    for round_ in generation.trace:
        n, proposed = round_.n_accepted, len(round_.proposals)
        if policy == "rejected" and not with_features:
            rows = [n] if n < proposed and proposed > 0 else []
        else:
            rows = range(n + 1)  # accepted rows, then the correction or bonus row
        for j in rows:
            t = round_.position + j
            if t < len(tokens):
                positions.append(t)
                ids.append(round_.target_top_ids[j])
                logprobs.append(round_.target_top_logprobs[j])
                rejected.append(j == n and n < proposed)
                if with_features:
                    features.append(round_.target_features[j])
    if not positions:
        return None
    return DistillRecord(
        tokens, positions, torch.stack(ids), torch.stack(logprobs).float(), len(generation.prompt_ids), domain, request_id,
        torch.stack(features) if with_features else None, rejected if with_features else None,
    )


def records_from_generation(
    generation: Generation, policy: str = "rejected", sampling: str = "teacher", domain: str = "default", request_id: str = ""
) -> list[DistillRecord]:
    """The records of one traced request for a ``sampling`` mode (see the module docstring)."""
    if sampling not in SAMPLING_MODES:
        raise ValueError(f"unknown sampling mode {sampling!r}: use one of {SAMPLING_MODES}")
    records = []
    if sampling in ("teacher", "mixed"):
        record = record_from_generation(generation, policy, domain, request_id)
        records += [record] if record is not None else []
    if sampling in ("student", "mixed"):
        records += student_records(generation, domain, request_id)
    return records


def student_records(generation: Generation, domain: str = "default", request_id: str = "") -> list[DistillRecord]:
    """One record per round that rejected a proposal before its last: the rows after the first
    rejection, whose context is the draft's own proposals (the target scored them all)."""
    if not generation.trace and generation.token_ids:
        raise ValueError("this generation carries no verification trace: decode with trace=True")
    served = generation.prompt_ids + generation.token_ids
    records = []
    for round_ in generation.trace:
        n, proposed = round_.n_accepted, len(round_.proposals)
        if n >= proposed:  # every proposal accepted: no row was conditioned on a rejected one
            continue
        rows = list(range(n + 1, proposed + 1))  # row j: the target's distribution given proposals[:j]
        tokens = served[: round_.position] + list(round_.proposals)
        features = round_.target_features
        records.append(DistillRecord(
            tokens, [round_.position + j for j in rows], round_.target_top_ids[rows], round_.target_top_logprobs[rows].float(),
            len(generation.prompt_ids), domain, f"{request_id}{STUDENT_MARK}{round_.position}",
            features[rows] if features is not None else None, [True] * len(rows) if features is not None else None,
        ))
    return records
