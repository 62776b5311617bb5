"""Deterministic synthetic corpus in the native format (``trajwh synth``).

Default: about 2,000 episodes over about 150 tasks in 24 repositories, several attempts per
task from four policies and three harnesses. It plants what every later layer must find: every
outcome cause, productive and recovery segments with per-test vectors, secrets and personal
data with decoys, near-duplicate teacher episodes (same actions, other words), time leaks (the
agent sees the fix commit), repository forks and URL spellings, broken tasks, and a long-tailed
size distribution (some observations over 100 KB). The ground truth goes to
``<out>/.truth/labels.jsonl`` (hidden, so ingest skips it).
"""

from __future__ import annotations

import gzip
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson
from trajwh.schemas import ids
from trajwh.synth.episodes import Truth, plan_episode, render_steps
from trajwh.synth.world import (
    FAILURE_CAUSES,
    GEN_END,
    HARNESSES,
    POLICIES,
    SECRET_KINDS,
    Task,
    hexstr,
    make_repos,
    make_tasks,
)

EXIT_STATUS = {  # (cause, harness style) -> (exit_status, termination_reason); harnesses differ
    ("budget_exhausted", "function"): ("exit_cost", "cost_limit"),
    ("budget_exhausted", "bash"): ("LimitsExceeded", "max_steps"),
    ("budget_exhausted", "text"): ("max_iterations", "max_iterations"),
    ("harness_crash", "function"): ("exit_format", "harness_exception"),
    ("harness_crash", "bash"): ("FormatError", "harness_exception"),
    ("harness_crash", "text"): ("error", "harness_exception"),
    ("resource_exhausted", "function"): ("OOMKilled", "container OOMKilled (memory limit 8Gi)"),
    ("resource_exhausted", "bash"): ("preempted", "pod preempted: spot instance interruption"),
    ("resource_exhausted", "text"): ("resource_exhausted", "resource_exhausted: sandbox CPU quota"),
}
#: infrastructure reported in words that also mean an agent limit ("timeout"): the taxonomy must
#: still call them infrastructure (cause -> (exit_status, termination_reason, verifier_status))
INFRA_VARIANTS = {
    "verifier_unavailable": ("submitted", "verifier timeout after submit", "error"),
    "environment_failure": ("sandbox start timeout", "sandbox start timeout", "not_run"),
}


@dataclass
class SynthConfig:
    episodes: int = 2000
    tasks: int | None = None  # default: episodes // 13, at least 1
    seed: int = 0
    shard_size: int = 500
    gzip_every: int = 3  # every n-th shard is gzipped, to exercise transparent gzip

    @property
    def n_tasks(self) -> int:
        return self.tasks or max(1, self.episodes // 13)


@dataclass
class SynthSummary:
    out: Path
    episodes: int = 0
    steps: int = 0
    bytes: int = 0
    files: list[Path] = field(default_factory=list)
    causes: Counter = field(default_factory=Counter)
    tasks: int = 0
    secrets: int = 0
    leaks: int = 0
    near_dups: int = 0


ALL_CAUSES = ["resolved"] + [c for c, _ in FAILURE_CAUSES]


def _outcome(cause: str, style: str, task: Task, variant: bool = False) -> dict[str, Any]:
    f2p, p2p = task.fail_to_pass, task.pass_to_pass
    if variant and cause in INFRA_VARIANTS:
        status, reason, verifier = INFRA_VARIANTS[cause]
        return {"resolved": None if cause == "verifier_unavailable" else False, "exit_status": status,
                "termination_reason": reason, "verifier_status": verifier}
    if cause == "resolved":
        tests = [{"name": t, "status": "passed"} for t in f2p + p2p]
        return {"resolved": True, "exit_status": "submitted", "termination_reason": "submit", "reward": 1.0,
                "verifier_status": "ok", "test_results": tests}
    if cause == "tests_failed":
        tests = [{"name": t, "status": "failed" if i == 0 else "passed"} for i, t in enumerate(f2p)]
        tests += [{"name": t, "status": "passed"} for t in p2p]
        return {"resolved": False, "exit_status": "submitted", "termination_reason": "submit", "reward": 0.0,
                "verifier_status": "ok", "test_results": tests}
    if cause == "verifier_unavailable":
        return {"resolved": None, "exit_status": "submitted", "termination_reason": "submit",
                "verifier_status": "unavailable"}
    if cause == "model_gave_up":
        return {"resolved": False, "exit_status": "gave_up", "termination_reason": "agent_stopped",
                "verifier_status": "not_run"}
    if cause == "environment_failure":
        return {"resolved": False, "exit_status": "environment_error", "termination_reason": "environment_error",
                "verifier_status": "not_run"}
    status, reason = EXIT_STATUS[(cause, style)]
    return {"resolved": False, "exit_status": status, "termination_reason": reason, "verifier_status": "not_run"}


def _pick_cause(rng: random.Random, task: Task, skill: float) -> str:
    if task.broken and rng.random() < 0.9:
        return "environment_failure"
    if rng.random() < skill * (1.3 - task.difficulty):
        return "resolved"
    r = rng.random() * sum(w for _, w in FAILURE_CAUSES)
    for cause, w in FAILURE_CAUSES:
        r -= w
        if r <= 0:
            return cause
    return FAILURE_CAUSES[-1][0]


def n_repositories(n_tasks: int) -> int:
    """About 25 tasks per repository once there are more than 24 repositories (public task sets
    range from 6 to 400 tasks per repository: SWE-bench 190, SWE-Gym 220, SWE-rebench 6), so a
    corpus at the design's 107,000 episodes spreads over hundreds of repositories instead of
    piling thousands of tasks onto 24."""
    return max(1, min(n_tasks // 4, max(24, n_tasks // 25)))


class _Generator:
    def __init__(self, cfg: SynthConfig):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        repos = make_repos(self.rng, n_repositories(cfg.n_tasks))
        self.tasks = make_tasks(self.rng, repos, cfg.n_tasks)
        weights = [1.0 / (i + 1) ** 0.6 for i in range(len(self.tasks))]
        self.task_weights = weights
        self.attempts: Counter = Counter()
        self.teacher_runs: dict[tuple[str, str], tuple[str, list, str, tuple]] = {}
        self.harness_meta = {h[0]: {"commit": hexstr(self.rng, 40), "tools": hexstr(self.rng, 32)} for h in HARNESSES}
        self.verifier_commit = hexstr(self.rng, 40)

    def episode(self, n: int) -> tuple[dict[str, Any], Truth]:
        rng = self.rng
        task = rng.choices(self.tasks, weights=self.task_weights)[0] if n >= len(self.tasks) else self.tasks[n]
        policy, ckpt, pver, skill = rng.choice(POLICIES)
        hname, hver, style = rng.choice(HARNESSES)
        key = (task.task_id, policy, hname)
        self.attempts[key] += 1
        attempt = self.attempts[key]
        episode_id = f"{hname}-{policy}-{task.task_id}-a{attempt}-{hexstr(rng, 6)}"
        earliest = max(task.issue_created_at + timedelta(days=1), GEN_END - timedelta(days=900))
        start = earliest + timedelta(seconds=rng.uniform(0, max(1.0, (GEN_END - earliest).total_seconds())))
        repeat = self.teacher_runs.get(key[:1] + (hname,)) if policy == "teacher-omega" else None
        if repeat is not None and rng.random() < 0.5:
            cause, actions, origin, (secrets, leaks, segments) = repeat
            truth = Truth(episode_id, task.task_id, task.repo.url, cause, near_dup_of=origin,
                          secrets=list(secrets), leak_steps=list(leaks), segments=list(segments))
            paraphrase = True
        else:
            # the first episodes walk through every cause, so even a tiny corpus has each one
            cause = ALL_CAUSES[n] if n < len(ALL_CAUSES) else _pick_cause(rng, task, skill)
            truth = Truth(episode_id, task.task_id, task.repo.url, cause)
            secret_kinds = rng.sample(SECRET_KINDS, rng.randint(1, 3)) if rng.random() < 0.25 else []
            actions = plan_episode(rng, task, style, cause, truth, secret_kinds,
                                   leak=rng.random() < 0.04 or n % 41 == 7,
                                   big_obs=rng.random() < 0.02 or n % 97 == 5)
            paraphrase = False
            if policy == "teacher-omega":
                planted = (list(truth.secrets), list(truth.leak_steps), list(truth.segments))
                self.teacher_runs[key[:1] + (hname,)] = (cause, actions, episode_id, planted)
        truth.broken_task = task.broken
        variant = rng.random() < 0.4
        truth.action_signature = [f"{a.kind}:{a.obj}" for a in actions]
        steps, where = render_steps(rng, actions, style, task, start, paraphrase)
        if rng.random() < 0.05 and len(steps) > 4:  # a human steps in
            steps.insert(3, {"role": "user", "author": "human", "text": "Please keep the public API unchanged."})
            where = {k: tuple(v + 1 if v >= 3 else v for v in pair) for k, pair in where.items()}
            for i, s in enumerate(steps):
                s["index"] = i
        _relocate_truth(truth, where)
        tokens_in = sum(s.get("tokens_in") or 0 for s in steps)
        tokens_out = sum(s.get("tokens_out") or 0 for s in steps)
        ended = max((s["ended_at"] for s in steps if s.get("ended_at")), default=start + timedelta(minutes=5))
        temperature = rng.choice([0.0, 0.2, 0.7, 1.0])
        episode = {
            "format": "trajwh.native", "format_version": "1.0", "episode_id": episode_id,
            "task": {"task_id": task.task_id, "text": task.text, "repository": task.repo_spelling,
                     "base_commit": task.base_commit, "base_commit_at": task.base_commit_at,
                     "instance_id": task.task_id,
                     "issue_created_at": task.issue_created_at, "fix_merged_at": task.fix_merged_at,
                     "initial_state_digest": ids.digest(task.repo.url + task.base_commit)},
            "environment": {"image_digest": "sha256:" + ids.sha256_hex(f"{task.repo.url}{hname}".encode()),
                            "tool_schema_digest": self.harness_meta[hname]["tools"]},
            "policy": {"name": policy, "checkpoint": ckpt, "version": pver},
            "harness": {"name": hname, "version": hver, "commit": self.harness_meta[hname]["commit"]},
            "verifier": {"name": "swebench-harness", "commit": self.verifier_commit},
            "sampling": {"temperature": temperature, "top_p": 0.95, "max_tokens": 4096},
            "attempt": attempt, "started_at": start, "ended_at": ended,
            "outcome": _outcome(cause, style, task, variant),
            "usage": {"tokens_in": tokens_in, "tokens_out": tokens_out,
                      "cost_usd": round(tokens_in * 3e-6 + tokens_out * 1.5e-5, 6)},
            "steps": steps,
        }
        return episode, truth


def _relocate_truth(truth: Truth, where: dict[int, tuple[int, int]]) -> None:
    """Action indexes in the truth -> step indexes in the rendered episode.

    A secret in a tool call is in the model's step, one in an observation in the next step; a
    segment starts at the model's first action and ends at the observation that verifies it.
    """
    truth.leak_steps = [where[i][1] for i in truth.leak_steps]
    truth.secrets = [{**s, "step": where[s["action"]][0 if s["field"] == "tool_call" else 1]} for s in truth.secrets]
    truth.segments = [{**s, "start_step": where[s["start"]][0], "end_step": where[s["end"]][1],
                       **({"mistake_step": where[s["mistake"]][0], "anomaly_step": where[s["anomaly"]][1]}
                          if "mistake" in s else {})} for s in truth.segments]


def generate_corpus(cfg: SynthConfig, out: str | Path, progress: Callable[[int], None] | None = None) -> SynthSummary:
    """Write the corpus as JSONL shards under ``out``; returns counts."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / ".truth").mkdir(exist_ok=True)
    gen = _Generator(cfg)
    summary = SynthSummary(out, tasks=len(gen.tasks))
    opts = orjson.OPT_UTC_Z | orjson.OPT_NAIVE_UTC
    with open(out / ".truth" / "labels.jsonl", "wb") as labels:
        for shard_start in range(0, cfg.episodes, cfg.shard_size):
            shard = shard_start // cfg.shard_size
            gz = cfg.gzip_every > 0 and shard % cfg.gzip_every == cfg.gzip_every - 1
            path = out / f"episodes-{shard:05d}.jsonl{'.gz' if gz else ''}"
            lines = []
            for n in range(shard_start, min(cfg.episodes, shard_start + cfg.shard_size)):
                episode, truth = gen.episode(n)
                line = orjson.dumps(episode, option=opts)
                lines.append(line)
                labels.write(orjson.dumps(truth.__dict__) + b"\n")
                summary.episodes += 1
                summary.steps += len(episode["steps"])
                summary.bytes += len(line) + 1
                summary.causes[truth.cause] += 1
                summary.secrets += len(truth.secrets)
                summary.leaks += bool(truth.leak_steps)
                summary.near_dups += truth.near_dup_of is not None
                if progress:
                    progress(1)
            data = b"\n".join(lines) + b"\n"
            if gz:
                with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1, mtime=0) as f:
                    f.write(data)
            else:
                path.write_bytes(data)
            summary.files.append(path)
    return summary
