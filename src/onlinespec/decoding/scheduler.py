"""Continuous batching with fair admission: which waiting request takes a free slot of the batch.

A request waits in the admission queue until a slot is free; it then joins at the next step (its
prompt prefilled in chunks, :mod:`onlinespec.decoding.engine`) and leaves as soon as it finishes.
Who gets a free slot is weighted fair queueing over tokens (docs/serve.md, "Scheduling"):

* between **tenants**: each tenant is charged the tokens it was served (its prompts once, as they
  prefill, and each new token); a free slot goes to the tenant with work waiting whose charge over
  its weight is least. A tenant that had no work starts at the least charge among those that have
  (no credit banked while idle). When a tenant with work waiting holds fewer slots than its share
  (``max_batch`` x its weight over the weights of the tenants with work), a running choice of a
  tenant over its share is preempted: it leaves the batch, keeps its text, and prefills its tokens
  again when it is admitted next (as vLLM recomputes a preempted request,
  :meth:`RequestState.recompute`), or copies its own cells where the runner's prefix cache kept
  them (llama.cpp). One tenant may so use every slot while it is alone, and not one more than its
  share once another has work waiting. When shares round to less than a slot (more tenants with
  work than slots), slots turn over in time slices of ``quantum`` new tokens, to the least charged
  tenant.
* within a **step**: the engine spends its prefill budget on the running choices of the least
  charged tenant first (a tenant's own in order of admission). A tenant held at its share of the
  slots with choices waiting prefills a row's block a step on credit while a tenant within its
  share runs; between the others, each prefills at most up to ``PREFILL_SLACK`` tokens past the
  least charged other's charge (``RequestState.prefill_share``, :func:`prefill_shares`; a choice
  one row's block, k + 1 tokens, at least): another tenant's long prompt, or its preempted
  choices' texts, run a few tokens a step as the others are served, and never make their steps
  seconds long. While such a held tenant decodes beside a tenant within its share, it gets at
  most ``held_share`` of the time (its rows' and its prompts') and sits out the steps past it,
  its rows' caches kept (:class:`~onlinespec.decoding.step_shares.DecodeShare`; on llama.cpp, where a row
  that sits out costs the forward nothing).
* within a tenant, between **requests** (a ``group``: the ``n`` choices of one HTTP request
  share one): lower ``priority`` first (vLLM's field), then the request with the fewest tokens
  served, then first come. A 16-choice request is 16 units of work, each choice a slot.
* ``max_running`` caps the slots one tenant holds (None: ``max_batch``).

No call scans the queue: each tenant's waiting choices are kept in heaps (:class:`_TenantQueue`),
so submit, admission, step and finish cost O(log W) in the waiting choices W, and O(tenants).

``submit`` may be called from any thread; ``step`` from one thread only (the engine's loop). A
step that raises is recovered once (:meth:`~onlinespec.decoding.engine.SpeculativeEngine.recompute`);
a second in a row is raised to the caller.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass

from onlinespec.decoding.engine import SpeculativeEngine, StepReport
from onlinespec.decoding.request import RequestState
from onlinespec.decoding.step_shares import DEFAULT_HELD_SHARE, DecodeShare, prefill_shares

DEFAULT_MAX_BATCH = 8  # requests verified per step
DEFAULT_QUANTUM = 512  # new tokens a choice runs before a time slice may preempt it (more tenants with work than slots)


@dataclass
class _Entry:
    """What the queue keeps of one choice: whose it is and its place."""

    tenant: str
    group: object
    priority: int
    seq: int
    request: RequestState
    charged: bool = False  # it was admitted once (its time in the queue is measured)
    prompt: int = 0  # its prompt tokens charged so far (as they prefill, once: a preempted choice's refill is not)
    seen: int = 0  # its new tokens charged so far
    since: int = 0  # its new tokens when it was last admitted
    stamp: int | None = None  # while it waits: the stamp of its item in its bucket's heap
    queued: int = 0  # while it waits: its tokens counted in its tenant's queued tokens


class _Bucket:
    """The waiting choices of one request (group) at one priority, first come first: they share
    the rest of the order's key (priority, the group's tokens served)."""

    __slots__ = ("group", "priority", "heap", "size", "stamp")

    def __init__(self, group: object, priority: int) -> None:
        self.group, self.priority = group, priority
        self.heap: list[tuple[int, int, _Entry]] = []  # (seq, stamp, entry); an item whose stamp is not its entry's is gone
        self.size = 0  # choices waiting
        self.stamp = -1  # the stamp of its one live item in its tenant's order

    def first(self) -> _Entry:
        """The waiting choice that came first (stale items dropped on the way)."""
        while self.heap[0][1] != self.heap[0][2].stamp:
            heapq.heappop(self.heap)
        return self.heap[0][2]


class _TenantQueue:
    """One tenant's choices, so that no call scans them all: its waiting ones by (priority, their
    group's tokens served, first come), a heap of its buckets (:class:`_Bucket`), and its groups
    by tokens served. Both heaps are re-keyed lazily: a group's tokens served only grow while it
    has a choice and a bucket's first seq only grows as choices leave, so a stored key is never
    above the true one; the top is checked against the truth and pushed again when it fell behind.
    A key that falls (a bucket's new first choice, a group joining) is pushed at once with a new
    stamp, the old item left to be dropped when it surfaces (or when the heap is compacted)."""

    def __init__(self) -> None:
        self.entries = 0  # choices queued or running
        self.waiting = 0  # choices waiting
        self.queued = 0  # tokens the waiting choices may still cost (text + budget left)
        self._stamps = itertools.count()
        self._buckets: dict[tuple[object, int], _Bucket] = {}  # (group, priority) -> its waiting choices
        self._order: list = []  # (priority, group served, first seq, stamp, bucket)
        self._groups: dict[object, list[int]] = {}  # group -> [its choices queued or running, stamp]
        self._least: list = []  # (group served, stamp, group)

    def join(self, entry: _Entry, served: dict) -> None:
        """Count a new choice (queued or running) of ``entry.group``."""
        self.entries += 1
        record = self._groups.get(entry.group)
        if record is not None:
            record[0] += 1
            return
        self._groups[entry.group] = [1, next(self._stamps)]
        heapq.heappush(self._least, (served[entry.group], self._groups[entry.group][1], entry.group))
        if len(self._least) > 2 * len(self._groups) + 16:
            self._least = [i for i in self._least if i[1] == self._groups.get(i[2], (0, -1))[1]]
            heapq.heapify(self._least)

    def leave(self, entry: _Entry) -> None:
        self.entries -= 1
        record = self._groups[entry.group]
        record[0] -= 1
        if not record[0]:
            del self._groups[entry.group]

    def least_served(self, served: dict) -> int:
        """The least tokens served of this tenant's groups (0: none)."""
        while self._least:
            value, stamp, group = self._least[0]
            if self._groups.get(group, (0, -1))[1] != stamp:
                heapq.heappop(self._least)
            elif served[group] != value:
                heapq.heapreplace(self._least, (served[group], stamp, group))
            else:
                return value
        return 0

    def push(self, entry: _Entry, tokens: int, served: dict) -> None:
        """``entry`` waits (submitted, or preempted); ``tokens``: what it may still cost."""
        self.waiting, self.queued, entry.queued = self.waiting + 1, self.queued + tokens, tokens
        bucket = self._buckets.get((entry.group, entry.priority))
        if bucket is None:
            bucket = self._buckets[(entry.group, entry.priority)] = _Bucket(entry.group, entry.priority)
        lower = not bucket.size or entry.seq < bucket.first().seq
        entry.stamp = next(self._stamps)
        heapq.heappush(bucket.heap, (entry.seq, entry.stamp, entry))
        bucket.size += 1
        if lower:  # the bucket's key fell: a new item, the old one (if any) stale
            bucket.stamp = entry.stamp
            heapq.heappush(self._order, (entry.priority, served[entry.group], entry.seq, bucket.stamp, bucket))
            if len(self._order) > 2 * len(self._buckets) + 16:
                self._order = [i for i in self._order if i[4].size and i[4].stamp == i[3]]
                heapq.heapify(self._order)

    def drop(self, entry: _Entry) -> None:
        """``entry`` waits no more (admitted or cancelled)."""
        self.waiting, self.queued, entry.stamp = self.waiting - 1, self.queued - entry.queued, None
        bucket = self._buckets[(entry.group, entry.priority)]
        bucket.size -= 1
        if not bucket.size:
            del self._buckets[(entry.group, entry.priority)]

    def first(self, served: dict) -> _Entry | None:
        """The waiting choice that goes first: least (priority, its group's tokens served, seq)."""
        while self._order:
            priority, value, seq, stamp, bucket = self._order[0]
            if not bucket.size or bucket.stamp != stamp:
                heapq.heappop(self._order)
                continue
            key = (priority, served[bucket.group], bucket.first().seq)
            if key == (priority, value, seq):
                return bucket.first()
            heapq.heapreplace(self._order, (*key, stamp, bucket))
        return None


class FairScheduler:
    """The admission queue and the batch's slots, shared fairly between tenants and requests."""

    def __init__(self, engine: SpeculativeEngine, max_batch: int = DEFAULT_MAX_BATCH, max_running: int | None = None,
                 weights: dict[str, float] | None = None, quantum: int = DEFAULT_QUANTUM,
                 held_share: float = DEFAULT_HELD_SHARE) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_running is not None and max_running < 1:
            raise ValueError(f"max_running must be >= 1 (or None: max_batch), got {max_running}")
        if any(not w > 0 for w in (weights or {}).values()):
            raise ValueError(f"tenant weights must be > 0, got {weights}")
        self.engine, self.max_batch = engine, max_batch
        self.max_running = min(max_running or max_batch, max_batch)
        self.weights, self.quantum = dict(weights or {}), max(quantum, 1)
        self.waiting: dict[int, RequestState] = {}  # id -> request, first come first
        self.running: list[RequestState] = []
        self.served: dict[str, float] = {}  # tenant -> tokens served (prompts once, new tokens)
        self.group_served: dict[object, int] = {}  # group -> tokens served, while the group has work
        self.preempted = 0  # choices taken out of the batch to give a slot to another tenant
        self.decode_share = DecodeShare(held_share)  # held tenants' time while another decodes (raises on a bad share)
        self._entries: dict[int, _Entry] = {}
        self._queues: dict[str, _TenantQueue] = {}  # the tenants with work (a choice queued or running)
        self._group_sizes: dict[object, int] = {}  # group -> its choices queued or running
        self._waiting_groups: dict[object, int] = {}  # group -> its choices waiting
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self.failed_steps = 0  # engine steps that raised in a row

    # ---- the queue (any thread) -------------------------------------------------------------

    def submit(self, request: RequestState, tenant: str = "", group: object = None, priority: int = 0) -> RequestState:
        """Queue ``request`` for ``tenant``; ``group``: the HTTP request its choice belongs to (None:
        a group of its own); ``priority``: lower first within the tenant (vLLM's)."""
        with self._lock:
            entry = _Entry(tenant, group if group is not None else ("own", id(request)), priority, next(self._seq), request)
            queue = self._queues.get(tenant)
            if queue is None:  # no credit banked while idle: start at the least charge of the busy ones
                busy = [self._charge(t) for t in self._queues]
                self.served[tenant] = max(self.served.get(tenant, 0.0), min(busy, default=0.0) * self._weight(tenant))
                queue = self._queues[tenant] = _TenantQueue()
            if entry.group not in self.group_served:  # a new request starts at the least of its tenant's
                self.group_served[entry.group] = queue.least_served(self.group_served)
            self._group_sizes[entry.group] = self._group_sizes.get(entry.group, 0) + 1
            queue.join(entry, self.group_served)
            self._entries[id(request)] = entry
            self._enqueue(entry)
        return request

    def cancel(self, request: RequestState) -> None:
        """Drop a request (a client that went away); its slot frees at the next step."""
        with self._lock:
            if request in self.running:
                self.running.remove(request)
            self._forget(request)  # and out of the queue, if it waits

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def waiting_groups(self) -> set:
        """The requests (groups) with a choice waiting for a slot."""
        with self._lock:
            return set(self._waiting_groups)

    def waiting_requests(self) -> int:
        """How many requests (groups) have a choice waiting for a slot (what the queue's limit counts)."""
        with self._lock:
            return len(self._waiting_groups)

    def queued_tokens(self, tenant: str) -> int:
        """The tokens ``tenant``'s waiting choices may still cost: their text and the new tokens left
        in their budgets (counted as each starts waiting: they do not change while it waits)."""
        with self._lock:
            queue = self._queues.get(tenant)
            return queue.queued if queue is not None else 0

    def group_size(self, group: object) -> int:
        """The choices of ``group`` (one request) still queued or running."""
        with self._lock:
            return self._group_sizes.get(group, 0)

    # ---- one step (the engine thread) --------------------------------------------------------

    def step(self) -> tuple[list[RequestState], StepReport | None]:
        """Admit (and preempt), run one engine step; return the requests it advanced (finished
        ones included)."""
        with self._lock:
            self._admit()
            # the engine spends the step's prefill budget in this order: the least charged tenant's first (a
            # tenant's own in order of admission), so one tenant's long prompt never holds back another's
            entries = [self._entries[id(r)] for r in self.running]
            ranked = sorted(zip(self.running, entries), key=lambda p: self._charge(p[1].tenant))
            active = [r for r, _ in ranked]
            tenants = {e.tenant for e in entries}
            held = {t for t in tenants if self._queues[t].waiting} - self._starved_tenants()  # at their share, work waiting
            shares = prefill_shares(tenants, held, self._charge, self._weight)
            for r, e in ranked:
                r.prefill_share = shares.get(e.tenant)
            turn = self.decode_share.turn(self.engine.parkable_rows(), self.running, lambda r: self._entries[id(r)].tenant, held)
        if not active:
            return [], None
        try:
            report = self.engine.step(active, turn.idle if turn else frozenset())
            self.failed_steps = 0
        except Exception:
            self.failed_steps += 1
            if self.failed_steps > 1:  # twice in a row: not one request's doing
                raise
            # a batched forward raised and cannot say whose fault it was: every request prefills
            # its text again next step, each in a forward of its own, where a culprit fails alone
            logging.getLogger("onlinespec.scheduler").exception("a step failed: its %d requests recompute", len(active))
            self.engine.recompute(active)
            return [], None
        with self._lock:
            self._charge_step(active)
            if turn is not None:
                self.decode_share.charge_step(report, turn)
            for r in [r for r in self.running if r.finished]:
                self.running.remove(r)
                self._forget(r)
        return active, report

    def run(self) -> list[StepReport]:
        """Step until every submitted request has finished."""
        reports = []
        while self.has_work:
            _, report = self.step()
            if report is not None:
                reports.append(report)
        return reports

    # ---- the policy (under the lock) --------------------------------------------------------

    def _admit(self) -> None:
        """Fill free slots by fair order; preempt for a tenant under its share while one is over."""
        for _ in range(4 * self.max_batch + len(self.waiting)):  # each turn admits or preempts: a bound, never reached
            if len(self.running) < self.max_batch:
                request = self._next()
                if request is None:
                    return
                self._start(request)
                continue
            starved = min(self._starved_tenants(), key=lambda t: (self._charge(t), t), default=None)  # the least charged
            victim = self._victim(starved) if starved is not None else None
            if victim is None:
                return
            self._preempt(victim)

    def _next(self) -> RequestState | None:
        """The waiting choice to admit: of the tenants under their share (any under their cap when
        none is), the one whose charge over weight is least; then priority, then its request's
        tokens served, then first come."""
        holding, starved = self._holding(), self._starved_tenants()
        best, best_key = None, None
        for tenant, queue in self._queues.items():  # each tenant's first, then the least of those
            if not queue.waiting or holding.get(tenant, 0) >= self.max_running or (starved and tenant not in starved):
                continue
            e = queue.first(self.group_served)
            key = (self._charge(tenant), e.priority, self.group_served.get(e.group, 0), e.seq)
            if best_key is None or key < best_key:
                best, best_key = e.request, key
        return best

    def _starved_tenants(self) -> set[str]:
        """The tenants with a choice waiting that hold fewer slots than their share (rounded down,
        at least one, at most ``max_running``)."""
        holding, shares = self._holding(), self._shares()
        waiting = [t for t, queue in self._queues.items() if queue.waiting]
        return {t for t in waiting if holding.get(t, 0) < min(max(int(shares[t]), 1), self.max_running)}

    def _victim(self, starved: str) -> RequestState | None:
        """The running choice to preempt for ``starved``: one of the tenant most over its share
        (more slots than its share rounded up); else, when shares round to nothing (more tenants
        than slots), one that ran ``quantum`` new tokens since it was admitted, of a tenant charged
        ``quantum`` more than ``starved`` (a time slice). Of a tenant's, its request's with the most
        tokens served, the one admitted last. A choice scoring its prompt, or whose prompt the
        content router embeds, is never preempted (both are taken once, as the prompt prefills)."""
        holding, shares = self._holding(), self._shares()
        movable = [r for r in self.running if r.params.prompt_logprobs is None and not r.embed]
        over = [t for t in holding if t != starved and holding[t] > max(int(shares[t] + 0.999), 1)]
        if over:
            tenant = max(over, key=lambda t: (holding[t] - shares[t], t))
            mine = [r for r in movable if self._entries[id(r)].tenant == tenant]
        else:
            floor = self._charge(starved) + self.quantum
            mine = [r for r in movable if self._entries[id(r)].tenant != starved and self._charge(self._entries[id(r)].tenant) >= floor
                    and len(r.stop.generated) - self._entries[id(r)].since >= self.quantum]
        if not mine:
            return None
        return max(mine, key=lambda r: (self._charge(self._entries[id(r)].tenant), self.group_served.get(self._entries[id(r)].group, 0),
                                        self._entries[id(r)].seq))

    def _start(self, request: RequestState) -> None:
        entry = self._entries[id(request)]
        self._dequeue(entry)
        entry.since = len(request.stop.generated)
        if not entry.charged:
            request.stats.queued_seconds = time.perf_counter() - request.submitted
            entry.charged = True
        self.running.append(request)

    def _preempt(self, request: RequestState) -> None:
        self.running.remove(request)
        request.recompute()  # its rows leave the cache at the next step (engine._leave); its text stays
        self._enqueue(self._entries[id(request)])
        self.preempted += 1

    def _enqueue(self, entry: _Entry) -> None:
        r = entry.request
        self.waiting[id(r)] = r
        self._waiting_groups[entry.group] = self._waiting_groups.get(entry.group, 0) + 1
        self._queues[entry.tenant].push(entry, len(r.ids) + max(r.stop.remaining, 0), self.group_served)

    def _dequeue(self, entry: _Entry) -> None:
        del self.waiting[id(entry.request)]
        if self._waiting_groups[entry.group] > 1:
            self._waiting_groups[entry.group] -= 1
        else:
            del self._waiting_groups[entry.group]
        self._queues[entry.tenant].drop(entry)

    def _charge_step(self, active: list[RequestState]) -> None:
        for r in active:
            entry = self._entries.get(id(r))
            if entry is not None:  # its prompt as it prefills (so a long one paces its tenant as it runs), its new tokens
                done = len(r.stop.generated)
                prompt = len(r.prompt_ids) if done else min(r.prefilled, len(r.prompt_ids))
                self._add(entry, max(prompt - entry.prompt, 0) + done - entry.seen)
                entry.prompt, entry.seen = max(prompt, entry.prompt), done

    def _add(self, entry: _Entry, tokens: int) -> None:
        self.served[entry.tenant] = self.served.get(entry.tenant, 0.0) + tokens
        if entry.group in self.group_served:
            self.group_served[entry.group] += tokens

    def _forget(self, request: RequestState) -> None:
        """Drop a choice's entry; its request's count with its last choice, and its tenant's charge
        once that tenant is idle and owes nothing (it would restart at the least busy charge):
        the charges kept are bounded by the tenants with work, not by every tenant ever seen."""
        entry = self._entries.get(id(request))
        if entry is None or entry.request is not request:
            return
        if entry.stamp is not None:  # it waits (cancelled)
            self._dequeue(entry)
        del self._entries[id(request)]
        if self._group_sizes[entry.group] > 1:
            self._group_sizes[entry.group] -= 1
        else:
            del self._group_sizes[entry.group]
            self.group_served.pop(entry.group, None)
        queue = self._queues[entry.tenant]
        queue.leave(entry)
        if not queue.entries:
            del self._queues[entry.tenant]
        busy = self._queues
        floor = min((self._charge(t) for t in busy), default=None)
        for tenant in [t for t in self.served if t not in busy and (floor is None or self._charge(t) <= floor)]:
            del self.served[tenant]

    def _weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def _charge(self, tenant: str) -> float:
        return self.served.get(tenant, 0.0) / self._weight(tenant)

    def _holding(self) -> dict[str, int]:
        holding: dict[str, int] = {}
        for r in self.running:
            tenant = self._entries[id(r)].tenant
            holding[tenant] = holding.get(tenant, 0) + 1
        return holding

    def _shares(self) -> dict[str, float]:
        """Each tenant with work's share of the slots: ``max_batch`` x its weight over the total."""
        total = sum(self._weight(t) for t in self._queues) or 1.0
        return {t: self.max_batch * self._weight(t) / total for t in self._queues}


Scheduler = FairScheduler  # the name before issue 46 (a first-come queue), kept: one scheduler, one policy
