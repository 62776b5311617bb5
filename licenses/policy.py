"""The license policy (``[licenses]`` of trajwh.toml) and what it decides for one episode.

Facts (``license_facts``), each with where it came from:

- ``source``: the license of the data as received: ``trajwh ingest --license`` (the batch), and
  the record's own ``$.license`` field (a dataset's card or an export's header); when both are
  there, both bind. Neither: one fact of status ``unknown``.
- ``repository``: the task repository's license, from the record (``$.repository_license`` /
  ``$.repo_license``), else ``[licenses.repositories]``, else the ``repository_file`` mapping.
- ``policy_terms``: the terms of whatever produced the model's turns (a teacher model's output
  terms), from ``[licenses.policy_terms]``: the first pattern matching the policy name.

Each use (``train``, ``release``) decides every fact (``licenses.spdx.decide``) and takes the
worst: a fact that is ``invalid`` (not SPDX), or a required kind that is unknown, gets the use's
``unknown`` decision. ``review`` blocks until the license is moved to ``allow``: a person decides.
An opt-out blocks both uses.
"""

from __future__ import annotations

import csv
import fnmatch
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trajwh.licenses.spdx import DECISION_RANK, decide, parse, require_valid
from trajwh.schemas.config import LicenseSettings, LicenseUse
from trajwh.schemas.errors import ConfigError
from trajwh.schemas.repository import normalize_repository

POLICY_VERSION = "1.0.0"
ELIGIBILITY = ("release", "train", "release_only", "blocked")


@dataclass(frozen=True)
class Fact:
    kind: str
    expression: str | None
    given: str | None
    status: str  # valid | invalid | unknown
    origin: str


@dataclass(frozen=True)
class Decision:
    eligibility: str
    train: str
    release: str
    reasons: tuple[str, ...]
    opt_out_ids: tuple[str, ...]


@dataclass
class LicensePolicy:
    train: LicenseUse = field(default_factory=LicenseUse)
    release: LicenseUse = field(default_factory=lambda: LicenseSettings().release)
    repositories: dict[str, tuple[str, str]] = field(default_factory=dict)  # normalized -> (license, origin)
    policy_terms: list[tuple[str, str]] = field(default_factory=list)  # (pattern, license)
    digest: str = ""

    @classmethod
    def from_settings(cls, s: LicenseSettings, config_path: str | None = None) -> LicensePolicy:
        """The policy of a settings section; mapping licenses are checked here (a bad one is an
        error naming the file and line, not a silent unknown)."""
        where = config_path or "trajwh.toml"
        repos: dict[str, tuple[str, str]] = {}
        file_digest = ""
        if s.repository_file:
            path = Path(s.repository_file)
            if not path.is_absolute() and config_path and Path(config_path).is_file():
                path = Path(config_path).parent / path
            if not path.is_file():
                raise ConfigError(f"licenses.repository_file {s.repository_file} does not exist", where=where,
                                  valid="a CSV file of 'repository,license' lines, relative to the config file")
            data = path.read_bytes()
            file_digest = hashlib.sha256(data).hexdigest()[:16]
            for n, row in enumerate(csv.reader(data.decode("utf-8", "replace").splitlines()), 1):
                if not row or row[0].startswith("#") or [c.strip().lower() for c in row[:2]] == ["repository", "license"]:
                    continue
                if len(row) < 2:
                    raise ConfigError("a line is not 'repository,license'", where=f"{path}:{n}",
                                      valid="e.g. github.com/psf/requests,Apache-2.0")
                repos[_repo(row[0])] = (require_valid(row[1], f"{path}:{n}"), f"mapping {path.name}:{n}")
        for repo, lic in s.repositories.items():  # the config file's own entries win over the file's
            repos[_repo(repo)] = (require_valid(lic, f"{where} [licenses.repositories] {repo!r}"),
                                  "trajwh.toml [licenses.repositories]")
        terms = [(pat, require_valid(lic, f"{where} [licenses.policy_terms] {pat!r}")) for pat, lic in s.policy_terms.items()]
        digest = hashlib.sha256((s.model_dump_json() + file_digest + POLICY_VERSION).encode()).hexdigest()[:16]
        return cls(train=s.train, release=s.release, repositories=repos, policy_terms=terms, digest=digest)

    def facts(self, e: dict[str, Any]) -> list[Fact]:
        """The license facts of one episode row (``license``, ``meta_license``, ``meta_repository_license``,
        ``repository``, ``instance_id``, ``policy_name``)."""
        out = _source_facts(e)
        repo_given = e.get("meta_repository_license")
        if repo_given:
            out.append(_fact("repository", repo_given, "source metadata $.repository_license"))
        else:
            repo = normalize_repository(e.get("repository"), e.get("instance_id"))
            if repo and repo in self.repositories:
                lic, origin = self.repositories[repo]
                out.append(_fact("repository", lic, origin))
        name = e.get("policy_name")
        if name:
            for pattern, lic in self.policy_terms:
                if fnmatch.fnmatchcase(name.lower(), pattern.lower()):
                    out.append(_fact("policy_terms", lic, f"trajwh.toml [licenses.policy_terms] {pattern!r}"))
                    break
        return out

    def decide(self, facts: list[Fact], opt_outs: list[tuple[str, str]] = ()) -> Decision:
        """What the facts (and the matching opt-outs: (id, kind)) allow for each use."""
        reasons: list[str] = []
        result = {}
        for use_name, use in (("train", self.train), ("release", self.release)):
            rank = DECISION_RANK["allow"]
            for f in facts:
                if f.status == "valid":
                    d, bad = decide(parse(f.expression), use.allow, use.review)
                    if d != "allow":
                        detail = "" if bad == [f"{f.expression} ({d})"] else f" (not allowed: {', '.join(bad)})"
                        reasons.append(f"{use_name}: {d} {f.kind} license {f.expression}{detail}")
                elif f.status == "invalid" or f.kind in use.require:
                    d = use.unknown
                    if d != "allow":
                        what = "not valid SPDX" if f.status == "invalid" else "unknown"
                        reasons.append(f"{use_name}: {d} {f.kind} license {what}")
                else:
                    continue
                rank = min(rank, DECISION_RANK[d])
            for kind in use.require:  # a required kind with no fact at all
                if not any(f.kind == kind for f in facts):
                    if use.unknown != "allow":
                        reasons.append(f"{use_name}: {use.unknown} {kind} license unknown")
                    rank = min(rank, DECISION_RANK[use.unknown])
            if opt_outs:
                rank = DECISION_RANK["block"]
                reasons += [f"{use_name}: block opted out ({kind}, {oid})" for oid, kind in opt_outs]
            result[use_name] = next(k for k, v in DECISION_RANK.items() if v == rank)
        train_ok, release_ok = result["train"] == "allow", result["release"] == "allow"
        eligibility = ("release" if train_ok and release_ok else "train" if train_ok
                       else "release_only" if release_ok else "blocked")
        return Decision(eligibility, result["train"], result["release"], tuple(reasons),
                        tuple(oid for oid, _ in opt_outs))


def _repo(text: str) -> str:
    return normalize_repository(text.strip()) or text.strip()


def _fact(kind: str, given: str, origin: str) -> Fact:
    p = parse(given)
    if p.valid:
        return Fact(kind, p.normalized, given, "valid", origin)
    return Fact(kind, None, given, "invalid", f"{origin}: {p.error}")


def _source_facts(e: dict[str, Any]) -> list[Fact]:
    """The batch's license (``--license``) and the record's own (``$.license``): both bind."""
    out = []
    if e.get("license"):
        out.append(_fact("source", e["license"], f"ingest --license (batch {e.get('_batch_id') or '?'})"))
    if e.get("meta_license"):
        out.append(_fact("source", e["meta_license"], "source metadata $.license"))
    return out or [Fact("source", None, None, "unknown", "no --license at ingest and no $.license in the record")]
