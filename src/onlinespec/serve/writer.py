"""The writer thread: a finished request's records go to its draft's durable replay buffer, then
its answer to the client. A client never sees an answer whose record is not on disk, and the
engine loop never waits for a disk.

(Formerly ``onlinespec.serve.recorder.Recorder``, a name it shared with
:mod:`onlinespec.online.recorder`, which turns a verification trace into training records; the old
module and class names still import.)"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import torch

from onlinespec.cpu import name_thread
from onlinespec.decoding.request import Generation, RequestStats
from onlinespec.metrics import speculative_decoding
from onlinespec.online.pool import DraftPool, ServedDraft
from onlinespec.serve.config import CoreConfig
from onlinespec.serve.handles import Failed, Handle, Served
from onlinespec.serve.metrics import ServeMetrics
from onlinespec.storage import kill_point

log = logging.getLogger("onlinespec.requests")


class RecordWriter:
    """Answers the requests the engine loop finished (:meth:`put`), in order, on one thread.

    ``event`` writes an event-log line; ``release(handle)`` gives back the drafts a content route
    holds; ``on_served(draft, stats)`` tells the learning controller what a learning draft served."""

    def __init__(self, pool: DraftPool, metrics: ServeMetrics, config: CoreConfig, event: Callable[[dict], None],
                 release: Callable[[Handle], None], replica: str | None = None,
                 on_served: Callable[[ServedDraft, RequestStats], None] | None = None) -> None:
        self.pool, self.metrics, self.config, self.replica = pool, metrics, config, replica
        self.event, self.release, self.on_served = event, release, on_served
        self.served = 0  # requests answered
        self.recent_seconds = 1.0  # moving average of request seconds (a full queue's Retry-After)
        self._finished: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="onlinespec-recorder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, handle: Handle) -> None:
        self._finished.put(handle)

    def stop(self, timeout: float = 60.0) -> None:
        """Answer every request put before this call, then end the thread."""
        self._finished.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        name_thread("onlinespec-rec")
        torch.set_num_threads(1)  # the engine thread keeps the cores (onlinespec.serve.core)
        while (handle := self._finished.get()) is not None:
            try:
                try:
                    self._answer(handle)
                finally:
                    self.release(handle)
            except Exception as err:  # never leave a client waiting
                logging.getLogger("onlinespec.serve").exception("completing a request failed")
                handle.emit(Failed(f"the request finished but its answer could not be assembled: {err}"))

    def _answer(self, handle: Handle) -> None:
        state, draft, home, route = handle.state, handle.draft, handle.home, handle.route
        generation = Generation(state.stop.text(), list(state.stop.generated), state.prompt_ids, state.stats, state.trace or [])
        recorded = self._record(handle, generation)
        stats = state.stats
        served = Served(handle.request_id, generation.text, generation.token_ids, len(state.prompt_ids),
                        "length" if stats.finish_reason == "length" else "stop", stats, draft.name, draft.version,
                        handle.versions or ([draft.version] if draft.version else []), handle.domain, self.pool.busy, recorded,
                        route.cluster if route else None, home.name if route else None, self.replica,
                        self.config.speculation_details, state.prompt_ids, state.logprobs if state.params.logprobs is not None else None,
                        state.prompt_logprobs or None)
        self._count(handle, served)
        self._log(handle, served)
        kill_point("serve.answer")
        self.release(handle)  # before the answer: a client's next request may need the room
        handle.emit(served)

    def _record(self, handle: Handle, generation: Generation) -> bool:
        """Store the request's training records in its home draft's buffer (and suffix index);
        whether they are durable. A failed write is logged and counted, never the request's failure."""
        home = handle.home
        if home.learner is None and home.suffix is None:
            return False
        recorded = False
        failures = home.learner.write_failures if home.learner is not None else 0
        try:  # durable when it returns; a record a disk write failed is skipped and counted
            recorded = self.pool.observe(home, generation, handle.domain, handle.request_id, train=handle.train,
                                         route=handle.route, tenant=handle.state.tenant)
        except Exception as err:
            logging.getLogger("onlinespec.serve").error("request %s: its training records were NOT stored: %s", handle.request_id, err)
        if home.learner is not None and home.learner.write_failures > failures:
            self.metrics.record_failures.labels(home.name).inc(home.learner.write_failures - failures)
        if not handle.train:
            self.metrics.opted_out.inc()
        return recorded

    def _count(self, handle: Handle, served: Served) -> None:
        draft, home, stats = handle.draft, handle.home, served.stats
        self.metrics.request(draft.name, draft.version, handle.domain, stats, speculative_decoding(stats),
                             handle.state.stop.max_new_tokens)
        if self.on_served is not None and draft.learner is not None:
            self.on_served(draft, stats)
        self.metrics.serving(draft.name, draft.version)
        if home.suffix is not None:
            self.metrics.suffix_tokens.labels(home.name).set(home.suffix.tokens)
        if home.learner is not None:
            data = home.learner.governance()
            self.metrics.buffer_records.labels(home.name).set(data["held"])
            self.metrics.buffer_bytes.labels(home.name).set(data["bytes"])
            if served.recorded:
                self.metrics.records.labels(home.name).inc()
        self.served += 1
        self.recent_seconds = 0.9 * self.recent_seconds + 0.1 * stats.seconds

    def _log(self, handle: Handle, served: Served) -> None:
        """The request's line in the request log and the event log (its text only with --log-text)."""
        stats, route = served.stats, handle.route
        line = {"event": "request", "id": handle.request_id, "domain": handle.domain, "draft": served.draft,
                "draft_version": served.draft_version, "prompt_tokens": served.prompt_tokens,
                "completion_tokens": served.completion_tokens, "finish_reason": served.finish_reason,
                "alpha": stats.acceptance_rate, "tau": stats.mean_accepted_length, "seconds": stats.seconds,
                "ttft_seconds": stats.first_token_seconds, "queued_seconds": stats.queued_seconds, "recorded": served.recorded}
        if route is not None:
            line.update(cluster=route.cluster, member_of=route.member_of, learning_draft=handle.home.name)
        if self.replica is not None:
            line["replica"] = self.replica
        if self.config.log_text:
            line.update(prompt=handle.prompt_text, text=served.text)
        log.info("request", extra={"fields": line})
        self.event(line)


Recorder = RecordWriter  # the name before issue 50 (onlinespec.serve.recorder)
