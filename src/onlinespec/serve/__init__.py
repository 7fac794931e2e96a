"""Serving: the core every path serves through (:mod:`onlinespec.serve.core`; what its callers get
back, :mod:`onlinespec.serve.handles`), its OpenAI-compatible HTTP API (:mod:`onlinespec.serve.app`),
its Prometheus metrics (:mod:`onlinespec.serve.metrics`) and the process that runs them
(:mod:`onlinespec.serve.server`)."""
