"""What each running tenant gets of one engine step: its prompt tokens, and whether its rows decode.

The fair scheduler (:mod:`onlinespec.decoding.scheduler`) decides who holds the batch's slots.
On a CPU the slots are not what one tenant takes from another: a batch row costs more than half
a step of its own (docs/engine.md: 8 one-token rows 43.8 ms where one costs 7-10 ms), so a
tenant holding half the slots nearly doubles the others' time per token. Two things are therefore
shared per step:

* **prompt tokens** (:func:`prefill_shares`): another tenant's long prompts, or its preempted
  choices' texts, run a few tokens a step as the others are served;
* **time** (:class:`DecodeShare`): a tenant held at its share of the slots with choices waiting
  (it asks for more than its share) gets at most ``held_share`` of the time while a tenant within
  its share decodes: counted are its rows' part of each batched forward (an equal part per row)
  and its prompts' forwards, against the other rows' part. In the steps past it, its requests sit
  out (:meth:`~onlinespec.decoding.engine.SpeculativeEngine.step`'s ``idle``): its rows keep their
  caches and decode nothing, its prompts neither prefill nor earn credit. Only on a runner where
  a row that sits out costs the forward nothing (llama.cpp; the torch runner pads every row of
  its batch cache). The other tenants' prompts are not counted: they are their own first tokens,
  which they would run alone too.

Equal weights would give the held tenants half of the time, and the others' time per token would
double on a CPU (the abuse benchmark measured 1.7-2.4x over four pairs, docs/reliability.md). At the default
0.45, a tenant asking for more than its share still gets 45% of the time whenever another
decodes (all of it while nobody else does), and the others' time per token stays within 2x on
this machine. That is a policy, chosen here: light tenants' latency first, a heavy tenant a
bounded share of the time, never nothing (``--held-decode-share``; 1.0 restores equal rows).
On a runner with a batching gain (a GPU) the rows that sit out cost the others little either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

PREFILL_SLACK = 64  # tokens a tenant may prefill in a step past the least charged other running tenant's charge
DEFAULT_HELD_SHARE = 0.45  # of the time, for the tenants over their share of the slots while another decodes
DECAY = 0.9  # per contested step: the time counted is about the last ten such steps'


def prefill_shares(tenants: set[str], held: set[str], charge: Callable[[str], float], weight: Callable[[str], float]) -> dict[str, list[int]]:
    """What each of the running ``tenants`` may prefill this step (absent: the step's whole
    budget; [0]: a row's block on credit, ``RequestState.prefill_share``), so that one tenant's
    long prompts and preempted texts never make the others' steps long (issue 46). ``held``: the
    tenants at their share of the slots with choices waiting; ``charge(t)``: a tenant's tokens
    served over its weight; ``weight(t)``: its weight.

    * a **held** tenant is paced whenever a tenant within its share runs beside it: it already
      has its share of the batch's rows, and a prompt token costs the others' steps what a row does;
    * between the others, each prefills up to ``PREFILL_SLACK`` tokens past the least charged of them.

    A held tenant's charge never paces a tenant within its share: it lags because the slots hold
    it back, not because it was refused the prefill, and a tenant within its share paced to it
    only makes every step slower for both (the abuse benchmark: tenant A's prompts prefilled a
    few tokens a step behind tenant B's 16-choice requests, docs/reliability.md)."""
    if len(tenants) < 2:
        return {}
    within = tenants - held
    if not within:  # every running tenant is held (more tenants than slots): their charges decide
        held, within = set(), tenants
    charges = {t: charge(t) for t in within}
    shares = {t: [0] for t in held}
    if len(charges) > 1:
        shares.update({t: [max(0, int((min(o for u, o in charges.items() if u != t) + PREFILL_SLACK - c) * weight(t)))]
                       for t, c in charges.items()})
    return shares


@dataclass(frozen=True)
class Turn:
    """A contested step: the requests that sit it out, the held tenants' rows that decode in it,
    and every request of the held tenants (whose prompt forwards count as theirs)."""

    idle: frozenset[int]
    held_rows: int
    held: frozenset[int]


@dataclass
class DecodeShare:
    """The time held tenants had while a tenant within its share decoded beside them, and the
    others' rows had (each exponentially decayed over the contested steps); whether the held
    tenants sit out the next such step."""

    held_share: float = DEFAULT_HELD_SHARE  # 1.0: never sit out
    held_seconds: float = 0.0
    within_seconds: float = 0.0
    sat_out: int = field(default=0, compare=False)  # steps in which the held tenants sat out

    def __post_init__(self) -> None:
        if not 0.0 < self.held_share <= 1.0:
            raise ValueError(f"held_share must be in (0, 1] (1: held tenants' rows never sit out), got {self.held_share}")

    def turn(self, rows: list, running: list, tenant: Callable[[object], str], held: set[str]) -> Turn | None:
        """The next step's turn, when the held tenants' rows decode beside another tenant's
        (None otherwise). ``rows``: the batch's rows that may sit out (the engine's
        ``parkable_rows``); ``running``: the scheduler's running requests; ``tenant(r)``: whose."""
        ids = {id(r) for r in running}
        rows = [r for r in rows if id(r) in ids and not r.finished]
        mine = [r for r in rows if tenant(r) in held]
        if not mine or len(mine) == len(rows):
            return None
        theirs = frozenset(id(r) for r in running if tenant(r) in held)
        if self.sits_out():
            self.sat_out += 1
            return Turn(theirs, 0, theirs)
        return Turn(frozenset(), len(mine), theirs)

    def sits_out(self) -> bool:
        """Whether the held tenants sit out the next contested step: their share of the time
        counted is past ``held_share``."""
        total = self.held_seconds + self.within_seconds
        return total > 0 and self.held_seconds > self.held_share * total

    def charge_step(self, report, turn: Turn) -> None:
        """A contested step's time (``report``: its :class:`~onlinespec.decoding.engine.StepReport`):
        each decoding row an equal part of the batched forward, and the held tenants' prompt
        forwards theirs."""
        part = report.target_seconds / report.batch if report.batch else 0.0
        own = sum(seconds for key, seconds in report.own_seconds.items() if key in turn.held)
        self.charge(part * turn.held_rows + own, part * (report.batch - turn.held_rows))

    def charge(self, held: float, within: float) -> None:
        """A contested step's seconds: the held tenants' (their rows' part of the batched forward,
        their prompts' forwards) and those within their share (their rows' part)."""
        self.held_seconds = DECAY * self.held_seconds + held
        self.within_seconds = DECAY * self.within_seconds + within
