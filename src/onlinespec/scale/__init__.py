"""Serving past one process: replicas and learners as Ray actors (``onlinespec serve --replicas N``).

The same OpenAI-compatible app (:mod:`onlinespec.serve.app`) fronts N serving replicas, each a
whole :class:`~onlinespec.serve.core.ServingCore` in a Ray actor; one learner actor per draft
group owns the group's replay buffers and publishes to the drafts' registries::

    HTTP (the app) --> RayCore (this process) --submit--> replica actors (ServingCore each, their own CPUs)
                                                              |  every served request's records,
                                                              v  durable before the client's answer
    registry (drafts/<name>/) <--publish-- learner actor(s) (DraftPool of OnlineLearners, buffers)
          |                                    |
          +--> every replica serves CURRENT <--+ pushes "follow" after a publication

- :mod:`onlinespec.scale.learners`: the learner actor and a replica's client of it.
- :mod:`onlinespec.scale.replicas`: the replica actor.
- :mod:`onlinespec.scale.cluster`: :class:`RayCore`, what the app serves from.
- :mod:`onlinespec.scale.metrics`: the front's ``/metrics``, every replica's merged.

Ray is an optional extra (``pip install onlinespec[ray]``). docs/scale.md has the design, what
it costs and how it maps to a multi-node cluster.
"""

import os

# Read when ray is first imported: Ray's C++ failure handler would turn the server's SIGTERM (a
# graceful drain) into an abort; usage statistics would try the network.
os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Read by the raylet of a local cluster: Ray starts its workers at nice 15, and a replica's engine
# with two OpenMP threads then ran 0.75-0.85x as fast as in a plain process (the threads wait at
# each barrier for one that a nice-0 process preempted), at nice 0 as fast (docs/scale.md). A
# learner thread still lowers itself to nice 19 (LearnerConfig.priority).
os.environ.setdefault("RAY_worker_niceness", "0")
# Ray starts idle workers ahead of need; one sat beside a replica polling the raylet (1.35-1.55 CPU
# seconds in 200 s of serving, docs/scale.md). Our actors are few and long-lived: start on demand.
os.environ.setdefault("RAY_enable_worker_prestart", "0")
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")

from onlinespec.scale.cluster import RayCore, ScaleConfig  # noqa: E402

__all__ = ["RayCore", "ScaleConfig"]
