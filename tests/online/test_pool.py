"""Several drafts share one update slot: the update that fell due first runs first, and a stream's
end runs the updates still due."""

import threading

import torch

from onlinespec.decoding.proposers.draft_model import DraftModelProposer
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import SpeculativeDecoder
from onlinespec.online.learner import LearnerConfig
from onlinespec.online.pool import DraftPool
from onlinespec.routing import Router

PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)


def test_the_longest_waiting_update_takes_the_free_slot_and_draining_runs_the_rest(tiny_llama, tmp_path):
    target = tiny_llama(seed=0, vocab_size=32, hidden_size=32)
    new_draft = lambda: (DraftModelProposer(tiny_llama(seed=5, vocab_size=32, hidden_size=32)), None)  # noqa: E731
    events = []
    config = LearnerConfig(update_interval=2, steps_per_update=5, batch_size=4, priority="normal", position_policy="verified")
    pool = DraftPool(new_draft, tmp_path, Router("domain"), config,
                     on_event=lambda e: events.append((e["event"], e["draft"])) if e["event"].startswith("update") else None)
    gen = torch.Generator().manual_seed(0)

    def serve(domain: str) -> None:
        draft = pool.route(domain)
        out = SpeculativeDecoder(target, None, draft.proposer, k=3).generate(torch.randint(0, 32, (6,), generator=gen).tolist(), PARAMS, trace=True)
        pool.observe(draft, out, domain, f"{domain}-{len(events)}")

    release = threading.Event()
    first = pool.route("a").learner
    run_update = first._run_update
    first._run_update = lambda: (release.wait(60), run_update())  # hold the slot until b and c are due
    for domain in "aabbcc":
        serve(domain)
    assert first.busy and pool.route("b").learner.due and pool.route("c").learner.due
    release.set()
    first.wait()
    serve("c")  # a request of c frees nothing for c: b has waited longer
    pool.wait(drain=True)
    starts = [draft for event, draft in events if event == "update_start"]
    assert starts == ["a", "b", "c"]
    assert not any(learner.due or learner.busy for learner in pool.learners)
    assert [len(learner.reports) for learner in pool.learners] == [1, 1, 1]
