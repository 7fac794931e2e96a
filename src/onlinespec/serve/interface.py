"""What the HTTP app serves from: the serving core's interface, declared once.

Two classes implement :class:`Core`, each by naming it as a base: :class:`~onlinespec.serve.core.ServingCore`
(one process: the engine loop, the drafts and their learners) and ``onlinespec.scale.RayCore`` (a front
over serving replicas on Ray). :func:`onlinespec.serve.app.create_app` and its routers are typed against
:class:`Core` alone, so the app serves one process or N replicas with the same code, and the app never
imports the classes behind it (``tests/serve/test_core_interface.py`` checks both and the app's imports).

The members are what the app uses: the lifecycle (``load``, ``shutdown``, ``status``, ``error``,
``ready``), requests (``submit``; a request is cancelled through the handle it returns,
:meth:`~onlinespec.serve.handles.Events.cancel`), what the tokenizer routes need (``tokenizer``,
``context``), and the admin API (``drafts``, ``replica_rows``, ``routing``, ``learning``,
``governance``, ``operate``, ``purge``), with ``metrics`` for ``GET /metrics``.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

from onlinespec.decoding.sampling import SamplingParams
from onlinespec.serve.config import CoreConfig
from onlinespec.serve.handles import Events
from onlinespec.tokens import Prompt


class MetricsText(Protocol):
    def text(self) -> bytes | str:
        """The Prometheus exposition of every metric (``GET /metrics``)."""


class Core(Protocol):
    """The serving core as the HTTP app sees it. An implementation names it as a base class: a
    method it lacks is then a ``TypeError`` when it is built (the methods are abstract)."""

    config: CoreConfig
    status: str  # starting -> loading -> calibrating -> ready -> draining -> stopped; or failed
    error: str | None  # why it failed, when it did
    started_at: float  # time.time() when built (the models' ``created``)
    context: int | None  # tokens a request's prompt and output may fill; None until loaded
    tokenizer: Any  # the target's tokenizer (a ServingCore's: None until loaded)
    metrics: MetricsText

    @property
    @abstractmethod
    def ready(self) -> bool:
        """Loaded and serving: ``GET /ready`` answers 200."""

    @abstractmethod
    def load(self) -> None:
        """Load (or start) what serves, blocking until ready; a failure is a ``LoadFailed``."""

    @abstractmethod
    def shutdown(self, drain_seconds: float = 30.0) -> None:
        """Refuse new requests, let those in flight finish (at most ``drain_seconds``), stop."""

    @abstractmethod
    def submit(self, prompt: Prompt, params: SamplingParams | None = None, domain: str = "default", train: bool = True,
               draft: str | None = None, request_id: str | None = None,
               notify: Callable[[], None] | None = None, stream: bool = False, tenant: str = "", cache_salt: str | None = None,
               priority: int = 0) -> Events:
        """Queue a request; its events end with a ``Served`` or a ``ServeError`` (ServingCore.submit says more)."""

    @abstractmethod
    def drafts(self) -> list[dict]:
        """Every draft's row (``GET /admin/drafts``), the baselines included."""

    @abstractmethod
    def replica_rows(self) -> list[dict]:
        """The serving replicas (one process: none)."""

    @abstractmethod
    def routing(self) -> dict:
        """Content routing's state (empty for other routers)."""

    @abstractmethod
    def learning(self) -> dict:
        """Whether the drafts learn, paused or busy (``GET /ready`` carries it)."""

    @abstractmethod
    def governance(self) -> dict:
        """What is held of the training data, and what was refused or deleted."""

    @abstractmethod
    def operate(self, action: str, name: str | None = None, version: str | None = None) -> dict:
        """An operator's action (pause, resume, update, rollback, pin); returns the new state."""

    @abstractmethod
    def purge(self, request_id: str | None = None, older_than_days: float | None = None) -> dict:
        """Delete a request's training records (or those older than a number of days) now."""
