"""Repository identity: one spelling per upstream project, fixed before anything else reads it.

Sources spell one repository many ways (``https://github.com/Org/Repo.git``,
``git@github.com:org/repo``, ``org/repo``, a fork, a URL with credentials). The normalizer
writes the normalized form to ``episodes.repository``, before redaction: grouping and splits
key on it, and an ssh remote must not reach the PII detectors as an e-mail address (that made
each episode of one repository a group of its own). The form holds host and path only, never
credentials, so the redacted layer keeps it as it is.
"""

from __future__ import annotations

import re
from functools import lru_cache

__all__ = ["is_normalized_remote", "normalize_repository"]


def normalize_repository(url: str | None, instance_id: str | None = None) -> str | None:
    """The normalized form (below); memoized: a build asks for a few thousand distinct pairs."""
    try:
        return _normalized(url, instance_id)
    except TypeError:  # an unhashable value (bad input) is computed, not cached
        return _normalized.__wrapped__(url, instance_id)


@lru_cache(maxsize=1 << 16)
def _normalized(url: str | None, instance_id: str | None = None) -> str | None:
    """``https://github.com/Org/Repo.git``, ``git@github.com:org/repo``, ``org/repo`` ->
    ``github.com/org/repo``. A fork is mapped to its upstream when the SWE-bench-style instance
    id names it (``owner__repo-123``): the instance id, not the URL, says which project it is."""
    upstream = None
    if instance_id:
        m = re.match(r"^([A-Za-z0-9_.-]+?)__([A-Za-z0-9_.-]+)-\d+$", instance_id)
        if m:
            upstream = f"github.com/{m.group(1)}/{m.group(2)}".lower()
    if not url:
        return upstream
    if not url.strip():
        return upstream
    if url.strip()[:1] in ("/", "~", ".") or "\\" in url or re.match(r"^[A-Za-z]:", url.strip()) \
            or re.search(r"\s", url.strip()):
        return upstream or url.strip()  # a local path or free text names no remote; kept as written
    u = url.strip().lower()
    u = re.sub(r"^(?:https?://|ssh://|git://)", "", u)
    u = re.sub(r"^[\w.-]+@([^:/]+):(?!\d+/)", r"\1/", u)  # scp-like ssh: user@host:org/repo
    user, at, rest = u.rpartition("@")
    if at and rest and "/" not in user:
        u = rest  # credentials or user@host
    u = re.sub(r"^([^/:]+):\d+/", r"\1/", u)  # a port names no other repository
    u = "/".join(p for p in u.split("/") if p).removesuffix(".git")  # no empty segments, no trailing /
    if "/" in u and "." not in u.split("/")[0]:  # "org/repo" without host
        u = "github.com/" + u
    parts = u.split("/")
    normalized = "/".join(parts[:3]) if len(parts) >= 3 else u
    if upstream and upstream.rsplit("/", 1)[-1] == normalized.rsplit("/", 1)[-1]:
        return upstream  # same project name: a fork or mirror of the upstream the instance id names
    return normalized or upstream


_REMOTE_FORM = re.compile(r"^[a-z0-9-]+(?:\.[a-z0-9-]+)+(?::\d+)?(?:/[a-z0-9_.-]+){1,2}$")


def is_normalized_remote(repository: str | None) -> bool:
    """``host/org/repo`` (lower case, no credentials, no user part): an identity, not a secret."""
    return bool(repository) and "@" not in repository and bool(_REMOTE_FORM.match(repository))
