"""``/metrics`` of a Ray deployment's front: the replicas' metrics merged into one text."""

from __future__ import annotations

import math
from collections.abc import Callable

import ray
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from onlinespec.serve.metrics import PREFIX


class ClusterMetrics:
    """``/metrics`` of the front: every ready replica's metrics with a ``replica`` label, and
    the front's own (replicas ready, restarts). ``replicas()``: the front's replicas now."""

    def __init__(self, replicas: Callable[[], list]) -> None:
        self.replicas = replicas
        self.registry = CollectorRegistry()
        self.ready = Gauge(PREFIX + "replicas_ready", "Serving replicas in rotation", registry=self.registry)
        self.restarts = Gauge(PREFIX + "replica_restarts", "Times Ray restarted a replica", ("replica",), registry=self.registry)

    def text(self) -> str:
        self.ready.set(sum(r.ready for r in self.replicas()))
        for replica in self.replicas():
            self.restarts.labels(replica.name).set(replica.restarts)
        parts = [generate_latest(self.registry).decode()]
        replicas = [r for r in self.replicas() if r.ready]
        texts = []
        for replica in replicas:
            try:
                texts.append((replica.name, ray.get(replica.actor.metrics.remote(), timeout=5)))
            except Exception:
                continue
        parts.append(label_replicas(texts))
        return "".join(parts)


def label_replicas(texts: list[tuple[str, str]]) -> str:
    """Prometheus texts of several replicas as one, each sample labelled with its replica."""
    families: dict[str, tuple] = {}
    for replica, text in texts:
        for family in text_string_to_metric_families(text):
            _, _, samples = families.setdefault(family.name, (family.type, family.documentation, []))
            samples += [(s.name, {**s.labels, "replica": replica}, s.value) for s in family.samples]
    lines = []
    for name, (kind, doc, samples) in families.items():
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        for sample, labels, value in samples:
            inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            lines.append(f"{sample}{{{inner}}} {value!r}" if math.isfinite(value) else f"{sample}{{{inner}}} {value}")
    return "\n".join(lines) + "\n" if lines else ""


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
