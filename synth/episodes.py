"""Rendering one synthetic episode: a plan of actions, then harness-specific steps.

A plan is a list of ``Action`` (kind, object, thought, observation, tests). Each harness style
renders it differently, as real harnesses do: ``function`` (OpenAI-style tool calls with JSON
arguments), ``bash`` (one shell tool), ``text`` (commands inside fenced blocks in the model's
text). The ground truth of what was planted (cause, secrets, leak step, productive and recovery
segments, near-duplicate origin) is returned beside the episode, never inside it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from trajwh.synth.world import DECOYS, Task, hexstr, make_secret

SYSTEM_PROMPTS = {
    "function": ("You are an autonomous software engineer working in a repository checkout. Use the "
                 "tools read_file, search, edit_file, run and submit. Think step by step, keep edits "
                 "minimal, and run the relevant tests before you submit.\n") * 3,
    "bash": ("You are a helpful assistant that can interact with a computer shell to solve programming "
             "tasks. Reply with exactly one bash command per turn in the `bash` tool. When done, run "
             "`submit`.\n") * 3,
    "text": ("SYSTEM: You are PatchPilot. Each reply contains one short DISCUSSION and one command in a "
             "```bash fenced block. The environment answers with the command output.\n") * 3,
}
TEST_CMDS = {"function": "python -m pytest {tests} -q", "bash": "pytest {tests} -q -p no:cacheprovider",
             "text": "python -m pytest -x {tests}"}


@dataclass
class Action:
    kind: str  # read | search | edit | run | test | submit | other | giveup
    obj: str
    thought: str
    command: str
    observation: str = ""
    exit_code: int | None = 0
    tests: list[dict[str, str]] | None = None
    author: str = "model"  # "harness" for auto-actions and crash reports
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class Truth:
    episode_id: str
    task_id: str
    repository: str
    cause: str
    near_dup_of: str | None = None
    leak_steps: list[int] = field(default_factory=list)
    secrets: list[dict[str, Any]] = field(default_factory=list)
    segments: list[dict[str, Any]] = field(default_factory=list)
    broken_task: bool = False
    action_signature: list[str] = field(default_factory=list)


def pytest_output(results: list[dict[str, str]], rng: random.Random) -> str:
    lines = ["============================= test session starts ==============================",
             "platform linux -- Python 3.11.7, pytest-8.3.2, pluggy-1.5.0",
             f"collected {len(results)} items", ""]
    for r in results:
        lines.append(f"{r['name']} {r['status'].upper()}")
    fails = [r for r in results if r["status"] == "failed"]
    for r in fails:
        lines += ["", f"___________________ {r['name'].split('::')[-1]} ___________________",
                  "    def test_case():", ">       assert result == expected", "E       AssertionError: assert None == 3"]
    n_pass = sum(r["status"] == "passed" for r in results)
    summary = f"{len(fails)} failed, {n_pass} passed" if fails else f"{n_pass} passed"
    lines.append(f"========================= {summary} in {rng.uniform(0.05, 9):.2f}s =========================")
    return "\n".join(lines)


def test_vector(task: Task, fixed: int, broken: set[str] | None = None) -> list[dict[str, str]]:
    """Per-test results: the first ``fixed`` FAIL_TO_PASS tests pass, ``broken`` P2P tests fail."""
    broken = broken or set()
    out = [{"name": t, "status": "passed" if i < fixed else "failed"} for i, t in enumerate(task.fail_to_pass)]
    out += [{"name": t, "status": "failed" if t in broken else "passed"} for t in task.pass_to_pass]
    return out


class PlanBuilder:
    """Builds the action plan of one episode for one cause; records the truth as it goes."""

    def __init__(self, rng: random.Random, task: Task, style: str, truth: Truth, big_obs: bool):
        self.rng, self.task, self.style, self.truth, self.big_obs = rng, task, style, truth, big_obs
        self.actions: list[Action] = []
        self.fixed = 0

    def say(self, *options: str) -> str:
        return self.rng.choice(options)

    def add(self, action: Action) -> int:
        self.actions.append(action)
        return len(self.actions) - 1

    # -- exploration --------------------------------------------------------------------------

    def explore(self) -> None:
        t, repo = self.task, self.task.repo
        path = repo.module_path(t.module)
        self.add(Action("search", t.function, self.say(
            f"Let me find where {t.function} is defined.", f"I'll search the code base for {t.function}.",
            f"First, locate {t.function} in the repository."),
            f'grep -rn "def {t.function}" src/',
            f"{path}:{self.rng.randint(5, 80)}:def {t.function}(value, *, strict=False):"))
        src = repo.sources[path]
        if self.big_obs:
            src = (src + "\n") * max(1, 120_000 // max(1, len(src)))
        self.add(Action("read", path, self.say(
            "Now read the implementation.", f"Let me look at {path}.", "Open the file to inspect the function."),
            f"cat {path}", src))
        if self.rng.random() < 0.5:
            test_path = repo.test_path(t.module)
            self.add(Action("read", test_path, "Let me check the existing tests.", f"sed -n '1,80p' {test_path}",
                            f"import pytest\nfrom {repo.package}.{t.module} import {t.function}\n\n"
                            f"def test_{t.function}():\n    assert {t.function}(1) == 1\n"))

    def leak(self) -> None:
        """The agent looks at the future: the upstream fix commit is in `git log --all`."""
        t = self.task
        when = (t.fix_merged_at or t.issue_created_at + timedelta(days=3)).strftime("%a %b %d %H:%M:%S %Y +0000")
        obs = (f"{t.fix_commit[:7]} (origin/main) Fix {t.function}: {t.bug} (#{t.issue_number + 1})\n"
               f"{t.base_commit[:7]} (HEAD) Merge pull request #{t.issue_number - 3}\n"
               f"commit {t.fix_commit}\nDate:   {when}\n")
        i = self.add(Action("run", "git log --all", "Let me look at the history for hints.",
                            "git log --all --oneline -n 5", obs))
        self.truth.leak_steps.append(i)

    def reproduce(self) -> None:
        t = self.task
        self.add(Action("run", "reproduce.py", self.say("Let me reproduce the issue.", "Write a quick reproduction."),
                        "python reproduce.py",
                        f"Traceback (most recent call last):\n  File \"reproduce.py\", line 3, in <module>\n"
                        f"    {t.function}(...)\n{t.exception}: {t.bug}", exit_code=1))

    # -- editing and testing ------------------------------------------------------------------

    def edit(self, good: bool) -> int:
        t = self.task
        path = t.repo.module_path(t.module)
        old, new = "    return value", ("    return value if value is not None else None" if good
                                         else "    return value or {}")
        return self.add(Action("edit", path, self.say(
            f"Fix {t.function} so it handles this case.", "Apply the fix.", "Let me patch the function."),
            f"sed -i 's/{old.strip()}/{new.strip()}/' {path}", f"Edited {path}: 1 line changed.",
            args={"path": path, "old": old, "new": new}))

    def run_tests(self, broken: set[str] | None = None) -> int:
        results = test_vector(self.task, self.fixed, broken)
        names = " ".join(sorted({r["name"].split("::")[0] for r in results}))
        failed = any(r["status"] == "failed" for r in results)
        return self.add(Action("test", names, self.say("Run the tests.", "Let me verify with the test suite.",
                                                        "Now run the relevant tests."),
                               TEST_CMDS[self.style].format(tests=names), pytest_output(results, self.rng),
                               exit_code=1 if failed else 0, tests=results))

    def progress_to(self, target: int) -> None:
        """Edits and test runs that fix FAIL_TO_PASS tests one or more at a time (productive). The
        agent runs the tests once first, so each gain is visible against a run before it."""
        if target > self.fixed and not any(a.kind == "test" for a in self.actions):
            self.run_tests()
        while self.fixed < target:
            start = self.edit(good=True)
            self.fixed = min(target, self.fixed + self.rng.randint(1, 2))
            end = self.run_tests()
            self.truth.segments.append({"kind": "productive", "start": start, "end": end, "fixed": self.fixed})

    def recovery(self) -> None:
        """Wrong edit -> failing evidence -> diagnosis -> revert -> re-verification."""
        t = self.task
        self.run_tests()  # the state before the wrong edit: the task's failing tests fail, the rest pass
        mistake = self.edit(good=False)
        victim = {self.rng.choice(t.pass_to_pass)}
        anomaly = self.run_tests(broken=victim)
        path = t.repo.module_path(t.module)
        start = self.add(Action("other", "diagnosis", f"My edit broke {next(iter(victim))}: returning {{}} changes the "
                        "type for falsy inputs. I will revert it and handle None explicitly.",
                        f"git diff {path}", "-    return value\n+    return value or {}"))
        self.add(Action("edit", path, "Revert the bad change.", f"git checkout -- {path}", "Updated 1 path from the index"))
        end = self.run_tests()
        self.truth.segments.append({"kind": "recovery", "start": start, "end": end, "mistake": mistake,
                                    "anomaly": anomaly})

    def plant_secrets(self, kinds: list[str]) -> None:
        """Tool calls and observations that carry credentials and personal data."""
        rng = self.rng
        for kind in kinds:
            value = make_secret(rng, kind)
            decoy = rng.choice(DECOYS)
            if kind in ("aws_access_key", "aws_secret_key", "openai_key", "anthropic_key", "stripe_key",
                        "huggingface_token", "slack_token", "password"):
                var = {"aws_access_key": "AWS_ACCESS_KEY_ID", "aws_secret_key": "AWS_SECRET_ACCESS_KEY",
                       "openai_key": "OPENAI_API_KEY", "anthropic_key": "ANTHROPIC_API_KEY",
                       "stripe_key": "STRIPE_SECRET_KEY", "huggingface_token": "HF_TOKEN",
                       "slack_token": "SLACK_BOT_TOKEN", "password": "DB_PASSWORD"}[kind]
                obs = f"PATH=/usr/local/bin:/usr/bin\nHOME=/root\n{var}={value}\nEXAMPLE_KEY={decoy}\nLANG=C.UTF-8"
                i = self.add(Action("run", "env", "Check the environment configuration.", "env | sort", obs))
                field_, where = "observation", obs.index(value)
            elif kind in ("github_token", "gitlab_token"):
                host = "github.com" if kind == "github_token" else "gitlab.com"
                obs = f"origin\thttps://x-access-token:{value}@{host}/{self.task.repo.org}/{self.task.repo.name}.git (fetch)"
                i = self.add(Action("run", "git remote", "Which remote is this?", "git remote -v", obs))
                field_, where = "observation", obs.index(value)
            elif kind in ("jwt", "private_key", "ipv4"):
                cmd = {"jwt": f"curl -s -H 'Authorization: Bearer {value}' http://localhost:8080/api/health",
                       "private_key": "cat deploy/id_rsa",
                       "ipv4": f"curl -s http://{value}:9200/_cluster/health"}[kind]
                obs = value if kind == "private_key" else '{"status":"green"}'
                i = self.add(Action("run", cmd.split()[0], "Check the service.", cmd, obs))
                field_ = "observation" if kind == "private_key" else "tool_call"
                where = (obs if field_ == "observation" else cmd).index(value)
            elif kind in ("email", "phone"):
                obs = (f"commit {hexstr(rng, 40)}\nAuthor: Dev <{value}>\nDate:   Tue Mar 4 10:00:00 2025 +0000"
                       if kind == "email" else f"MAINTAINERS:\n  on-call: {value} (pager)\n  build: {decoy}")
                i = self.add(Action("run" if kind == "email" else "read", "git log" if kind == "email" else "MAINTAINERS",
                                    "Who maintains this code?", "git log -n 1" if kind == "email" else "cat MAINTAINERS", obs))
                field_, where = "observation", obs.index(value)
            elif kind == "credit_card":
                obs = f'{{"order": 1182, "card_number": "{value}", "currency": "EUR"}}'
                i = self.add(Action("read", "tests/fixtures/order.json", "Look at the fixture.",
                                    "cat tests/fixtures/order.json", obs))
                field_, where = "observation", obs.index(value)
            else:  # username in a home path, with what makes it a home: a projects folder or a dot folder
                obs = (f"Traceback (most recent call last):\n  File \"/home/{value}/projects/{self.task.repo.name}/"
                       f"{self.task.repo.module_path(self.task.module)}\", line 12\n  File \"/home/{value}/.local/lib/"
                       f"python3.11/site-packages/click/core.py\", line 1157\nValueError: bad input")
                i = self.add(Action("run", "python", "Run the module directly.", f"python -m {self.task.repo.package}", obs, exit_code=1))
                field_, where = "observation", obs.index(value)
            self.truth.secrets.append({"type": kind, "value": value, "action": i, "field": field_, "offset": where})

    # -- endings ------------------------------------------------------------------------------

    def submit(self) -> None:
        t = self.task
        patch = (f"diff --git a/{t.repo.module_path(t.module)} b/{t.repo.module_path(t.module)}\n"
                 f"@@ -10,7 +10,7 @@ def {t.function}(value, *, strict=False):\n-    return value\n"
                 f"+    return value if value is not None else None\n")
        self.add(Action("submit", "patch", "The fix is complete; submitting.", "submit", patch))

    def give_up(self) -> None:
        self.add(Action("giveup", "", self.say(
            "I could not find a fix that makes the failing test pass without breaking others. I am stopping here.",
            "I'm unable to resolve this issue with the information available. Giving up.",
            "After several attempts I cannot fix this reliably; ending the session."), "exit"))

    def crash(self) -> None:
        self.add(Action("other", "harness", "", "", (
            "Traceback (most recent call last):\n  File \"/opt/harness/agent/loop.py\", line 412, in step\n"
            "    action = self.parser.parse(output)\n  File \"/opt/harness/agent/parsing.py\", line 88, in parse\n"
            "    raise FormatError('could not parse model output')\nharness.errors.FormatError: could not parse model output"),
            exit_code=None, author="harness"))

    def pip_noise(self) -> None:
        """An install that retries once and succeeds (exit 0): noise, not an environment failure."""
        self.add(Action("run", "pip install -e .", "Install the package in development mode.", "pip install -e .",
                        "WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None)) after "
                        "connection broken by 'ReadTimeoutError(\"HTTPSConnectionPool(host='pypi.org', port=443): Read "
                        "timed out. (read timeout=15)\")': /simple/setuptools/\nSuccessfully installed "
                        f"{self.task.repo.package}-0.1.dev0", exit_code=0))

    def env_failure(self) -> None:
        msg = self.rng.choice([
            "docker: Error response from daemon: container 3f2a9c is not running.",
            "OSError: [Errno 28] No space left on device: '/tmp/pytest-of-root'",
            "ERROR: Could not install packages due to an OSError: HTTPSConnectionPool(host='files.pythonhosted.org'): Read timed out.",
        ])
        names = " ".join(sorted({n.split("::")[0] for n in self.task.fail_to_pass}))
        self.add(Action("test", names, "Run the tests.", TEST_CMDS[self.style].format(tests=names), msg, exit_code=125))

    def exhaust(self, n: int) -> None:
        t = self.task
        for _ in range(n):
            if self.rng.random() < 0.5:
                self.add(Action("read", t.repo.module_path(t.module), "Let me look again.",
                                f"sed -n '1,40p' {t.repo.module_path(t.module)}",
                                t.repo.sources[t.repo.module_path(t.module)][:1500]))
            else:
                self.run_tests()


def plan_episode(rng: random.Random, task: Task, style: str, cause: str, truth: Truth,
                 secret_kinds: list[str], leak: bool, big_obs: bool) -> list[Action]:
    """The action plan for one episode ending in ``cause``."""
    b = PlanBuilder(rng, task, style, truth, big_obs)
    b.explore()
    if leak:
        b.leak()
    if secret_kinds:
        b.plant_secrets(secret_kinds)
    if cause != "environment_failure" and rng.random() < 0.6:
        b.reproduce()
    if cause == "tests_failed" and rng.random() < 0.3:
        b.pip_noise()
    n_f2p = len(task.fail_to_pass)
    if cause == "environment_failure":
        b.env_failure()
        return b.actions
    if rng.random() < 0.3:
        b.recovery()
    if cause in ("resolved", "verifier_unavailable"):
        b.progress_to(n_f2p)
        b.submit()
    elif cause == "tests_failed":
        b.progress_to(rng.randint(0, n_f2p - 1)) if n_f2p > 1 else b.run_tests()
        b.submit()
    elif cause == "model_gave_up":
        b.progress_to(rng.randint(0, n_f2p - 1)) if n_f2p > 1 else b.run_tests()
        b.give_up()
    elif cause == "budget_exhausted":
        b.progress_to(rng.randint(0, n_f2p - 1)) if n_f2p > 1 else None
        b.exhaust(rng.randint(6, 14))
    elif cause == "harness_crash":
        b.edit(good=True)
        b.crash()
    elif cause == "resource_exhausted":  # killed mid-run: the status says why, no step does
        b.edit(good=True)
    return b.actions


def render_steps(rng: random.Random, actions: list[Action], style: str, task: Task, start: datetime,
                 paraphrase: bool = False) -> tuple[list[dict[str, Any]], dict[int, tuple[int, int]]]:
    """Native steps for a plan; also maps action index -> (model step, observation step)."""
    steps: list[dict[str, Any]] = [
        {"role": "system", "author": "harness", "text": SYSTEM_PROMPTS[style]},
        {"role": "user", "author": "harness", "text": f"<issue>\n{task.text}\n</issue>\nRepository: {task.repo.name} at {task.base_commit[:10]}. Resolve the issue."},
    ]
    where: dict[int, tuple[int, int]] = {}
    t = start
    for ai, a in enumerate(actions):
        thought = (f"Okay. {a.thought} I think this is the right next step." if paraphrase else a.thought)
        if a.author == "harness":
            where[ai] = (len(steps), len(steps))
            steps.append({"role": "user", "author": "harness", "text": a.observation})
            continue
        call_id = f"call_{hexstr(rng, 12)}"
        if a.kind == "giveup":
            steps.append({"role": "assistant", "author": "model", "text": thought})
            where[ai] = (len(steps) - 1, len(steps) - 1)
            continue
        model: dict[str, Any] = {"role": "assistant", "author": "model"}
        if style == "function":
            name, args = _function_call(a)
            model.update(text=thought, tool_calls=[{"id": call_id, "name": name, "arguments": args}])
        elif style == "bash":
            model.update(text=thought, tool_calls=[{"id": call_id, "name": "bash", "arguments": {"command": a.command}}])
        else:
            model.update(text=f"DISCUSSION\n{thought}\n\n```bash\n{a.command}\n```")
            call_id = None
        tokens_out = 20 + len(thought) // 4 + len(a.command) // 4
        model.update(started_at=t, ended_at=t + timedelta(seconds=rng.uniform(1, 20)),
                     tokens_in=1500 + 300 * len(steps), tokens_out=tokens_out)
        t = model["ended_at"]
        steps.append(model)
        where[ai] = (len(steps) - 1, len(steps))
        env = {"role": "tool", "author": "environment", "observation": a.observation, "exit_code": a.exit_code,
               "tool_call_id": call_id, "started_at": t, "ended_at": t + timedelta(seconds=rng.uniform(0.1, 30))}
        if a.tests is not None:
            env["test_results"] = a.tests
        t = env["ended_at"]
        steps.append(env)
    for i, s in enumerate(steps):
        s["index"] = i
    return steps, where


def _function_call(a: Action) -> tuple[str, dict[str, Any]]:
    if a.kind == "read":
        return "read_file", {"path": a.obj}
    if a.kind == "search":
        return "search", {"pattern": f"def {a.obj}", "path": "src/"}
    if a.kind == "edit" and a.args:
        return "edit_file", a.args
    if a.kind == "submit":
        return "submit", {}
    return "run", {"command": a.command}
