"""The synthetic world: repositories, tasks, policies, harnesses, and the secrets we plant.

Everything is drawn from one ``random.Random`` so a seed fixes the whole corpus. The shapes
follow SWE-bench-style data: a task is an issue in a repository at a base commit, fixed
upstream by a commit that touches one function, checked by FAIL_TO_PASS and PASS_TO_PASS
tests.
"""

from __future__ import annotations

import base64
import random
import string
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

ORGS = ["acme", "northwind", "globex", "initech", "umbrella", "hooli", "stark", "wayne",
        "cyberdyne", "tyrell", "wonka", "soylent"]
NAMES = ["widgetlib", "fastparse", "tinyhttp", "datagrid", "qlog", "confy", "pathkit", "retryx",
         "shapely-lite", "timewarp", "csvtool", "imgproc", "authz", "cachebox", "mdrender",
         "units", "geoindex", "taskq", "ormish", "clikit", "jsonpatchy", "bitset", "ratelimit", "dsl"]
MODULES = ["core", "utils", "parser", "io", "config", "models", "cli", "cache", "types", "errors"]
VERBS = ["parse", "load", "render", "merge", "validate", "resolve", "encode", "split", "format", "compute"]
NOUNS = ["header", "path", "record", "token", "config", "range", "window", "node", "schema", "value"]
BUGS = [
    ("raises {exc} when the {noun} is empty", "IndexError"),
    ("returns the wrong result for negative {noun} values", "AssertionError"),
    ("ignores the `strict` flag when given a {noun}", "AssertionError"),
    ("crashes with {exc} on unicode {noun}s", "UnicodeDecodeError"),
    ("drops the last {noun} when the input ends without a newline", "AssertionError"),
    ("is off by one for a {noun} at the boundary", "AssertionError"),
    ("raises {exc} instead of returning None for a missing {noun}", "KeyError"),
    ("mutates the caller's {noun} in place", "AssertionError"),
]

POLICIES = [  # name, checkpoint, version, skill (probability of resolving an average task)
    ("policy-alpha", "ckpt-2025-03-01", "1.0", 0.30),
    ("policy-beta", "ckpt-2025-09-14", "1.4", 0.45),
    ("policy-gamma", "ckpt-2026-02-20", "2.0", 0.55),
    ("teacher-omega", "teacher-v3", "3.0", 0.75),
]
HARNESSES = [  # name, version, style
    ("swe-loop", "2.1.0", "function"),
    ("shell-agent", "0.9.3", "bash"),
    ("patchpilot", "1.4.0", "text"),
]
FAILURE_CAUSES = [  # cause, weight among unresolved episodes
    ("tests_failed", 0.34),
    ("budget_exhausted", 0.20),
    ("model_gave_up", 0.14),
    ("environment_failure", 0.13),
    ("harness_crash", 0.09),
    ("verifier_unavailable", 0.10),
    ("resource_exhausted", 0.05),
]
GEN_START = datetime(2024, 1, 1, tzinfo=UTC)
GEN_END = datetime(2026, 10, 1, tzinfo=UTC)


def hexstr(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(n))


def alnum(rng: random.Random, n: int, alphabet: str = string.ascii_letters + string.digits) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


@dataclass
class Repo:
    org: str
    name: str
    modules: list[str]
    functions: dict[str, list[str]]
    sources: dict[str, str] = field(default_factory=dict)  # path -> file text

    @property
    def url(self) -> str:
        return f"github.com/{self.org}/{self.name}"

    @property
    def package(self) -> str:
        return self.name.replace("-", "_")

    def module_path(self, module: str) -> str:
        return f"src/{self.package}/{module}.py"

    def test_path(self, module: str) -> str:
        return f"tests/test_{module}.py"


@dataclass
class Task:
    task_id: str
    repo: Repo
    repo_spelling: str  # how this task's source spells the repository (forks, .git, ssh)
    base_commit: str
    fix_commit: str
    module: str
    function: str
    bug: str
    exception: str
    issue_number: int
    issue_created_at: datetime
    fix_merged_at: datetime | None
    base_commit_at: datetime  # the repository state the task starts from: before the issue
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    difficulty: float
    broken: bool  # the environment never builds: every attempt fails for infrastructure reasons

    @property
    def text(self) -> str:
        return (f"{self.function}() in {self.repo.module_path(self.module)} {self.bug}.\n\n"
                f"Steps to reproduce:\n\n    from {self.repo.package}.{self.module} import {self.function}\n"
                f"    {self.function}(...)\n\nExpected the documented behaviour; got {self.exception}. "
                f"(issue #{self.issue_number})")


def _source_file(rng: random.Random, repo: Repo, module: str) -> str:
    lines = [f'"""{repo.package}.{module}: {module} helpers."""', "", "from __future__ import annotations", ""]
    for fn in repo.functions[module]:
        lines += [f"def {fn}(value, *, strict=False):", f'    """{fn.replace("_", " ").capitalize()}."""']
        for _ in range(rng.randint(4, 14)):
            var = rng.choice(NOUNS)
            lines.append(f"    {var} = value.get({var!r}) if isinstance(value, dict) else value")
        lines += ["    if strict and value is None:", "        raise ValueError('value is required')",
                  "    return value", "", ""]
    return "\n".join(lines)


def make_repos(rng: random.Random, n: int) -> list[Repo]:
    repos = []
    for i in range(n):
        org = ORGS[i % len(ORGS)]
        name = NAMES[i % len(NAMES)] + ("" if i < len(NAMES) else f"{i // len(NAMES)}")
        modules = rng.sample(MODULES, rng.randint(4, 7))
        functions = {m: [f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}" for _ in range(rng.randint(3, 6))]
                     for m in modules}
        repo = Repo(org, name, modules, {m: list(dict.fromkeys(f)) for m, f in functions.items()})
        repo.sources = {repo.module_path(m): _source_file(rng, repo, m) for m in modules}
        repos.append(repo)
    return repos


def _spelling(rng: random.Random, repo: Repo) -> str:
    r = rng.random()
    if r < 0.70:
        return repo.url
    if r < 0.80:
        return f"https://github.com/{repo.org}/{repo.name}.git"
    if r < 0.88:
        return f"git@github.com:{repo.org}/{repo.name}.git"
    return f"github.com/{rng.choice(['jdoe', 'mirror-bot', 'contrib42'])}/{repo.name}"  # a fork


def make_tasks(rng: random.Random, repos: list[Repo], n: int) -> list[Task]:
    tasks = []
    for i in range(n):
        repo = repos[i % len(repos)]
        module = rng.choice(repo.modules)
        function = rng.choice(repo.functions[module])
        bug, exc = rng.choice(BUGS)
        created = GEN_START - timedelta(days=540) + timedelta(days=rng.uniform(0, 1400))
        merged = created + timedelta(days=rng.expovariate(1 / 20)) if rng.random() < 0.92 else None
        tests = [f"{repo.test_path(module)}::test_{function}_{c}" for c in
                 rng.sample(["empty", "negative", "strict", "unicode", "boundary", "missing", "basic", "copy"], 3)]
        p2p = [f"{repo.test_path(m)}::test_{f}" for m in repo.modules for f in repo.functions[m]]
        rng.shuffle(p2p)
        number = 100 + i * 7 + rng.randint(0, 6)
        tasks.append(Task(
            task_id=f"{repo.org}__{repo.name}-{number}", repo=repo, repo_spelling=_spelling(rng, repo),
            base_commit=hexstr(rng, 40), fix_commit=hexstr(rng, 40), module=module, function=function,
            bug=bug.format(noun=rng.choice(NOUNS), exc=exc), exception=exc, issue_number=number,
            issue_created_at=created, fix_merged_at=merged, base_commit_at=created - timedelta(hours=number % 240),
            fail_to_pass=tests[: rng.randint(1, 3)],
            pass_to_pass=[t for t in p2p if t not in tests][: rng.randint(3, 8)],
            difficulty=rng.betavariate(2, 3), broken=rng.random() < 0.03,
        ))
    return tasks


# --- planted secrets and personal data, and decoys that must survive redaction ------------------


def _luhn_complete(rng: random.Random, prefix: str, length: int) -> str:
    digits = [int(c) for c in prefix] + [rng.randint(0, 9) for _ in range(length - len(prefix) - 1)]
    total = 0
    for i, d in enumerate(reversed(digits)):
        if i % 2 == 0:
            d *= 2
            d = d - 9 if d > 9 else d
        total += d
    return "".join(map(str, digits)) + str((10 - total % 10) % 10)


def _jwt(rng: random.Random) -> str:
    def b64(b: bytes) -> str:
        return base64.urlsafe_b64encode(b).rstrip(b"=").decode()
    header = b64(b'{"alg":"HS256","typ":"JWT"}')
    payload = b64(f'{{"sub":"{rng.randint(1000, 99999)}","name":"svc","iat":{rng.randint(1600000000, 1800000000)}}}'.encode())
    return f"{header}.{payload}.{b64(rng.randbytes(32))}"


def make_secret(rng: random.Random, kind: str) -> str:
    up = string.ascii_uppercase + string.digits
    makers = {
        "aws_access_key": lambda: "AKIA" + alnum(rng, 16, up),
        "aws_secret_key": lambda: alnum(rng, 40, string.ascii_letters + string.digits + "/+"),
        "github_token": lambda: "ghp_" + alnum(rng, 36),
        "gitlab_token": lambda: "glpat-" + alnum(rng, 20, string.ascii_letters + string.digits + "_-"),
        "slack_token": lambda: f"xoxb-{rng.randint(10**10, 10**11)}-{rng.randint(10**10, 10**11)}-{alnum(rng, 24)}",
        "stripe_key": lambda: "sk_live_" + alnum(rng, 24),
        "openai_key": lambda: "sk-proj-" + alnum(rng, 48, string.ascii_letters + string.digits + "_-"),
        "anthropic_key": lambda: "sk-ant-api03-" + alnum(rng, 86, string.ascii_letters + string.digits + "_-") + "AA",
        "huggingface_token": lambda: "hf_" + alnum(rng, 34),
        "jwt": lambda: _jwt(rng),
        "password": lambda: alnum(rng, 8) + rng.choice("!#%") + alnum(rng, 5),
        "email": lambda: f"{rng.choice(['alice', 'bob', 'carol', 'dmitri', 'eve', 'farah'])}.{rng.choice(['smith', 'ng', 'garcia', 'okafor'])}@{rng.choice(['example-corp.com', 'mailhost.io', 'uni.edu'])}",
        "phone": lambda: f"+1-{rng.randint(201, 989)}-{rng.randint(200, 999)}-{rng.randint(1000, 9999)}",
        "ipv4": lambda: f"{rng.choice([34, 52, 104, 185])}.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}",
        "credit_card": lambda: _luhn_complete(rng, rng.choice(["4", "51", "37"]), 16),
        "username": lambda: rng.choice(["jsmith", "mlopez", "akumar", "wchen", "tnguyen", "hmuller"]),
        "private_key": lambda: "-----BEGIN RSA PRIVATE KEY-----\n" + "\n".join(
            alnum(rng, 64, string.ascii_letters + string.digits + "+/") for _ in range(6)) + "\n-----END RSA PRIVATE KEY-----",
    }
    return makers[kind]()


SECRET_KINDS = ["aws_access_key", "aws_secret_key", "github_token", "gitlab_token", "slack_token",
                "stripe_key", "openai_key", "anthropic_key", "huggingface_token", "jwt", "password",
                "email", "phone", "ipv4", "credit_card", "username", "private_key"]

DECOYS = [
    "AKIAIOSFODNN7EXAMPLE",  # AWS's documented example key
    "YOUR_API_KEY",
    "sk-xxxxxxxxxxxxxxxxxxxxxxxx",
    "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "550e8400-e29b-41d4-a716-446655440000",
    "v2.31.0",
    "127.0.0.1",
]
