"""Routing by content: requests clustered by their prompts, drafts scored on every request, drift
that starts learning (arXiv 2310.07177, section 4.3, without the labels; docs/routing.md).

The pieces, all driven by :class:`~onlinespec.online.pool.DraftPool`:

- **Embedding**: the target's own post-norm hidden state at the prompt's last position (for a chat
  prompt, the assistant header: the target's summary of the whole prompt before it answers),
  computed by the prefill anyway (:meth:`RequestState.add_prompt_states`). On the default target
  it tells code, maths and chat apart for 87-100% of prompts by nearest centroid (docs/routing.md);
  the prompt's mean state did worse (67-93%).
- **Clusters**: streaming centroids under cosine distance; a prompt joins the nearest cluster (its
  centroid follows about its last ``centroid_memory`` prompts). A prompt farther than
  ``threshold`` from every cluster is *far*: far prompts are remembered for ``far_memory``
  requests, and found a new cluster at their mean when the distance detector fires (below) with at
  least ``min_far`` of them, or when ``far_prompts`` accumulate without a detection (a slow drift).
- **Scores** (full information, as in HedgeSpec): every draft in memory, and the static packaged
  draft, is scored on every recorded request by its alpha on the target's verified tokens (the
  learner's background scorer; never the request path). Per cluster and draft an exponentially
  discounted sum of alphas (``score_memory`` requests) is the log-weight of exponential weights
  (Hedge with learning rate ``eta`` on the loss ``1 - alpha``); the router serves the heaviest
  draft, which with full information needs no exploration. A challenger replaces the serving draft
  only by ``switch_margin``, except that the static draft always wins over a learned one that
  scores below it (the floor: ATLAS's static speculator under the adaptive one).
- **Drift**: two Page-Hinkley detectors, their parameters in :class:`ContentConfig`: one on the
  distance of each new prompt to the nearest cluster (a rise: traffic unlike anything served),
  which founds a cluster for the far prompts and gives it a draft of its own, spawned from the
  draft that scored best on those very prompts; one per cluster on its served alpha (a
  fall), which starts the cluster's draft's next update now, and gives the cluster a draft of its
  own when it shared one. A cluster that comes back is an event too (its draft is reloaded if it
  was evicted): after ``idle_requests`` requests elsewhere, or, where other traffic kept sending
  it a few requests, once it takes most of the latest ones after few of those before.
- **Merging**: two live clusters whose centroids come within ``merge_threshold`` become one; if
  their drafts differ, the better-scoring one is kept and the other retired.

This module holds the decisions and their state (saved as JSON with the out-dir, so a restart
routes as before); the pool carries them out (drafts in memory, eviction, reloading).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch

STATIC = "static"  # the floor: the packaged draft, never trained


@dataclass
class ContentConfig:
    threshold: float = 0.07  # cosine distance: a prompt farther than this from every cluster is unlike them (a "far" prompt)
    min_far: int = 3  # far prompts a detection needs to found a new cluster at their mean (fewer: the nearest cluster's draft learns now)
    far_prompts: int = 30  # this many far prompts within far_memory found a new cluster without a detection (a slow drift)
    far_memory: int = 60  # requests a far prompt is remembered for
    merge_threshold: float = 0.03  # live clusters whose centroids come this close merge
    max_clusters: int = 32  # live clusters (then far prompts join their nearest)
    centroid_memory: int = 200  # a centroid is the running mean of about its last this many prompts
    score_memory: int = 30  # scores are discounted over about this many of the cluster's requests
    eta: float = 8.0  # Hedge's learning rate on the loss 1 - alpha (the weights reported)
    switch_margin: float = 0.005  # a challenger must score this much better to replace the serving draft
    idle_requests: int = 50  # a cluster that gets a request after this many elsewhere has "returned"
    return_recent: int = 10  # ... and so has one that takes return_share of these last requests
    return_share: float = 0.6
    return_quiet: float = 0.2  # after at most this share of the idle_requests before them (other traffic overlapped it)
    distance_delta: float = 0.02  # Page-Hinkley on the distance to the nearest cluster (a rise)
    distance_lambda: float = 0.2
    alpha_delta: float = 0.05  # Page-Hinkley on each cluster's served alpha (a fall)
    alpha_lambda: float = 4.0  # per-request alpha is noisy (std 0.38 on a stationary chat stream): 2.5 fired 2 times in 500 (docs/routing.md)
    min_samples: int = 10  # observations a detector needs before it may fire

    def __post_init__(self) -> None:
        if not 0 < self.merge_threshold < self.threshold < 2:
            raise ValueError(f"need 0 < merge_threshold < threshold < 2 (cosine distances), got "
                             f"{self.merge_threshold} and {self.threshold}")
        if min(self.min_far, self.far_prompts, self.far_memory, self.max_clusters, self.centroid_memory, self.score_memory,
               self.idle_requests, self.min_samples) < 1:
            raise ValueError("min_far, far_prompts, far_memory, max_clusters, centroid_memory, score_memory, "
                             "idle_requests and min_samples must be >= 1")
        if not 0 <= self.return_quiet < self.return_share <= 1 or self.return_recent < 1:
            raise ValueError(f"need 0 <= return_quiet < return_share <= 1 and return_recent >= 1, got {self.return_quiet}, "
                             f"{self.return_share} and {self.return_recent}")
        if min(self.distance_delta, self.distance_lambda, self.alpha_delta, self.alpha_lambda, self.eta) <= 0 or self.switch_margin < 0:
            raise ValueError("the detectors' delta and lambda and eta must be > 0, switch_margin >= 0")


@dataclass
class PageHinkley:
    """The Page-Hinkley test for a change in a stream's mean (``direction`` +1: a rise, -1: a fall):
    the cumulative deviation from the running mean, less ``delta`` a step, against its running
    extreme; a change once it has moved ``threshold`` past it. Resets when it fires."""

    delta: float
    threshold: float
    direction: int = 1
    min_samples: int = 10
    n: int = 0
    mean: float = 0.0
    cumulative: float = 0.0
    extreme: float = 0.0

    def update(self, x: float) -> bool:
        x = self.direction * x
        self.n += 1
        self.mean += (x - self.mean) / self.n
        self.cumulative += x - self.mean - self.delta
        self.extreme = min(self.extreme, self.cumulative)
        if self.n >= self.min_samples and self.cumulative - self.extreme > self.threshold:
            self.reset()
            return True
        return False

    def reset(self) -> None:
        self.n, self.mean, self.cumulative, self.extreme = 0, 0.0, 0.0, 0.0

    def resumed(self, saved: dict | None) -> "PageHinkley":
        """This detector (its settings) carrying on from a saved one's running sums (``asdict``)."""
        if saved:
            self.n, self.mean, self.cumulative, self.extreme = saved["n"], saved["mean"], saved["cumulative"], saved["extreme"]
        return self


@dataclass
class Cluster:
    id: int
    centroid: list[float]
    members: int = 0
    live: bool = False
    draft: str | None = None  # the draft that learns from its traffic (its home)
    serving: str | None = None  # the draft that serves it now (its home, another draft, or static)
    scores: dict[str, float] = field(default_factory=dict)  # discounted sum of alphas, by draft
    weight: float = 0.0  # the discount's normaliser: scores[d] / weight is d's discounted mean alpha
    scored: int = 0
    labels: dict[str, int] = field(default_factory=dict)  # the domains requests declared (hints)
    last_seen: int = 0  # the router's request count at its last request
    born: int = 0
    parent: str | None = None  # the draft that scored best on the prompts that founded it (its draft starts from it)
    returned_at: int | None = None  # the router's request count when it was last seen to return
    alpha: PageHinkley | None = None

    def mean_score(self, draft: str) -> float | None:
        return self.scores[draft] / self.weight if draft in self.scores and self.weight else None

    def label(self) -> str | None:
        return max(self.labels, key=self.labels.get) if self.labels else None


@dataclass
class Assignment:
    cluster: int  # the cluster whose draft serves and learns from the request
    member_of: int  # the cluster the prompt joined (the same: kept for the events' schema)
    distance: float  # to the nearest cluster before it joined (inf: there was none)
    request: int = 0  # its number in the router's count


class ContentRouter:
    """Clusters, scores and detectors (see the module docstring). Not thread-safe: the pool calls
    it under its lock. Events go to ``self.events`` (the pool drains and logs them)."""

    def __init__(self, config: ContentConfig | None = None) -> None:
        self.config = config or ContentConfig()
        self.clusters: dict[int, Cluster] = {}
        self.requests = 0
        self.next_id = 0
        self.distance = self._distance_detector()
        self.events: list[dict] = []
        self._centroids: torch.Tensor | None = None  # [C, D] of self._order, rebuilt when clusters change
        self._order: list[int] = []
        self._alarm: int | None = None  # when the distance detector last fired (a cluster is founded once min_far far prompts are in)
        self._far: list[tuple[int, torch.Tensor, int]] = []  # (request, embedding, cluster served as): prompts far from every cluster
        self._far_of: dict[int, tuple[str, float]] = {}  # a far prompt's request number -> (request id, time): what a purge finds
        self._merged: dict[int, int] = {}  # a merged cluster's id -> the cluster it joined
        self._request_scores: dict[int, dict[str, float]] = {}  # the last far_memory requests' scores, by request number
        self._history: list[int] = []  # the clusters of the last idle_requests + return_recent requests, oldest first

    def _distance_detector(self) -> PageHinkley:
        c = self.config
        return PageHinkley(c.distance_delta, c.distance_lambda, +1, c.min_samples)

    def _alpha_detector(self) -> PageHinkley:
        c = self.config
        return PageHinkley(c.alpha_delta, c.alpha_lambda, -1, c.min_samples)

    # ---- assignment -------------------------------------------------------------------------

    def _matrix(self) -> tuple[list[int], torch.Tensor | None]:
        if self._centroids is None and self.clusters:
            self._order = list(self.clusters)
            self._centroids = torch.tensor([self.clusters[i].centroid for i in self._order], dtype=torch.float32)
        return self._order, self._centroids

    def assign(self, embedding: torch.Tensor, hint: str | None = None, request_id: str | None = None) -> Assignment:
        """The cluster of a prompt (a unit vector): see the module docstring. ``request_id``: the
        request's id, kept with its embedding while it is a far prompt (so that :meth:`purge` finds it)."""
        c = self.config
        self.requests += 1
        embedding = torch.nn.functional.normalize(embedding.float().flatten(), dim=0)
        nearest, distance = self._nearest(embedding)
        if nearest is None:  # the first request: the first cluster
            nearest = self._new(embedding, "first", [])
            distance = math.inf
        else:
            self._far = [(n, e, k) for n, e, k in self._far if self.requests - n <= c.far_memory]
            if distance > c.threshold:
                self._far.append((self.requests, embedding, nearest.id))
                if request_id is not None:
                    self._far_of[self.requests] = (request_id, time.time())
            self._far_of = {n: v for n, v in self._far_of.items() if any(n == m for m, _, _ in self._far)}
            if self.distance.update(distance):
                self._alarm = self.requests
                self.events.append({"event": "drift", "kind": "prompts", "distance": round(distance, 4), "requests": self.requests,
                                    "cluster": nearest.id, "hurry": nearest.draft})
            alarmed = self._alarm is not None and self.requests - self._alarm <= c.far_memory
            if (alarmed and len(self._far) >= c.min_far) or len(self._far) >= c.far_prompts:
                self._found("drift" if alarmed else "members")
                nearest, _ = self._nearest(embedding)
        self._join(nearest, embedding, hint)
        self._history = [*self._history, nearest.id][-(c.idle_requests + c.return_recent):]
        self._maybe_returned(nearest)
        nearest.last_seen = self.requests
        self._maybe_merge(nearest)
        cluster = self._alias(nearest.id)
        return Assignment(cluster, cluster, distance, self.requests)

    def purge(self, request_id: str | None = None, before: float | None = None) -> int:
        """A purge: the far prompts (embeddings of single prompts) of request ``request_id`` or
        recorded before ``before`` leave the router, with their scores; how many went. Centroids
        and scores are running means over many requests, and stay (docs/reliability.md)."""
        doomed = {n for n, (rid, at) in self._far_of.items() if rid == request_id or (before is not None and at < before)}
        self._far = [f for f in self._far if f[0] not in doomed]
        for n in doomed:
            self._far_of.pop(n, None)
            self._request_scores.pop(n, None)
        return len(doomed)

    def _maybe_returned(self, cluster: Cluster) -> None:
        """A ``cluster_returned`` event when a cluster's traffic comes back: its first request after
        ``idle_requests`` elsewhere, or (where other traffic overlapped it, so it was never idle)
        ``return_share`` of the last ``return_recent`` requests after at most ``return_quiet`` of
        the ``idle_requests`` before them. Once per return."""
        c = self.config
        idle = self.requests - cluster.last_seen if cluster.last_seen else 0
        why = "idle" if idle > c.idle_requests else None
        if why is None and len(self._history) == c.idle_requests + c.return_recent and cluster.born <= self.requests - len(self._history):
            before, recent = self._history[:c.idle_requests], self._history[c.idle_requests:]
            again = cluster.returned_at is None or self.requests - cluster.returned_at > len(self._history)
            if again and recent.count(cluster.id) >= c.return_share * c.return_recent and before.count(cluster.id) <= c.return_quiet * c.idle_requests:
                why = "share"
        if why is not None:
            cluster.returned_at = self.requests
            self.events.append({"event": "cluster_returned", "cluster": cluster.id, "why": why, "idle_requests": idle,
                                "share": round(self._history[-c.return_recent:].count(cluster.id) / min(c.return_recent, len(self._history)), 2),
                                "draft": cluster.draft})

    def _nearest(self, embedding: torch.Tensor) -> tuple[Cluster | None, float]:
        order, matrix = self._matrix()
        if matrix is None:
            return None, math.inf
        distances = 1.0 - matrix @ embedding
        i = int(distances.argmin())
        return self.clusters[order[i]], float(distances[i])

    def _new(self, centroid: torch.Tensor, why: str, far: list) -> Cluster:
        cluster = Cluster(self.next_id, torch.nn.functional.normalize(centroid, dim=0).tolist(), members=len(far), live=True, born=self.requests,
                          alpha=self._alpha_detector())
        self.next_id += 1
        self.clusters[cluster.id] = cluster
        self._centroids = None
        cluster.parent = self._best_on([n for n, _, _ in far])
        served_as = [k for _, _, k in far if k in self.clusters]
        self.events.append({"event": "cluster", "cluster": cluster.id, "why": why, "prompts": len(far) or 1,
                            "served_as": max(set(served_as), key=served_as.count) if served_as else None, "best": cluster.parent})
        return cluster

    def _best_on(self, requests: list[int]) -> str | None:
        """The draft with the highest mean alpha on these requests (scored ones; None: none scored)."""
        totals: dict[str, list[float]] = {}
        for n in requests:
            for d, alpha in self._request_scores.get(n, {}).items():
                totals.setdefault(d, []).append(alpha)
        return max(totals, key=lambda d: sum(totals[d]) / len(totals[d])) if totals else None

    def _join(self, cluster: Cluster, embedding: torch.Tensor, hint: str | None) -> None:
        cluster.members += 1
        rate = 1.0 / min(cluster.members, self.config.centroid_memory)
        centroid = torch.tensor(cluster.centroid) * (1 - rate) + embedding * rate
        cluster.centroid = torch.nn.functional.normalize(centroid, dim=0).tolist()
        if hint and hint != "default":
            cluster.labels[hint] = cluster.labels.get(hint, 0) + 1
        self._centroids = None

    def _found(self, why: str) -> None:
        """A new cluster at the mean of the newest ``min_far`` far prompts (far prompts of an earlier
        change may linger); the pool gives it a draft of its own, from the draft that scored best
        on them."""
        far, self._far, self._far_of, self._alarm = self._far, [], {}, None
        if sum(k.live for k in self.clusters.values()) < self.config.max_clusters:
            founders = far[-self.config.min_far:]
            self._new(torch.stack([e for _, e, _ in founders]).mean(0), why, founders)

    def _alias(self, cluster_id: int) -> int:
        while cluster_id not in self.clusters and cluster_id in self._merged:
            cluster_id = self._merged[cluster_id]
        return cluster_id

    def _maybe_merge(self, cluster: Cluster) -> None:
        order, matrix = self._matrix()
        if matrix is None:
            return
        distances = 1.0 - matrix @ torch.tensor(cluster.centroid)
        for i, d in zip(order, distances.tolist()):
            other = self.clusters.get(i)
            if other is None or other is cluster or not other.live or d >= self.config.merge_threshold:
                continue
            keep, gone = (cluster, other) if cluster.members >= other.members else (other, cluster)
            total = keep.members + gone.members
            centroid = (torch.tensor(keep.centroid) * keep.members + torch.tensor(gone.centroid) * gone.members) / total
            keep.centroid, keep.members = torch.nn.functional.normalize(centroid, dim=0).tolist(), total
            for label, n in gone.labels.items():
                keep.labels[label] = keep.labels.get(label, 0) + n
            kept_draft, retired = keep.draft, None
            if gone.draft and gone.draft != keep.draft:
                pair = [d for d in (keep.draft, gone.draft) if d]
                kept_draft = max(pair, key=lambda d: keep.mean_score(d) or 0.0)
                retired = gone.draft if kept_draft == keep.draft else keep.draft
            keep.draft = kept_draft
            keep.last_seen = max(keep.last_seen, gone.last_seen)
            del self.clusters[gone.id]
            self._merged[gone.id] = keep.id
            self._centroids = None
            still_home = {k.draft for k in self.clusters.values()}
            self.events.append({"event": "merge", "cluster": keep.id, "merged": gone.id, "distance": round(d, 4),
                                "draft": kept_draft, "retired": retired if retired not in still_home else None})
            return

    # ---- drafts and scores -----------------------------------------------------------------------

    def best(self, cluster: Cluster, learned_only: bool = False) -> str | None:
        """The draft with the highest discounted mean alpha on the cluster (None: no scores yet)."""
        scored = {d: s for d, s in cluster.scores.items() if not (learned_only and d == STATIC)}
        return max(scored, key=scored.get) if scored else None

    def choose(self, cluster_id: int, available: set[str]) -> str | None:
        """The draft that serves the cluster now, among ``available`` (static included when it is
        in it): its draft until scores say otherwise, then the best scoring, with the floor."""
        cluster = self.clusters.get(self._alias(cluster_id))
        if cluster is None:
            return None
        current = cluster.serving if cluster.serving in available else (cluster.draft if cluster.draft in available else None)
        means = {d: m for d in available if (m := cluster.mean_score(d)) is not None}
        if means:
            challenger = max(means, key=means.get)
            if current is None or current not in means or means[challenger] > means[current] + self.config.switch_margin:
                current = challenger
            if current != STATIC and STATIC in means and means[STATIC] > means[current]:
                current = STATIC  # the floor: never a learned draft that scores below the static one
        if current != cluster.serving:
            if cluster.serving is not None:
                self.events.append({"event": "serve", "cluster": cluster.id, "draft": current, "was": cluster.serving,
                                    "scores": {d: round(m, 4) for d, m in means.items()}})
            cluster.serving = current
        return current

    def weights(self, cluster: Cluster) -> dict[str, float]:
        """Hedge's distribution over the cluster's drafts: w_d proportional to exp(-eta * discounted loss)."""
        if not cluster.weight:
            return {}
        logs = {d: self.config.eta * (s - cluster.weight) for d, s in cluster.scores.items()}
        top = max(logs.values())
        total = sum(math.exp(v - top) for v in logs.values())
        return {d: math.exp(v - top) / total for d, v in logs.items()}

    def score(self, cluster_id: int, alphas: dict[str, float], request: int | None = None) -> None:
        """Every draft's alpha on one of the cluster's requests (the scorer's full information;
        ``request``: its number, :attr:`requests` when it was assigned)."""
        if request is not None:
            self._request_scores[request] = alphas
            for old in [n for n in self._request_scores if n <= self.requests - self.config.far_memory]:
                del self._request_scores[old]
        cluster = self.clusters.get(self._alias(cluster_id))
        if cluster is None:
            return
        keep = 1.0 - 1.0 / self.config.score_memory
        for d in list(cluster.scores):
            cluster.scores[d] *= keep
        # a draft never scored here (spawned for another cluster) starts from the static draft's record: a
        # neutral prior (the starting draft's), never one request's alpha taken for the whole history
        prior = cluster.scores.get(STATIC)
        for d, alpha in alphas.items():
            cluster.scores[d] = cluster.scores.get(d, prior if prior is not None else cluster.weight * keep * alpha) + alpha
        cluster.weight = cluster.weight * keep + 1.0
        cluster.scored += 1

    def inherit(self, draft: str, parent: str | None) -> None:
        """A new draft (a copy of ``parent``; None: of the starting draft, which the static one
        is) takes its parent's scores everywhere."""
        parent = parent or STATIC
        for cluster in self.clusters.values():
            if parent in cluster.scores:
                cluster.scores[draft] = cluster.scores[parent]

    def served(self, cluster_id: int, alpha: float) -> bool:
        """A served request's alpha: the cluster's detector; True when it detects a fall."""
        cluster = self.clusters.get(self._alias(cluster_id))
        if cluster is None or not cluster.live or cluster.alpha is None or not cluster.alpha.update(alpha):
            return False
        shared = sum(k.draft == cluster.draft for k in self.clusters.values() if k.live) > 1
        self.events.append({"event": "drift", "kind": "alpha", "cluster": cluster.id, "draft": cluster.draft,
                            "shared": shared, "requests": self.requests})
        return True

    def forget(self, draft: str) -> None:
        """A retired draft: no cluster keeps it."""
        for cluster in self.clusters.values():
            cluster.scores.pop(draft, None)
            if cluster.draft == draft:
                cluster.draft = None
            if cluster.serving == draft:
                cluster.serving = None

    def cluster(self, cluster_id: int) -> Cluster | None:
        return self.clusters.get(self._alias(cluster_id))

    # ---- state ---------------------------------------------------------------------------------

    def state(self) -> dict:
        clusters = []
        for k in self.clusters.values():
            row = asdict(k)
            row["alpha"] = asdict(k.alpha) if k.alpha else None
            clusters.append(row)
        return {"config": asdict(self.config), "requests": self.requests, "next_id": self.next_id, "clusters": clusters,
                "merged": {str(a): b for a, b in self._merged.items()}, "distance": asdict(self.distance), "history": self._history,
                # a founding in progress: the far prompts, the pending alarm, and the scores that pick the new draft's parent
                "alarm": self._alarm, "far": [[n, [round(x, 6) for x in e.tolist()], k] for n, e, k in self._far],
                "request_scores": {str(n): scores for n, scores in self._request_scores.items()},
                "far_requests": {str(n): list(v) for n, v in self._far_of.items()}}

    @classmethod
    def from_state(cls, state: dict, config: ContentConfig | None = None) -> "ContentRouter":
        """The router :meth:`state` saved, under ``config`` (default: the saved one): the
        detectors keep what they have seen and take their settings from ``config``."""
        router = cls(config or ContentConfig(**state["config"]))
        router.requests, router.next_id = state["requests"], state["next_id"]
        for row in state["clusters"]:
            alpha = row.pop("alpha")
            cluster = Cluster(**row)
            cluster.alpha = router._alpha_detector().resumed(alpha)
            router.clusters[cluster.id] = cluster
        router._merged = {int(a): b for a, b in state.get("merged", {}).items()}
        router.distance = router._distance_detector().resumed(state["distance"])
        router._history = list(state.get("history", []))
        router._alarm = state.get("alarm")
        router._far = [(n, torch.tensor(e, dtype=torch.float32), k) for n, e, k in state.get("far", [])]
        router._request_scores = {int(n): scores for n, scores in state.get("request_scores", {}).items()}
        router._far_of = {int(n): (v[0], v[1]) for n, v in state.get("far_requests", {}).items()}
        return router

    def summary(self) -> list[dict]:
        """The live clusters, for ``onlinespec drafts list`` and the admin API."""
        return [{"cluster": k.id, "members": k.members, "draft": k.draft, "serving": k.serving, "label": k.label(),
                 "scores": {d: round(k.mean_score(d), 4) for d in k.scores},
                 "hedge_weights": {d: round(w, 4) for d, w in self.weights(k).items()}, "last_seen": k.last_seen}
                for k in self.clusters.values() if k.live]
