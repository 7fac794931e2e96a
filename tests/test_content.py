"""The content router's decisions on synthetic prompt embeddings (the real target's are measured
in docs/routing.md): clusters without labels, a shift detected and given a draft of its own, a
returning domain sent back to its cluster, the static floor, merging, and a restart that routes
as before."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from onlinespec.routing.content import STATIC, ContentConfig, ContentRouter, PageHinkley


def domain_embeddings(seed: int = 0, dim: int = 64, noise: float = 0.12):
    """``draw(domain)``: unit vectors scattered around one direction per domain (cosine distance
    to their centre about 0.01-0.02; between centres about 1)."""
    g = torch.Generator().manual_seed(seed)
    centres = {d: torch.nn.functional.normalize(torch.randn(dim, generator=g), dim=0) for d in "abcd"}

    def draw(domain: str) -> torch.Tensor:
        return torch.nn.functional.normalize(centres[domain] + noise * torch.randn(dim, generator=g) / dim**0.5, dim=0)

    return draw


def serve(router: ContentRouter, draw, domains: str) -> list:
    return [router.assign(draw(d)) for d in domains]


def test_page_hinkley_stays_quiet_on_noise_and_fires_on_a_shift():
    rng = random.Random(0)
    alpha = PageHinkley(0.05, 1.5, direction=-1)
    assert not any(alpha.update(min(1.0, max(0.0, rng.gauss(0.7, 0.15)))) for _ in range(2000))
    fired = next(i for i in range(100) if alpha.update(min(1.0, max(0.0, rng.gauss(0.4, 0.15)))))
    assert fired < 20
    rise = PageHinkley(0.02, 0.3, direction=+1)
    assert not any(rise.update(abs(rng.gauss(0.03, 0.015))) for _ in range(2000))
    assert next(i for i in range(100) if rise.update(rng.gauss(0.12, 0.02))) < 10


def test_the_default_alpha_detector_is_quiet_on_served_noise_and_sees_a_fall_within_30_requests():
    """Per-request alpha is noisy: on a stationary chat stream of the real target its mean was
    0.44 and its standard deviation 0.38 (docs/routing.md). The default detector must not fire
    on that more than once per 500 requests, and must see a fall of 0.3 within 30."""
    rng = random.Random(0)
    draw = lambda mean, sd: min(1.0, max(0.0, rng.gauss(mean, sd)))  # noqa: E731
    detector = ContentRouter()._alpha_detector()
    assert sum(detector.update(draw(0.45, 0.38)) for _ in range(1000)) <= 2
    detector = ContentRouter()._alpha_detector()
    for _ in range(100):
        detector.update(draw(0.45, 0.38))
    assert next(i for i in range(100) if detector.update(draw(0.15, 0.3))) < 30


def test_a_new_domain_is_detected_and_gets_a_cluster_and_a_returning_one_its_own_again():
    draw = domain_embeddings()
    router = ContentRouter(ContentConfig(idle_requests=20))
    first = serve(router, draw, "a" * 40)
    assert {a.cluster for a in first} == {0}
    router.events.clear()
    shifted = serve(router, draw, "b" * 40)
    detected = next(i for i, a in enumerate(shifted) if router.cluster(a.cluster).id != 0)
    assert detected < 10
    kinds = [e["event"] for e in router.events]
    assert "drift" in kinds and "cluster" in kinds
    b = router.cluster(shifted[-1].cluster)
    assert b.live and b.id != 0 and b.draft is None  # the pool gives it a draft of its own
    router.events.clear()
    back = serve(router, draw, "a" * 10)
    assert {a.cluster for a in back} == {0}  # straight back to its own cluster: no new one
    assert [e["event"] for e in router.events] == ["cluster_returned"]


def test_a_return_is_seen_even_when_other_traffic_kept_the_cluster_busy():
    """Real traffic overlaps (chat prompts about code land in the code cluster), so a cluster is
    seldom idle between its visits: its return is the moment it takes most of the traffic again."""
    draw = domain_embeddings(seed=5)
    router = ContentRouter(ContentConfig(idle_requests=30))
    serve(router, draw, "a" * 40)
    serve(router, draw, "b" * 20)  # b founds its cluster
    router.events.clear()
    serve(router, draw, "".join("a" if i % 7 == 0 else "b" for i in range(60)))  # a trickle of a: never idle 30 requests
    assert [e for e in router.events if e["event"] == "cluster_returned"] == []
    seen_at = []
    for i in range(20):
        back = router.assign(draw("a"))
        seen_at += [i] * sum(e["event"] == "cluster_returned" for e in router.events)
        router.events.clear()
    assert len(seen_at) == 1 and seen_at[0] < 10  # once, within 10 requests of the return
    assert back.cluster == serve(router, draw, "a")[0].cluster != router.assign(draw("b")).cluster  # to a's own cluster
    again = ContentRouter.from_state(router.state())
    assert again._history == router._history and again.cluster(back.cluster).returned_at == router.cluster(back.cluster).returned_at is not None


def test_on_one_domain_nothing_is_detected():
    draw = domain_embeddings(seed=3)
    router = ContentRouter()
    serve(router, draw, "c" * 500)
    assert [e for e in router.events if e["event"] != "cluster"] == [] and len(router.clusters) == 1


def test_the_router_serves_the_best_scoring_draft_but_never_one_below_the_static_floor():
    router = ContentRouter(ContentConfig(switch_margin=0.01))
    cluster = router.assign(torch.ones(8)).cluster
    router.cluster(cluster).draft = "c0"
    available = {"c0", "c1", STATIC}
    assert router.choose(cluster, available) == "c0"  # nothing scored yet: its own draft
    for _ in range(20):
        router.score(cluster, {STATIC: 0.60, "c0": 0.66, "c1": 0.665})
    assert router.choose(cluster, available) == "c0"  # c1 is better, but not by the margin
    for _ in range(40):
        router.score(cluster, {STATIC: 0.60, "c0": 0.62, "c1": 0.70})
    assert router.choose(cluster, available) == "c1"
    weights = router.weights(router.cluster(cluster))
    assert max(weights, key=weights.get) == "c1" and abs(sum(weights.values()) - 1) < 1e-9
    for _ in range(60):
        router.score(cluster, {STATIC: 0.60, "c0": 0.55, "c1": 0.58})
    assert router.choose(cluster, available) == STATIC  # the floor: both learned drafts score below it
    assert router.choose(cluster, {"c0", "c1"}) == "c1"  # without the static draft: the best learned one


def test_a_new_draft_starts_from_its_parents_score_not_one_lucky_request():
    router = ContentRouter()
    cluster = router.assign(torch.ones(8)).cluster
    for _ in range(30):
        router.score(cluster, {STATIC: 0.6, "c0": 0.6})
    router.score(cluster, {STATIC: 0.6, "c0": 0.6, "c9": 0.95})  # spawned elsewhere, scored here once
    assert router.cluster(cluster).mean_score("c9") < 0.62


def test_converging_clusters_merge_and_the_worse_scoring_draft_is_retired():
    draw = domain_embeddings(seed=5)
    router = ContentRouter(ContentConfig(threshold=0.08, merge_threshold=0.05))
    serve(router, draw, "a" * 30)
    a = router.cluster(0)
    a.draft = "c0"
    # a second cluster, made live by hand near a's centre, then pulled onto it
    near = torch.nn.functional.normalize(torch.tensor(a.centroid) + 0.5 * draw("b"), dim=0)
    b = router._new(near, "test", [])
    b.draft = "c1"
    for _ in range(10):
        router.score(b.id, {STATIC: 0.5, "c0": 0.55, "c1": 0.7})
    router.events.clear()
    for _ in range(200):
        router._join(b, draw("a"), None)
    router._maybe_merge(b)
    [merge] = [e for e in router.events if e["event"] == "merge"]
    assert len([k for k in router.clusters.values() if k.live]) == 1
    assert merge["draft"] == "c1" and merge["retired"] == "c0"  # c1 scored better on the merged traffic


def test_a_restart_routes_as_before():
    draw = domain_embeddings(seed=7)
    router = ContentRouter()
    serve(router, draw, "a" * 30 + "b" * 30)
    for cluster in router.clusters.values():
        cluster.draft = f"c{cluster.id}"
    again = ContentRouter.from_state(router.state())
    probes = [draw(d) for d in "abab"]
    assert [router.assign(p).cluster for p in probes] == [again.assign(p).cluster for p in probes]
    assert again.summary() == router.summary()


def test_a_restart_in_the_middle_of_a_shift_founds_the_new_cluster_as_the_running_router_would():
    draw = domain_embeddings(seed=11)
    router = ContentRouter()
    serve(router, draw, "a" * 40)
    probes = [draw("b") for _ in range(12)]
    for i in range(len(probes)):  # restarted after each of b's first prompts (far ones pending, an alarm raised or not)
        restarted, running = ContentRouter.from_state(router.state()), copy.deepcopy(router)
        assert [restarted.assign(p).cluster for p in probes[i:]] == [running.assign(p).cluster for p in probes[i:]], i
        router.assign(probes[i])
    assert len([k for k in router.clusters.values() if k.live]) == 2  # b was founded on the way


def test_a_restart_takes_the_detectors_settings_in_force_and_keeps_what_they_saw():
    draw = domain_embeddings(seed=12)
    router = ContentRouter()
    serve(router, draw, "a" * 30)
    again = ContentRouter.from_state(router.state(), ContentConfig(distance_lambda=7.0, alpha_lambda=9.0))
    assert again.distance.threshold == 7.0 and all(k.alpha.threshold == 9.0 for k in again.clusters.values())
    assert (again.distance.n, again.distance.cumulative) == (router.distance.n, router.distance.cumulative)


def test_bad_settings_are_refused_with_what_to_fix():
    with pytest.raises(ValueError, match="merge_threshold < threshold"):
        ContentConfig(threshold=0.05, merge_threshold=0.1)
    with pytest.raises(ValueError, match="must be > 0"):
        ContentConfig(alpha_lambda=0)


def test_a_purge_takes_a_far_prompt_out_of_the_router_and_its_saved_state():
    """A prompt far from every cluster is kept whole (an embedding of that one prompt) until a
    cluster is founded: a purge of its request removes it, and the saved state no longer has it."""
    import json

    draw = domain_embeddings(seed=11)
    router = ContentRouter()
    serve(router, draw, "a" * 40)
    router.assign(draw("b"), request_id="secret")
    router.assign(draw("a"), request_id="ordinary")
    assert len(router._far) == 1 and "secret" in json.dumps(router.state())
    assert router.purge(request_id="ordinary") == 0  # near prompts are only in the running means
    assert router.purge(request_id="secret") == 1
    state = router.state()
    assert not router._far and "secret" not in json.dumps(state) and not ContentRouter.from_state(state)._far


def test_content_routing_spawns_evicts_and_reloads_a_pools_drafts_and_a_restart_routes_as_before(tmp_path):
    """ContentRouting carries the router's decisions out through the pool's hands alone (open,
    unload): a new domain's cluster gets a draft of its own, past max_in_memory the idle one
    leaves memory and comes back with its cluster, and a restart reopens what was in memory."""
    import threading
    from dataclasses import dataclass, field

    from onlinespec.routing.lifecycle import ContentRouting

    @dataclass
    class Learner:
        busy: bool = False

        def hurry(self) -> None:
            pass

    @dataclass
    class Draft:
        name: str
        learner: Learner | None = field(default_factory=Learner)
        in_flight: int = 0
        last_used: int = 0

    class Pool:
        def __init__(self) -> None:
            self.drafts: dict[str, Draft] = {}

        def open(self, name, start_from=None):
            return self.drafts.setdefault(name, Draft(name))

        def unload(self, name) -> None:
            del self.drafts[name]

        def alphas(self, drafts, records):
            return dict.fromkeys(drafts, 0.5)

    def start(pool: Pool) -> ContentRouting:
        return ContentRouting(ContentConfig(idle_requests=20), tmp_path, pool, Draft(STATIC, None), threading.RLock(),
                              max_in_memory=1, on_event=lambda event: None, priority="normal")

    def home(routing: ContentRouting, domain: str) -> str:
        route = routing.route(draw(domain))
        routing.release(route)
        return route.home.name

    draw = domain_embeddings()
    pool = Pool()
    routing = start(pool)
    try:
        assert {home(routing, "a") for _ in range(40)} == {"c0"}
        b = [home(routing, "b") for _ in range(40)][-1]
        assert b != "c0" and set(pool.drafts) == {b} and routing.evicted == {"c0"}  # one fits in memory
        assert home(routing, "a") == "c0" and set(pool.drafts) == {"c0"}  # reloaded with its cluster
        assert routing.lifecycle == {"spawned": 2, "evicted": 2, "reloaded": 1, "retired": 0}
    finally:
        routing.close()
    checked: list[str] = []
    again = start(Pool())
    try:
        again.reopen(["c0", b], check=checked.append)
        assert set(again.pool.drafts) == {"c0"} and checked == [b] and again.evicted == {b}
        assert home(again, "a") == "c0" and again.router.requests == 82
    finally:
        again.close()
