"""The online learner: updates in the background every I requests, publishes gated versions,
and the serving output stays exactly the target's throughout."""

import pytest
import torch

from onlinespec.decoding.autoregressive import autoregressive_decoder
from onlinespec.decoding.proposers.draft_model import DraftModelProposer
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import SpeculativeDecoder
from onlinespec.distill.step import DistillConfig
from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.learnable import Objective
from onlinespec.online.learner import LearnerConfig, OnlineLearner
from onlinespec.online.registry import DraftRegistry

PARAMS = SamplingParams(max_new_tokens=20, ignore_eos=True)


def setup(tiny_llama, tmp_path, background=True, **config):
    target = tiny_llama(seed=0, vocab_size=32, hidden_size=32)
    draft = tiny_llama(seed=5, vocab_size=32, hidden_size=32)
    proposer = DraftModelProposer(draft)
    learner = OnlineLearner(
        proposer, ReplayBuffer(tmp_path / "buffer", policy="window"), DraftRegistry(tmp_path / "drafts"),
        LearnerConfig(**{"update_interval": 8, "steps_per_update": 40, "batch_size": 8, "lr": 3e-3, "position_policy": "verified",
                         "priority": "normal",
                         "distill": DistillConfig(loss="fkl"), **config}),
        background=background,
    )
    return target, draft, proposer, learner


def prompts(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 32, (6,), generator=gen).tolist() for _ in range(n)]


def serve(learner, decoder, n, seed=0) -> None:
    """``n`` requests decoded and handed to the learner, as the serving core does."""
    for prompt in prompts(n, seed=seed):
        learner.observe(decoder.generate(prompt, PARAMS, trace=True))


def test_learning_online_raises_acceptance_and_keeps_output_exact(tiny_llama, tmp_path):
    target, draft, proposer, learner = setup(tiny_llama, tmp_path)
    decoder = SpeculativeDecoder(target, None, proposer, k=3)
    reference = autoregressive_decoder(target)
    alphas, versions = [], []
    for prompt in prompts(48):
        out = decoder.generate(prompt, PARAMS, trace=True)
        assert out.token_ids == reference.generate(prompt, PARAMS).token_ids
        alphas.append(out.stats.acceptance_rate)
        versions.append(proposer.version)
        learner.observe(out, domain="test")
    learner.wait()
    published = [r for r in learner.reports if r.version]
    assert published, learner.reports
    assert all(r.alpha_after >= r.alpha_before for r in published)
    registry = learner.registry
    decoder.generate(prompts(1, seed=9)[0], PARAMS)  # the last hand-over is taken at the next round
    assert registry.current() == proposer.version == published[-1].version
    meta = registry.meta(published[-1].version)
    assert meta["parent"] and meta["records_seen"] > 0 and meta["alpha_after"] >= meta["alpha_before"]
    assert len(set(versions)) > 1  # new drafts were swapped in while serving
    assert sum(alphas[-12:]) / 12 > sum(alphas[:12]) / 12 + 0.1
    assert draft.model.layers[0].mlp.up_proj.weight.requires_grad is False  # the starting draft was never trained in place


def test_gate_refuses_a_worse_candidate(tiny_llama, tmp_path):
    target, draft, proposer, learner = setup(tiny_llama, tmp_path, background=False, lr=5.0, steps_per_update=5)
    decoder = SpeculativeDecoder(target, None, proposer, k=3)
    first = learner.registry.current()
    serve(learner, decoder, 8)
    (report,) = learner.reports
    assert report.version is None and report.alpha_after < report.alpha_before
    assert learner.registry.versions() == [first] and proposer.version == first and proposer.model is draft


def test_requests_marked_train_false_are_never_stored(tiny_llama, tmp_path):
    target, _, proposer, learner = setup(tiny_llama, tmp_path, background=False)
    decoder = SpeculativeDecoder(target, None, proposer, k=3)
    for prompt in prompts(5):
        learner.observe(decoder.generate(prompt, PARAMS, trace=True), train=False)
    assert len(learner.buffer) == 0


class _SplitVerdict(OnlineLearner):
    """A learner whose candidate (any model but the serving one) judges better on domain 'new'
    and worse on domain 'old': the gate's decision alone is under test."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        serving, real = self.publisher.latest[0], self.learnable

        class Judge:
            copy, load, adapt, cold = real.copy, real.load, real.adapt, real.cold
            pool, replays = None, False  # the pool measured as a whole; judged by alpha

            def objective(self, records, positions, depth, config):
                return Objective(list(range(len(records) or 1)), lambda model, optimizer, batch: 0.0)

            def metrics(self, model, records, config, between=lambda: None, per_position=False, replay=False):
                if model is serving:
                    return {"loss": 1.0, "alpha": 0.5}
                old = sum(r.domain == "old" for r in records) / len(records)
                return {"loss": 1.0, "alpha": 0.5 + 0.2 * (1 - old) - 0.1 * old}

        judge = Judge()  # what trains and judges the candidate
        self.learnable = self.updater.learnable = self.updater.trainer.learnable = self.updater.gate.learnable = judge


def test_domain_gate_refuses_a_candidate_that_serves_an_earlier_domain_worse(tiny_llama, tmp_path):
    """Pooled over the newest records (all of the new domain) the candidate wins; held out per
    domain, it loses on the old one, and only the per-domain gate sees it."""
    verdicts = {}
    for gate_by in ("newest", "domain"):
        target, draft, proposer, _ = setup(tiny_llama, tmp_path / gate_by, background=False)
        learner = _SplitVerdict(proposer, ReplayBuffer(tmp_path / gate_by / "b", policy="window"), DraftRegistry(tmp_path / gate_by / "d"),
                                LearnerConfig(update_interval=12, steps_per_update=1, position_policy="verified", priority="normal",
                                              gate_by=gate_by), background=False)
        decoder = SpeculativeDecoder(target, None, proposer, k=3)
        for i, prompt in enumerate(prompts(12)):
            learner.observe(decoder.generate(prompt, PARAMS, trace=True), domain="old" if i < 6 else "new")
        (report,) = learner.reports
        verdicts[gate_by] = report
    assert verdicts["newest"].version is not None and verdicts["newest"].by_domain == {}
    domain = verdicts["domain"]
    assert domain.version is None
    assert domain.by_domain["new"][1] > domain.by_domain["new"][0] and domain.by_domain["old"][1] < domain.by_domain["old"][0]


@pytest.mark.parametrize("figure", ["alpha", "replayed"])
def test_domain_gate_lets_a_domain_move_by_its_noise_but_not_fall(tiny_llama, tmp_path, figure):
    """A candidate that gains on one domain passes when another moves by less than its paired
    noise (a few held-out requests), and is refused when that one clearly falls: judged by
    per-position alpha, or by each request's replayed acceptance (accepted of 10 judged)."""
    from types import SimpleNamespace

    *_, learner = setup(tiny_llama, tmp_path, background=False)
    serving, candidate = learner.publisher.latest[0], object()

    class Judge:
        pool = None

        def metrics(self, model, records, config, between=lambda: None, per_position=False, replay=False):
            values = torch.tensor([r.before if model is serving else r.after for r in records])
            out = {"loss": 1.0, "alpha": float(values.mean())}
            if replay:
                out["replayed"], out["requests"] = float(values.mean()), torch.stack([10 * values, torch.full_like(values, 10)], 1)
            return {**out, "alphas": values} if per_position else out

    learner.updater.gate.learnable = Judge()
    gen = torch.Generator().manual_seed(0)

    def domain(name: str, gain: float, spread: float, n: int = 200) -> list:
        before = 0.5 + 0.1 * torch.randn(n, generator=gen, dtype=torch.float64)
        noise = torch.randn(n, generator=gen, dtype=torch.float64)
        after = before + gain + spread * (noise - noise.mean())  # the mean change is exactly `gain`
        return [SimpleNamespace(domain=name, before=float(b), after=float(a)) for b, a in zip(before, after)]

    grows = domain("a", 0.12, 0.1)
    _, _, by_domain, passed = learner.updater.gate.judge(serving, candidate, {"a": grows, "b": domain("b", -0.003, 0.15)}, figure)
    assert passed and by_domain["b"][1] < by_domain["b"][0]  # fell by 0.003, with a standard error of about 0.01
    _, _, by_domain, passed = learner.updater.gate.judge(serving, candidate, {"a": grows, "b": domain("b", -0.05, 0.05)}, figure)
    assert not passed  # fell by 0.05, with a standard error of about 0.004


def test_domain_gate_holds_out_the_newest_records_of_each_domain(tiny_llama, tmp_path):
    from types import SimpleNamespace

    *_, learner = setup(tiny_llama, tmp_path, background=False, gate_fraction=0.25)
    records = [SimpleNamespace(domain=d, n=i) for i, d in enumerate("aaaaaaaabbbbc")]
    train, groups = learner.updater.gate.held_out(records)
    assert {d: [r.n for r in rs] for d, rs in groups.items()} == {"a": [6, 7], "b": [11], "c": [12]}
    assert [r.n for r in train] == [0, 1, 2, 3, 4, 5, 8, 9, 10]
    learner.config.gate_by = "newest"
    train, groups = learner.updater.gate.held_out(records)
    assert [r.n for r in groups["all"]] == [10, 11, 12] and len(train) == 10


def test_drafts_sharing_an_update_slot_update_one_at_a_time_and_none_is_dropped(tiny_llama, tmp_path):
    import threading
    import time

    slot, events = threading.Semaphore(1), []
    target = tiny_llama(seed=0, vocab_size=32, hidden_size=32)
    learners = {}
    for name in ("code", "math"):
        proposer = DraftModelProposer(tiny_llama(seed=5, vocab_size=32, hidden_size=32))
        learners[name] = OnlineLearner(
            proposer, ReplayBuffer(tmp_path / name / "buffer", policy="window"), DraftRegistry(tmp_path / name / "drafts"),
            LearnerConfig(update_interval=4, steps_per_update=20, batch_size=8, priority="normal", position_policy="verified"),
            on_event=lambda event, name=name: events.append((name, event["event"], time.perf_counter())), slot=slot)
    # Hold the code draft's update until the maths draft is due, whatever the machine's speed.
    release, run_code_update = threading.Event(), learners["code"].updater.run
    learners["code"].updater.run = lambda *snapshot: (release.wait(60), run_code_update(*snapshot))
    for name, learner in learners.items():
        decoder = SpeculativeDecoder(target, None, learner.proposer, k=3)
        for prompt in prompts(4, seed=len(name)):
            learner.observe(decoder.generate(prompt, PARAMS, trace=True), domain=name)
    assert learners["code"].busy and not learners["math"].busy and learners["math"].due  # waiting for the slot
    assert not learners["math"].maybe_update()  # the slot is taken
    release.set()
    while not learners["math"].maybe_update():  # what the pool does after every request
        time.sleep(0.01)
    learners["math"].wait()
    assert [(name, kind) for name, kind, _ in events] == [("code", "update_start"), ("code", "update"),
                                                          ("math", "update_start"), ("math", "update")]
    assert all(len(learner.reports) == 1 for learner in learners.values())


def test_background_priority_lowers_only_the_calling_thread():
    """The learner's thread runs at the priority asked for; the serving thread keeps its own."""
    import os
    import threading

    import pytest

    from onlinespec.cpu import lower_priority

    if not hasattr(os, "SCHED_IDLE"):
        pytest.skip("SCHED_IDLE is Linux's")
    seen = {}

    def background(priority: str) -> None:
        lower_priority(priority)
        seen[priority] = (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    for priority in ("idle", "low", "normal"):
        thread = threading.Thread(target=background, args=(priority,))
        thread.start()
        thread.join()
    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen["idle"][0] == os.SCHED_IDLE
    assert seen["low"] == (os.SCHED_OTHER, 19)
    assert seen["normal"] == (os.SCHED_OTHER, here)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # this (serving) thread is untouched


def test_next_gate_judges_a_candidate_on_the_requests_served_after_it(tiny_llama, tmp_path):
    """gate="next": the first update only trains (on every record); the second judges that candidate
    on the 4 requests served since, publishes it if no worse, and trains the next one."""
    target, _, proposer, learner = setup(tiny_llama, tmp_path, background=False, gate="next", steps_per_update=10, update_interval=4)
    decoder = SpeculativeDecoder(target, None, proposer, k=3)
    serve(learner, decoder, 4)
    assert learner.reports == [] and learner.updater.next.pending is not None and len(learner.updater.next.pending.records) == 4
    serve(learner, decoder, 4, seed=1)
    (report,) = learner.reports
    assert report.outcome == ("published" if report.alpha_after >= report.alpha_before else "refused")
    assert len(learner.updater.next.pending.records) == 8  # the next candidate trained on every record


def test_next_gate_refuses_a_worse_candidate(tiny_llama, tmp_path):
    target, _, proposer, learner = setup(tiny_llama, tmp_path, background=False, gate="next", lr=5.0, steps_per_update=5, update_interval=4)
    decoder = SpeculativeDecoder(target, None, proposer, k=3)
    first = learner.registry.current()
    serve(learner, decoder, 8)
    (report,) = learner.reports
    assert report.version is None and report.alpha_after < report.alpha_before
    assert learner.registry.versions() == [first] and proposer.version == first
