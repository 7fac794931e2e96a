"""The ``onlinespec`` command: generate, bench, serve, demo, online, data, drafts, costmodel, convert.

One typer app (:mod:`onlinespec.cli.common`); each module adds its command group to it:
:mod:`~onlinespec.cli.decode` (generate, bench, warmup, distill, costmodel),
:mod:`~onlinespec.cli.serving` (serve, demo, online, report, routing-report, fetch-default),
:mod:`~onlinespec.cli.records` (drafts, data) and :mod:`~onlinespec.cli.formats` (convert).
"""

from onlinespec.cli import decode, formats, records, serving  # noqa: F401  (each registers its commands on the app)
from onlinespec.cli.common import app

__all__ = ["app"]
