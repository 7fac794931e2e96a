"""The fair scheduler's order with fake requests and a fake engine (no model): who gets the batch's
slots between tenants and between one tenant's requests (issue 46; docs/serve.md, "Scheduling"); and
with the engine on a tiny random target, whose prompt the step's prefill budget serves first."""

from __future__ import annotations

import random

import pytest

from onlinespec.decoding.request import RequestState
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.scheduler import FairScheduler, Scheduler
from onlinespec.decoding.stopping import StopChecker

PARAMS = SamplingParams(max_new_tokens=None, ignore_eos=True)


class FakeEngine:
    """One token per running request per step; a request that was recomputed (preempted) takes
    one step to prefill its tokens again, as the real engine's chunked prefill does."""

    context = 1 << 20

    def __init__(self) -> None:
        self.steps = 0

    def parkable_rows(self) -> list[RequestState]:
        return []  # every row decodes every step

    def step(self, active: list[RequestState], idle: frozenset[int] = frozenset()):
        self.steps += 1
        for r in active:
            if r.prefilled < len(r.ids):
                r.prefilled = len(r.ids)
                r.new_tokens = []
                continue
            r.new_tokens = r.stop.clip([7])
            r.ids.extend(r.new_tokens)
            r.prefilled = len(r.ids)

    def recompute(self, active):
        for r in active:
            r.recompute()


def request(tokens: int, prompt: int = 4) -> RequestState:
    return RequestState(list(range(1, prompt + 1)), PARAMS, StopChecker(PARAMS, frozenset(), None, max_new_tokens=tokens))


def tenants_of(scheduler: FairScheduler, requests: dict[str, list[RequestState]]) -> dict[str, int]:
    held = {name: 0 for name in requests}
    for r in scheduler.running:
        for name, mine in requests.items():
            held[name] += any(r is m for m in mine)
    return held


def test_one_tenant_keeps_first_come_order_and_scheduler_is_an_alias():
    assert Scheduler is FairScheduler
    scheduler = FairScheduler(FakeEngine(), max_batch=2)
    requests = [scheduler.submit(request(3)) for _ in range(5)]
    scheduler.step()
    assert scheduler.running == requests[:2]
    scheduler.run()
    assert all(r.stop.finish_reason == "length" and len(r.stop.generated) == 3 for r in requests)


def test_a_tenant_arriving_behind_a_16_choice_request_gets_a_slot_at_the_next_step():
    scheduler = FairScheduler(FakeEngine(), max_batch=8)
    b = [scheduler.submit(request(500), tenant="B", group="b1") for _ in range(16)]
    for _ in range(3):
        scheduler.step()
    assert tenants_of(scheduler, {"B": b}) == {"B": 8}  # alone, B uses every slot
    a = scheduler.submit(request(5), tenant="A", group="a1")
    scheduler.step()
    assert any(r is a for r in scheduler.running) and scheduler.preempted == 1
    while not a.finished:
        scheduler.step()
    assert a.stop.generated == [7] * 5
    assert not any(r.finished for r in b)  # A was not queued behind all of B's work


def test_two_busy_tenants_share_the_slots_and_the_tokens():
    scheduler = FairScheduler(FakeEngine(), max_batch=8)
    b = [scheduler.submit(request(10_000), tenant="B", group=f"b{i // 16}") for i in range(32)]
    scheduler.step()
    a = [scheduler.submit(request(10_000), tenant="A", group=f"a{i}") for i in range(4 * 8)]
    for _ in range(40):
        scheduler.step()
    assert tenants_of(scheduler, {"A": a, "B": b}) == {"A": 4, "B": 4}
    assert abs(scheduler.served["A"] - scheduler.served["B"]) <= 0.25 * scheduler.served["B"]


def test_preempted_choice_keeps_its_text_and_finishes_its_budget():
    scheduler = FairScheduler(FakeEngine(), max_batch=1, quantum=4)  # one slot, two tenants: time slices
    b = scheduler.submit(request(20), tenant="B")
    for _ in range(6):
        scheduler.step()
    a = scheduler.submit(request(3), tenant="A")
    scheduler.run()
    assert scheduler.preempted >= 1
    assert a.stop.generated == [7] * 3 and b.stop.generated == [7] * 20 and b.stop.finish_reason == "length"


def test_within_a_tenant_a_new_request_goes_before_a_running_requests_other_choices():
    scheduler = FairScheduler(FakeEngine(), max_batch=2)
    big = [scheduler.submit(request(4), tenant="B", group="big") for _ in range(8)]
    scheduler.step()
    small = scheduler.submit(request(2), tenant="B", group="small")
    while not big[0].finished:
        scheduler.step()
    scheduler.step()
    assert any(r is small for r in scheduler.running)
    assert not any(r is big[4] for r in scheduler.running)


def test_priority_orders_a_tenants_requests_lower_first():
    scheduler = FairScheduler(FakeEngine(), max_batch=1)
    late = scheduler.submit(request(2), tenant="A", group="x", priority=5)
    early = scheduler.submit(request(2), tenant="A", group="y", priority=-1)
    scheduler.step()
    assert scheduler.running == [early] and not late.finished


def test_per_tenant_cap_and_weights():
    capped = FairScheduler(FakeEngine(), max_batch=8, max_running=3)
    mine = [capped.submit(request(50), tenant="B") for _ in range(8)]
    capped.step()
    assert len(capped.running) == 3 and len(capped.waiting) == 5 and all(r in mine for r in capped.running)

    weighted = FairScheduler(FakeEngine(), max_batch=8, weights={"gold": 3.0})
    gold = [weighted.submit(request(10_000), tenant="gold") for _ in range(16)]
    plain = [weighted.submit(request(10_000), tenant="plain") for _ in range(16)]
    for _ in range(20):
        weighted.step()
    assert tenants_of(weighted, {"gold": gold, "plain": plain}) == {"gold": 6, "plain": 2}


def test_an_idle_tenant_banks_no_credit():
    scheduler = FairScheduler(FakeEngine(), max_batch=2)
    scheduler.submit(request(100), tenant="B")
    scheduler.submit(request(100), tenant="B")
    for _ in range(50):
        scheduler.step()
    scheduler.submit(request(100), tenant="A")
    assert scheduler.served["A"] >= min(scheduler.served.values()) and scheduler.served["A"] > 0


def test_queue_counts_requests_and_queued_tokens_per_tenant():
    scheduler = FairScheduler(FakeEngine(), max_batch=1)
    for _ in range(4):
        scheduler.submit(request(10, prompt=6), tenant="B", group="one")
    scheduler.submit(request(10, prompt=6), tenant="A", group="two")
    assert scheduler.waiting_groups() == {"one", "two"}
    assert scheduler.queued_tokens("B") == 4 * 16 and scheduler.group_size("one") == 4 and scheduler.group_size("three") == 0


def test_charges_of_idle_tenants_that_owe_nothing_are_dropped():
    """An open server's tenant header may name any tenant: the charges kept stay bounded."""
    scheduler = FairScheduler(FakeEngine(), max_batch=4)
    for i in range(50):
        scheduler.submit(request(2), tenant=f"t{i}")
    scheduler.run()
    assert scheduler.served == {} and scheduler.group_served == {}


# ---- with the engine (a tiny random target): what the step's prefill budget serves first ------------------


def _decoder(tiny_target, chunk: int = 4):
    from onlinespec.decoding.speculative import SpeculativeDecoder

    return SpeculativeDecoder(tiny_target, prefill_chunk=chunk)


@pytest.mark.parametrize("scored", [False, True], ids=["plain", "echo-logprobs"])
def test_a_long_prompt_alone_prefills_in_bounded_steps_and_a_request_arriving_meanwhile_starts_first(tiny_target, scored):
    """Issue 46: on an empty batch a long prompt ran whole in one step (a scored one, every chunk
    but its last), so a request arriving meanwhile waited for all of it; now every step prefills
    at most ``prefill_chunk`` tokens, and the newcomer's short prompt joins at the next step."""
    decoder = _decoder(tiny_target)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True, prompt_logprobs=1 if scored else None)
    prompt = [1, 2, 3, 4, 5] * 4
    scheduler = FairScheduler(decoder.engine, max_batch=4)
    long = scheduler.submit(decoder.request(prompt, params), tenant="B")
    _, report = scheduler.step()
    assert report.prefill_tokens <= 4 and not long.stop.generated
    short = scheduler.submit(decoder.request([2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True)), tenant="A")
    scheduler.step()
    assert short.stop.generated and not long.stop.generated
    scheduler.run()
    alone = _decoder(tiny_target, chunk=256).generate(prompt, params)
    assert long.stop.generated == alone.token_ids  # the same text, prefilled in chunks or at once
    if scored:
        assert [p.token for p in long.prompt_logprobs[1:]] == [p.token for p in alone.prompt_logprobs[1:]]
        assert [p.logprob for p in long.prompt_logprobs[1:]] == pytest.approx([p.logprob for p in alone.prompt_logprobs[1:]], abs=1e-4)


def test_the_steps_prefill_budget_goes_to_the_less_served_tenant_first(tiny_target):
    """Issue 46: the prefill budget went in order of admission, so tenant B's long prompt, admitted
    first, took every step's budget until it was done, and tenant A's new short prompt waited
    behind it (A's time to first token: all of B's prefill). It goes in the fair order now."""
    decoder = _decoder(tiny_target)
    scheduler = FairScheduler(decoder.engine, max_batch=4)
    running = scheduler.submit(decoder.request([1, 2], SamplingParams(max_new_tokens=50, ignore_eos=True)), tenant="A", group="a1")
    scheduler.step()  # A's first request decodes: the batch is not empty
    long = scheduler.submit(decoder.request([1, 2, 3, 4, 5] * 8, SamplingParams(max_new_tokens=3, ignore_eos=True)), tenant="B", group="b")
    scheduler.step()
    short = scheduler.submit(decoder.request([3, 1, 4], SamplingParams(max_new_tokens=2, ignore_eos=True)), tenant="A", group="a2")
    scheduler.step()
    assert short.stop.generated and not long.stop.generated  # before: B's 40-token prompt first, 4 tokens a step
    assert not running.finished
    scheduler.run()
    assert long.stop.generated == _decoder(tiny_target).generate([1, 2, 3, 4, 5] * 8, SamplingParams(max_new_tokens=3, ignore_eos=True)).token_ids


def test_a_tenant_ahead_of_another_prefills_a_rows_time_a_step_while_the_other_decodes(tiny_target):
    """Issue 46: tenant B's long prompt took the step's whole prefill budget every step (on the
    llama.cpp target a 256-token scored chunk is seconds, a decoding step a tenth of one), each of
    tenant A's steps paying for it; then a row's block (k + 1 tokens) every step, which for a
    4k-token prompt scored after 3,000 cached tokens still cost ten rows' time a step. Now B
    prefills up to PREFILL_SLACK tokens past A's charge, then a row's block only when the rows'
    time it waited covers the block: its prefill costs A's steps what one more row of B would
    (at most one block ahead), and its text is the same."""
    decoder = _decoder(tiny_target, chunk=16)
    scheduler = FairScheduler(decoder.engine, max_batch=4)
    a = scheduler.submit(decoder.request([1, 2], SamplingParams(max_new_tokens=250, ignore_eos=True)), tenant="A", group="a")
    scheduler.step()
    prompt, params = [1, 2, 3, 4, 5] * 20, SamplingParams(max_new_tokens=3, ignore_eos=True)
    b = scheduler.submit(decoder.request(prompt, params), tenant="B", group="b")
    reports = []
    while not b.stop.generated:
        reports.append(scheduler.step()[1])
    assert not a.finished
    prefilled = [report.prefill_tokens for report in reports]
    assert prefilled[:4] == [16] * 4  # PREFILL_SLACK (64) in chunks of 16 (before: 16 every step)
    assert prefilled[4] <= 4 + 1  # what A was served meanwhile (a token a step)
    paced = reports[5:]
    assert max(report.prefill_tokens for report in paced) <= decoder.engine.k + 1  # then a row's block at most
    spent = sum(report.prefill_seconds for report in paced)  # B's prefill forwards, each on credit
    earned = sum(report.target_seconds for report in reports[4:])  # A's one row: what one more row cost, each step past the share
    assert spent <= earned + max(report.prefill_seconds for report in paced)  # one block's overdraft at most
    scheduler.run()
    assert b.stop.generated == _decoder(tiny_target).generate(prompt, params).token_ids


def test_a_tenant_held_at_its_share_of_the_slots_never_paces_another_tenants_prompt(tiny_target):
    """Issue 46 (the abuse benchmark): tenant B's 16-choice requests hold B at its share of the
    slots, so B's charge lags whatever it asks; tenant A's prompts ran past B's charge at once and
    were paced to a row's block a step, and A's time to first token was 10x its time alone. Now a
    tenant held at its share with choices waiting paces no one: A's prompt prefills a chunk a step,
    as alone."""
    decoder = _decoder(tiny_target, chunk=16)
    scheduler = FairScheduler(decoder.engine, max_batch=4)
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)
    b = [scheduler.submit(decoder.request([3, 4, 5], params), tenant="B", group="b") for _ in range(8)]
    for _ in range(3):
        scheduler.step()
    prompt = [1, 2, 3, 4, 5] * 40  # 200 tokens: 13 chunks of 16
    a = scheduler.submit(decoder.request(prompt, SamplingParams(max_new_tokens=2, ignore_eos=True)), tenant="A", group="a")
    steps = 0
    while not a.stop.generated:
        scheduler.step()
        steps += 1
        assert steps <= 20, "A's prompt was paced behind B's charge"
    assert steps <= len(prompt) // 16 + 1  # a chunk a step, as alone (before: 5 chunks, then 4 tokens a step)
    assert scheduler.served["A"] > scheduler.served["B"] + 64  # A is ahead: the old rule would have paced it
    assert sum(r in scheduler.running for r in b) == 3 and scheduler.preempted == 1
    scheduler.run()
    assert a.stop.generated == _decoder(tiny_target).generate(prompt, SamplingParams(max_new_tokens=2, ignore_eos=True)).token_ids


def _reference_next(scheduler: FairScheduler, whose: dict[RequestState, tuple]) -> RequestState:
    """The choice to admit by a plain scan of every waiting one (as the scheduler did before its
    queue became heaps, issue 50): of the tenants under their share (any under their cap when none
    is), the least (charge over weight, priority, its request's tokens served, first come).
    ``whose``: request -> (tenant, group, priority, seq), as the test submitted it."""
    weight = lambda t: scheduler.weights.get(t, 1.0)  # noqa: E731
    holding: dict[str, int] = {}
    for r in scheduler.running:
        holding[whose[r][0]] = holding.get(whose[r][0], 0) + 1
    waiting = [(whose[r], r) for r in scheduler.waiting.values()]
    queued = {w[0] for w, _ in waiting}
    busy = queued | set(holding)
    share = {t: scheduler.max_batch * weight(t) / sum(weight(b) for b in busy) for t in busy}
    starved = {t for t in queued if holding.get(t, 0) < min(max(int(share[t]), 1), scheduler.max_running)}
    allowed = {t for t in (starved or queued) if holding.get(t, 0) < scheduler.max_running}
    charge, served = {t: scheduler.served[t] / weight(t) for t in allowed}, scheduler.group_served
    return min((charge[t], p, served[g], seq, r) for (t, g, p, seq), r in waiting if t in allowed)[4]


@pytest.mark.parametrize("setup, choices", [(dict(max_batch=8, max_running=7, weights={"B": 2.0}), 5000), (dict(max_batch=2, quantum=2), 1500)],
                         ids=["shares", "time-slices"])
def test_5000_waiting_choices_of_3_tenants_are_admitted_in_the_plain_scans_order(setup, choices):
    """Priorities, requests of several choices, tenants arriving late (preemptions), weights and
    time slices: every admission is the one a scan of the whole queue picks, and a new request
    starts at its tenant's least tokens served (issue 50: the queue is heaps, not scans)."""
    rng = random.Random(50)
    scheduler = FairScheduler(FakeEngine(), **setup)
    whose: dict[RequestState, tuple] = {}
    admitted, start = [], scheduler._start

    def checked_start(request):
        assert request is _reference_next(scheduler, whose)
        admitted.append(request)
        start(request)

    scheduler._start = checked_start
    few = lambda tenant: lambda: tenant in seen and scheduler.queued_tokens(tenant) < 60  # noqa: E731
    waves = [(lambda: steps == 0, "B", 800), (lambda: steps == 3, "A", 600), (lambda: steps == 40, "C", 600),
             (few("B"), "B", 1000), (few("A"), "A", 1000), (few("C"), "C", 1000)]  # when, who, how many choices
    waves = [(when, tenant, n * choices // 5000) for when, tenant, n in waves]
    steps, seen = 0, set()
    while scheduler.has_work or waves:
        for wave in [w for w in waves if w[0]()]:
            waves.remove(wave)
            tenant, n = wave[1], wave[2]
            seen.add(tenant)
            present = {whose[r][1] for r in whose if whose[r][0] == tenant and not r.finished}  # its requests with work
            floor = min((scheduler.group_served[g] for g in present), default=0)
            assert floor > 0 or not present
            while n > 0:
                group, priority, size = f"{tenant}{len(whose)}", rng.choice([-1, 0, 0, 2]), min(rng.randint(1, 4), n)
                for _ in range(size):
                    r = scheduler.submit(request(rng.choice([1, 2, 3, 5, 8, 13]), prompt=rng.randint(2, 6)), tenant, group, priority)
                    whose[r] = (tenant, group, priority, len(whose))
                assert scheduler.group_served[group] == floor  # a new request starts at the least of its tenant's
                n -= size
        scheduler.step()
        steps += 1
        if steps % 50 == 0:
            waiting = list(scheduler.waiting.values())
            assert scheduler.queued_tokens("B") == sum(len(r.ids) + r.stop.remaining for r in waiting if whose[r][0] == "B")
            assert scheduler.waiting_groups() == {whose[r][1] for r in waiting} and scheduler.waiting_requests() == len(scheduler.waiting_groups())
    assert len(whose) == choices and len(set(admitted)) == choices and scheduler.preempted > 0
    assert len(admitted) == choices + scheduler.preempted and scheduler.served == {} and scheduler.group_served == {}


def test_held_tenants_decode_share_settles_at_its_bound_and_one_share_is_a_bad_setting():
    """The decode share's bookkeeping (``onlinespec.decoding.step_shares``): with a held tenant's
    rows charged their part of each contested step, its rows sit out just often enough that its
    share of the decode time settles at the bound; 1.0 never sits out; a share of 0 is refused."""
    from onlinespec.decoding.step_shares import DecodeShare

    share, decoded = DecodeShare(0.4), 0
    for _ in range(200):  # A's 4 rows and B's 4: a mixed step 60 ms, A's alone 30 ms
        if share.sits_out():
            share.charge(0.0, 0.030)
        else:
            share.charge(0.030, 0.030)
            decoded += 1
    assert 0.35 <= share.held_seconds / (share.held_seconds + share.within_seconds) <= 0.45
    assert 100 <= decoded <= 160  # B decodes in two steps of three, not every one
    never = DecodeShare(1.0)
    for _ in range(20):
        assert not never.sits_out()
        never.charge(0.06, 0.01)
    with pytest.raises(ValueError, match="held_share"):
        DecodeShare(0.0)


def test_rows_that_sit_steps_out_on_the_torch_batch_cache_keep_their_text(tiny_target):
    """The torch runner pads every row of its batch cache, so its scheduler never sits rows out
    (no time saved); when told to anyway, a row given no block keeps no column and every answer
    is the target alone's (the same mechanism as llama.cpp's, where it saves the row's time)."""
    decoder = _decoder(tiny_target)
    assert not decoder.engine.parkable_rows() and not decoder.engine.runner.idle_rows_free
    decoder.engine.runner.idle_rows_free = True  # this instance only
    scheduler = FairScheduler(decoder.engine, max_batch=4, held_share=0.4)
    a_params, b_params = SamplingParams(max_new_tokens=40, ignore_eos=True), SamplingParams(max_new_tokens=8, ignore_eos=True)
    a = scheduler.submit(decoder.request([1, 2, 3], a_params), tenant="A", group="a")
    b = [scheduler.submit(decoder.request([4, 5], b_params), tenant="B", group="b") for _ in range(6)]
    scheduler.run()
    assert scheduler.decode_share.sat_out > 0
    alone = _decoder(tiny_target)
    assert a.stop.generated == alone.generate([1, 2, 3], a_params).token_ids
    assert all(r.stop.generated == alone.generate([4, 5], b_params).token_ids for r in b)
