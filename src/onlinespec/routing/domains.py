"""Which draft serves a request (Liu et al., arXiv 2310.07177, section 4.3).

Queries of one domain share a distribution, so one draft per domain beats one universal draft:
it learns the domain's traffic without unlearning the others'. The paper routed on language
metadata or topic clusters; here a router maps a request's ``domain`` (its metadata, as a
stream file or an API caller states it) to a draft name:

- ``single``: every request to one shared draft (the paper's main setting);
- ``domain``: one draft per domain, created the first time the domain is seen and started from
  the starting draft; once ``max_drafts`` domains have their own, the rest share one draft, so a
  stream with thousands of domain labels cannot exhaust memory;
- ``content``: no label needed: requests are clustered by what the target computed for their
  prompt, and each cluster is served by the draft that scores best on it
  (:mod:`onlinespec.routing.content`, docs/routing.md).

Draft names are folder names on disk (registry and buffer), so a domain label is kept to a safe
set of characters; ``static`` and ``none`` name the server's baselines (the starting draft kept
static, the target alone), so domains of those names get a trailing ``_``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

SHARED = "shared"
RESERVED = ("static", "none")  # the server's baseline drafts
ROUTERS = ("single", "domain", "content")
MAX_DRAFTS = 8  # default: domains beyond this many share one draft
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def draft_name(domain: str) -> str:
    """A domain label as a draft (folder) name: unsafe characters become '_'; never empty or hidden."""
    name = (_UNSAFE.sub("_", domain.strip()).strip("._") or SHARED)[:63]
    return f"{name}_" if name in RESERVED else name


class Router:
    """``router(domain) -> draft name``; remembers which domains already have a draft."""

    def __init__(self, policy: str = "domain", max_drafts: int = MAX_DRAFTS, known: Iterable[str] = ()) -> None:
        if policy not in ROUTERS:
            raise ValueError(f"unknown router {policy!r}: use one of {ROUTERS}")
        if max_drafts < 1:
            raise ValueError(f"max_drafts must be >= 1, got {max_drafts}")
        self.policy, self.max_drafts = policy, max_drafts
        self._own: list[str] = [name for name in known if name != SHARED][:max_drafts]  # drafts a restart finds on disk

    def __call__(self, domain: str) -> str:
        if self.policy != "domain":  # content routing is the pool's (onlinespec.routing.content): a label is only a hint
            return SHARED
        name = draft_name(domain)
        if name in self._own:
            return name
        if len(self._own) < self.max_drafts and name != SHARED:
            self._own.append(name)
            return name
        return SHARED

    @property
    def drafts(self) -> list[str]:
        """Domains that have a draft of their own, in the order they were first seen."""
        return list(self._own)
