"""The feature-conditioned head as a proposer: lossless (greedy and sampled), hybrid with n-gram
lookup, adaptive k, save / load, and the restricted-vocabulary teacher."""

from __future__ import annotations

import pytest
import torch

from onlinespec.decoding.adaptive import AdaptiveK
from onlinespec.decoding.feature_head import FeatureHead
from onlinespec.decoding.proposers.base import DraftInput, Proposal
from onlinespec.decoding.proposers.feature import FeatureHeadProposer
from onlinespec.decoding.proposers.hybrid import HybridProposer
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import SpeculativeDecoder
from onlinespec.distill.losses import bucket_log_probs
from onlinespec.distill.step import DistillConfig
from onlinespec.drafts.train import ChainTask
from tests.decoding.test_lossless_engine import NEW_TOKENS, PASS_P, empirical, exact_distribution, fit

pytestmark = pytest.mark.usefixtures("one_thread")

# the tiny target's vocabulary is 0..5; the head may propose only 4 of its tokens
VOCAB = torch.tensor([0, 1, 2, 4])
COSTS = [1.0, 1.1, 1.3, 1.4]  # a made-up verify-cost curve for the adaptive policy


def random_head(target, seed: int = 3) -> FeatureHead:
    torch.manual_seed(seed)
    head = FeatureHead.for_target(target, VOCAB, intermediate_size=8, num_blocks=1)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return head.eval()


def decoders(target):
    head = random_head(target)
    return {
        "head": SpeculativeDecoder(target, None, FeatureHeadProposer(head), k=3),
        "hybrid": SpeculativeDecoder(target, None, HybridProposer(FeatureHeadProposer(head), min_ngram=1), k=3),
        "hybrid+adaptive": SpeculativeDecoder(
            target, None, HybridProposer(FeatureHeadProposer(head), min_ngram=1), k=3, adaptive_k=AdaptiveK(COSTS)
        ),
    }


@pytest.mark.parametrize("name", ["head", "hybrid", "hybrid+adaptive"])
def test_greedy_output_is_the_targets(tiny_target, name):
    plain = SpeculativeDecoder(tiny_target, None)
    decoder = decoders(tiny_target)[name]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    proposed = 0
    for prompt in ([1, 4, 2], [5, 5, 0, 3], [2], [1, 4, 2, 1, 4, 2, 1]):
        out = decoder.generate(prompt, params)
        assert out.token_ids == plain.generate(prompt, params).token_ids
        proposed += out.stats.proposed
    assert proposed > 0


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=4, top_p=0.9)], ids=["t1.0", "warped"])
def test_sampled_output_follows_the_targets_distribution(tiny_target, sampling, chi_square):
    """Restricted-vocabulary proposals (probability 0 outside V_r), n-gram proposals and the
    adaptive length together: 3-token continuations ~ target alone. N = 3000 (as the engine's own:
    1,500 reject a wrong residual at p about 4e-14, tests/decoding/test_lossless_engine.py), seeds
    10000.., p-value > 1e-3."""
    prompt = [1, 4, 2, 1, 4]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, **sampling)
    exact = exact_distribution(tiny_target, prompt, params)
    decoder = decoders(tiny_target)["hybrid+adaptive"]
    decoder.adaptive_k.prior_weight = 1e9  # keep k fixed near the prior: every path gets exercised
    runs = 3000
    counts, totals = empirical(decoder, prompt, runs, **sampling)
    assert totals["accepted"] > runs / 10 and totals["rejected"] > runs / 10, totals
    assert sum(c for x, c in counts.items() if exact.get(x, 0.0) == 0) == 0
    p_value, stat, df = fit(counts, exact, chi_square)
    assert p_value > PASS_P, (p_value, stat, df)


def test_hybrid_prefers_a_copy_and_falls_back_to_the_head(tiny_target):
    proposer = HybridProposer(FeatureHeadProposer(random_head(tiny_target)), min_ngram=2)
    params = SamplingParams()
    states = [proposer.start([1, 2, 3]), proposer.start([5, 4, 3])]
    for state in states:
        proposer.observe(state, torch.randn(tiny_target.config.hidden_size))
    # one batch: the first request has a copy to make, the second goes to the head
    copied, drafted = proposer.propose([DraftInput([1, 2, 3, 1, 2], 2, params, None, states[0]),
                                        DraftInput([5, 4, 3], 2, params, None, states[1])])
    assert copied.drafter == "ngram" and copied.tokens == [3, 1]
    assert drafted.drafter == "head" and len(drafted) == 2 and set(drafted.tokens) <= set(VOCAB.tolist())


def _verified(policy, proposal: Proposal, uncached: int, use_confidence: bool) -> int:
    """How many of one request's proposals a step verifies (the planner's answer for a batch of one)."""
    from onlinespec.decoding.adaptive import PlanRow, plan_step

    return plan_step([PlanRow(proposal, policy, use_confidence, uncached=uncached)])[1][0]


def test_adaptive_k_sends_more_when_acceptance_is_high():
    policy = AdaptiveK([1.0, 1.05, 1.1, 1.5, 1.6], prior_weight=1.0)
    sure = Proposal([1, 2, 3, 4], confidences=[0.95, 0.9, 0.9, 0.9], drafter="head")
    unsure = Proposal([1, 2, 3, 4], confidences=[0.05, 0.05, 0.05, 0.05], drafter="head")
    assert _verified(policy, sure, 1, True) >= 2
    assert _verified(policy, unsure, 1, True) == 0
    # measured acceptance overrides an over-confident draft
    for _ in range(200):
        policy.update(sure, 0, True)
    assert _verified(policy, sure, 1, True) == 0
    # a sampled round never looks at its own confidences: same choice whatever they are
    assert _verified(policy, sure, 1, False) == _verified(policy, unsure, 1, False)


def test_save_and_load_round_trip(tiny_target, tiny_llama, tmp_path):
    head = random_head(tiny_target)
    head.save(tmp_path / "head", {"note": "test"})
    loaded = FeatureHead.load(tmp_path / "head", tiny_target)
    feature, token = torch.randn(4, tiny_target.config.hidden_size), torch.tensor([0, 1, 2, 3])
    assert torch.equal(loaded.logits(loaded.step(feature, token)), head.logits(head.step(feature, token)))
    assert FeatureHead.info(tmp_path / "head")["note"] == "test"
    other = tiny_llama(0, vocab_size=9)
    with pytest.raises(ValueError, match="vocabulary"):
        FeatureHead.load(tmp_path / "head", other)


def test_saving_over_a_head_never_leaves_a_half_written_one(tiny_target, tmp_path, monkeypatch):
    head = random_head(tiny_target)
    head.save(tmp_path / "head")
    before = (tmp_path / "head" / "feature_head.safetensors").read_bytes()

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr("onlinespec.decoding.feature_head.save_file", crash)
    with pytest.raises(RuntimeError):
        random_head(tiny_target, seed=9).save(tmp_path / "head")
    assert (tmp_path / "head" / "feature_head.safetensors").read_bytes() == before


def _toy_signal(target, n_seq: int = 6, length: int = 12):
    from onlinespec.distill.signal import Signal

    torch.manual_seed(0)
    ids = torch.randint(0, 6, (n_seq * length,))
    with torch.inference_mode():
        hidden = torch.cat([target.get_decoder()(input_ids=ids[i * length:(i + 1) * length][None]).last_hidden_state[0] for i in range(n_seq)])
        top = torch.log_softmax(target.get_output_embeddings()(hidden), -1).topk(3, -1)
    starts = torch.arange(0, n_seq * length + 1, length)
    return Signal(ids, hidden.half(), top.indices, top.values, starts, torch.full((n_seq,), 4), ["a"] * n_seq, [str(i) for i in range(n_seq)])


def test_teacher_mass_outside_the_restricted_vocabulary_goes_to_the_rest_bucket(tiny_target):
    signal = _toy_signal(tiny_target)
    head = random_head(tiny_target)
    task = ChainTask(signal)
    pos = torch.arange(20)
    teacher = task.restricted_teacher(head, pos)
    logits = torch.cat([torch.randn(20, len(VOCAB)), torch.full((20, 1), -1e4)], -1)
    log_p, _ = bucket_log_probs(logits, teacher)
    outside = ~torch.isin(signal.top_ids[pos], VOCAB)
    top_p = signal.top_logprobs[pos].exp()
    expected_rest = 1 - (top_p * ~outside).sum(-1)
    assert torch.allclose(log_p[:, -1].exp(), expected_rest, atol=1e-5)
    assert torch.allclose(log_p.exp().sum(-1), torch.ones(20), atol=1e-5)


def test_chain_training_lowers_the_loss(tiny_target):
    signal = _toy_signal(tiny_target)
    head = random_head(tiny_target)
    task = ChainTask(signal)
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    batch = task.starts.tolist()
    losses = [task.step(head, optimizer, batch, DistillConfig()) for _ in range(60)]
    assert losses[-1] < 0.7 * losses[0]
    # every start position has at least one step, and no step crosses a sequence end
    assert bool((task.starts + 1 < task.end[task.starts]).all())


def test_the_gates_figures_do_not_depend_on_how_the_positions_are_split(tiny_target):
    # head_metrics scores the held-out positions in chunks (its memory must not grow with the buffer)
    from onlinespec.distill.records import DistillRecord
    from onlinespec.drafts.train import head_metrics, pool_metrics

    torch.manual_seed(0)
    records = []
    for i in range(6):
        ids = torch.randint(0, 6, (9,)).tolist()
        top = torch.randn(8, 6).log_softmax(-1).topk(3)
        records.append(DistillRecord(ids, list(range(1, 9)), top.indices, top.values, 3, request_id=str(i), rejected=[False] * 8,
                                     features=torch.randn(8, tiny_target.config.hidden_size).half()))
    head = random_head(tiny_target)
    whole, chunked = head_metrics(head, records, DistillConfig(), chunk=10_000), head_metrics(head, records, DistillConfig(), chunk=7)
    assert whole.keys() == chunked.keys()
    assert all(abs(whole[k] - chunked[k]) < 1e-5 for k in whole), (whole, chunked)
    assert 0 < whole["alpha"] < 1
    # nor on whether they are measured over all the records or pooled from groups of them (the
    # learner's gate measures each held-out domain once and pools)
    every = dict(per_position=True, replay=True)
    whole = head_metrics(head, records, DistillConfig(), **every)
    pooled = pool_metrics([head_metrics(head, part, DistillConfig(), **every) for part in (records[:2], records[2:5], records[5:])])
    assert whole.keys() == pooled.keys()
    for key in ("loss", "agreement", "alpha", "replayed", "positions"):
        assert pooled[key] == pytest.approx(whole[key], abs=1e-6), key
    assert torch.allclose(pooled["alphas"], whole["alphas"]) and torch.equal(pooled["requests"], whole["requests"])


def test_alpha_gives_a_head_nothing_for_target_tokens_outside_its_vocabulary():
    """A head whose vocabulary misses the target's likely tokens agrees with it only on the rest."""
    from onlinespec.drafts.train import sparse_alpha

    top = torch.tensor([[0.6, 0.3]]).log()  # the target's top-2; 0.1 on every other token
    logits = torch.zeros(1, 2)  # the head: 0.5 on each of its two ids
    assert sparse_alpha(logits, torch.tensor([[-1, -1]]), top).item() == pytest.approx(0.1)  # none covered: the rest only
    assert sparse_alpha(logits, torch.tensor([[0, -1]]), top).item() == pytest.approx(0.5 + 0.1)  # the first covered
    assert sparse_alpha(logits, torch.tensor([[0, 1]]), top).item() == pytest.approx(0.5 + 0.3)  # all its mass on the top-2


def test_a_served_head_drafts_with_int8_matrices_and_the_learner_trains_the_float_one():
    """On a CPU the head drafts from a copy whose large matrices are int8 (docs/cpu-speculation.md):
    its logits stay close to the float head's; the proposer's ``model`` (what the learner copies and
    trains) stays float32, and a head handed over is served int8 from the next step."""
    from onlinespec.decoding.feature_head import FeatureHeadConfig, served_copy

    torch.manual_seed(0)
    hidden, vocab = 576, 4096  # the packaged head's width: its output rows are past SERVED_INT8_FROM
    embedding, out = torch.randn(vocab, hidden), 0.05 * torch.randn(vocab, hidden)
    head = FeatureHead(FeatureHeadConfig(hidden_size=hidden, vocab_size=vocab), embedding, torch.arange(2048), out).eval()
    served = served_copy(head)
    assert served.served_out is not None and head.served_out is None, "the copy is int8, the head itself untouched"
    feature, token = torch.randn(8, hidden), torch.arange(8)
    with torch.inference_mode():
        exact, approx = head.logits(head.step(feature, token)), served.logits(served.step(feature, token))
    assert (approx - exact).abs().max() < 0.05 * exact.abs().max(), "int8 rows with a scale each: logits within a few percent"
    proposer = FeatureHeadProposer(head)
    assert proposer.model is head and proposer.head.served_out is not None
    trained = head.clone()
    proposer.swap_model(trained, "v1")
    proposer.take_swap()
    assert proposer.model is trained and proposer.head is not served and proposer.head.served_out is not None
    from onlinespec.memory import tensors_bytes

    int8 = proposer.head.blocks[0].gate_up.weight().numel()  # one of the copy's own int8 matrices (a byte each)
    assert tensors_bytes(proposer.memory_objects()) >= tensors_bytes([trained]) + int8, "the memory budget counts the int8 copy"


def test_a_version_loaded_into_a_clone_shares_its_rows_and_never_changes_the_heads_ids():
    """What the learner loads (the acceptance floor's starting draft, a restart, a rollback) is a
    clone of the serving head holding another version's weights. Of the same vocabulary, it shares
    the serving head's output rows instead of holding its own (issue 46's memory soak: one copy per
    learning draft for the whole run); of another vocabulary, it gets rows of its own and the
    serving head keeps its ids and rows (a load copies ids in place: they were shared once)."""
    from onlinespec.decoding.feature_head import FeatureHeadConfig
    from onlinespec.weights import load_weights

    torch.manual_seed(0)
    hidden, vocab = 64, 512
    embedding, out = torch.randn(vocab, hidden), torch.randn(vocab, hidden)
    head = FeatureHead(FeatureHeadConfig(hidden_size=hidden, vocab_size=vocab), embedding, torch.arange(128), out).eval()
    same = head.clone()
    same.fuse.weight.data.normal_()  # another version's body
    loaded = head.clone()
    load_weights(loaded, same.state_dict(), "a version")
    assert loaded.out_rows.data_ptr() == head.out_rows.data_ptr(), "the same vocabulary: the rows are shared"
    assert torch.equal(loaded.fuse.weight, same.fuse.weight) and not torch.equal(loaded.fuse.weight, head.fuse.weight)

    other = head.clone()
    other.choose_vocab(torch.arange(128, 256))
    loaded = head.clone()
    load_weights(loaded, other.state_dict(), "a version of another vocabulary")
    assert torch.equal(loaded.vocab_ids, torch.arange(128, 256)) and torch.equal(loaded.out_rows, out[128:256])
    assert torch.equal(head.vocab_ids, torch.arange(128)) and torch.equal(head.out_rows, out[:128]), "the serving head is untouched"
