"""A distillation step on recorded traces makes the draft agree with the target more often."""

import torch

from onlinespec.decoding.proposers.draft_model import DraftModelProposer
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import SpeculativeDecoder
from onlinespec.distill.step import DistillConfig, collate, distill_step, evaluate
from onlinespec.online.recorder import record_from_generation


def traced_records(target, draft, prompts, policy="verified"):
    decoder = SpeculativeDecoder(target, None, DraftModelProposer(draft), k=3, trace_top_k=8)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    records, accepted, judged = [], 0, 0
    for prompt in prompts:
        out = decoder.generate(prompt, params, trace=True)
        accepted += out.stats.accepted
        judged += out.stats.accepted + out.stats.rejected
        records.append(record_from_generation(out, policy))
    return [r for r in records if r is not None], accepted / judged


def test_collate_points_at_the_predicting_logits():
    class R:
        def __init__(self, tokens, positions):
            self.token_ids, self.positions = tokens, positions
            self.top_ids = torch.zeros(len(positions), 2, dtype=torch.long)
            self.top_logprobs = torch.zeros(len(positions), 2)

        def __len__(self):
            return len(self.positions)

    batch = collate([R([5, 6, 7], [2]), R([1, 2, 3, 4, 5], [3, 4])])
    assert batch.input_ids.tolist() == [[5, 6, 7, 0, 0], [1, 2, 3, 4, 5]]
    assert batch.attention_mask.sum().item() == 8
    assert batch.rows.tolist() == [0, 1, 1]
    assert batch.predictors.tolist() == [1, 2, 3]  # logits at t - 1 predict the token at t


def test_distillation_raises_agreement_and_acceptance(tiny_llama):
    torch.manual_seed(0)
    target, draft = tiny_llama(seed=0, vocab_size=32, hidden_size=32), tiny_llama(seed=5, vocab_size=32, hidden_size=32)
    draft.requires_grad_(True)
    prompts = [torch.randint(0, 32, (6,)).tolist() for _ in range(24)]
    train, _ = traced_records(target, draft, prompts[:16])
    held_out, alpha_before = traced_records(target, draft, prompts[16:])
    config = DistillConfig(loss="fkl")
    before = evaluate(draft, held_out, config)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    for _ in range(60):
        distill_step(draft, optimizer, train, config)
    after = evaluate(draft, held_out, config)
    _, alpha_after = traced_records(target, draft, prompts[16:])
    assert after["loss"] < before["loss"]
    assert after["agreement"] > before["agreement"] + 0.1
    assert alpha_after > alpha_before + 0.1
