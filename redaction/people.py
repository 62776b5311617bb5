"""User names and person names from structure, without a NER model.

User names (``USERNAME``) need evidence that a path segment or a word is a person's account:

- ``/Users/<u>`` (macOS) and ``C:\\Users\\<u>`` (Windows) are always user folders (``Shared``,
  ``Public``, ``Default`` aside), names with a space included (``/Users/Jane Doe/``);
- ``/home/<u>/`` only when what follows is home-folder content: a dot entry (``.bashrc``,
  ``.cache``, ``.config``), the desktop folders (``Documents``, ``Downloads``...), ``projects``,
  ``snap``, conda folders. In sandboxes ``/home`` holds repositories and scripts
  (``/home/Catch2/src``, ``/home/run.sh``): those stay;
- a shell prompt ``u@host:~/dir$``, the line after ``whoami``, ``USER=u`` / ``LOGNAME=u`` /
  ``HOME=/home/u``, and the ``-home-u-`` / ``-Users-u-`` spelling of a home path in a file name
  (Claude Code's project folders).

Once found, a name is replaced wherever it recurs in its scope (``engine._known_values``), with
the spellings that go with it (``ls -l`` owner columns, URL-encoded paths), except very common
words, which are replaced only in the path and prompt contexts above.

Person names (``PERSON``) come from where they are structured: git ``Author:`` / ``Commit:`` /
``Committer:`` lines, ``Signed-off-by:`` / ``Co-authored-by:`` and the other trailers, e-mail
display names (``Jane Doe <jane@...>``, ``"Doe, Jane" <...>``), ``git config user.name``.
Names that belong to example addresses (``@example.com``) and bots are kept.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import ahocorasick_rs

SYSTEM_USERS = frozenset({
    "shared", "public", "default", "runner", "ubuntu", "root", "user", "username", "admin", "guest", "all users",
    "default user", "you", "me", "your_name", "yourname", "name", "runneradmin", "appveyor", "travis", "vagrant",
    "node", "app", "circleci", "jenkins", "docker", "ec2-user", "centos", "debian", "fedora", "git", "www-data",
    "nobody", "daemon", "postgres", "mysql", "redis", "nginx", "apache", "build", "builder", "ci", "test", "tester",
    "developer", "dev", "coder", "agent", "openhands", "swe", "sweagent", "workspace", "testbed", "project", "repo",
    "home", "localuser", "defaultuser0", "administrator", "wdagutilityaccount", "vscode", "codespace", "gitpod",
    "jovyan", "ubuntu-user", "pi", "linuxbrew", "foo", "bar", "example", "demo", "sandbox", "appuser", "service", "svc", "deploy", "ansible", "$user", "%username%",
})
#: words too common to replace outside the contexts that identified them
COMMON_WORDS = frozenset({
    "data", "code", "work", "main", "test", "tests", "src", "lib", "bin", "docs", "app", "apps", "web", "api", "server",
    "client", "admin", "user", "users", "home", "local", "shared", "public", "build", "dist", "tmp", "temp", "dev",
    "prod", "stage", "staging", "master", "origin", "debug", "release", "python", "node", "java", "rust", "go",
    "mark", "max", "will", "grace", "rose", "jack", "bill", "frank", "page", "art", "ray", "dean", "hope", "joy",
    "sam", "tom", "dan", "ben", "amy", "eve", "ada", "lee", "kim", "new", "old", "all", "any", "one", "two",
})
_HOME_CONTENT = (r"(?:\.[A-Za-z0-9_][\w.-]*|Documents|Downloads|Desktop|Pictures|Music|Videos|Templates|Movies|Library|"
                 r"Applications|snap|miniconda3?|anaconda3?|miniforge3|mambaforge|projects|Projects|repos|Repos|"
                 r"workspace|Workspace|git|github|GitHub|Dropbox|OneDrive|notes|Notes|venvs|virtualenvs)(?=[/\\\s\"':]|$)")
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{1,31}"
_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"/Users/(?P<v>" + _NAME + r"(?: [A-Z][A-Za-z'-]{1,20}){0,2})(?=/)"), "home_path"),
    (re.compile(r"/Users/(?P<v>" + _NAME + r")(?=[\s\"':]|$)"), "home_path"),
    (re.compile(r"(?i)[A-Z]:\\{1,2}Users\\{1,2}(?P<v>" + _NAME + r"(?: [A-Za-z'-]{1,20}){0,2})(?=\\|[\s\"':]|$)"), "home_path"),
    (re.compile(r"/home/(?P<v>" + _NAME + r")/" + _HOME_CONTENT), "home_path"),
    (re.compile(r"(?<![\w.-])-(?:home|Users)-(?P<v>[A-Za-z0-9_]{2,32})-(?=[A-Za-z0-9])"), "home_path_name"),
    (re.compile(r"(?m)(?:^|[\s(\[])(?P<v>[a-z_][a-z0-9_.-]{1,31})@(?P<h>[A-Za-z0-9][\w.-]{0,62}):(?:~|/)[^\n$#]{0,200}[$#](?:\s|$)"),
     "shell_prompt"),
    (re.compile(r"(?m)\bwhoami\s*\n(?:[^\n]*\n)?(?P<v>[a-z_][a-z0-9_.-]{1,31})\s*$"), "whoami"),
    (re.compile(r"(?m)(?:^|[\s\"'])(?:USER|LOGNAME|USERNAME)\s*[=:]\s*[\"']?(?P<v>[a-z_][a-z0-9_.-]{1,31})(?=[\"'\s]|$)"),
     "env_user"),
    (re.compile(r"(?m)(?:echo\s+(?:\$HOME|\$\{HOME\}|~)|\bpwd)\s*\n\s*/home/(?P<v>" + _NAME + r")/?\s*$"), "home_echo"),
    (re.compile(r"(?m)(?:^|[\s\"'])HOME\s*[=:]\s*[\"']?/home/(?P<v>" + _NAME + r")(?=[/\"'\s]|$)"), "env_user"),
]
_TRIGGERS = ("pwd", "/Users/", "\\Users\\", "\\\\Users\\\\", "/home/", "-home-", "-Users-", "@", "whoami", "USER", "LOGNAME",
             "HOME")


_TRIGGER_AUTOMATON = ahocorasick_rs.AhoCorasick(list(_TRIGGERS))
#: a literal every match of the pattern of the same place in ``_PATTERNS`` holds (None: none that
#: ``_TRIGGERS`` finds, the pattern runs whenever one of them occurs)
_NEEDED: list[tuple[str, ...] | None] = [("/Users/",), ("/Users/",), None, ("/home/",), ("-home-", "-Users-"), ("@",),
                                         ("whoami",), ("USER", "LOGNAME"), ("/home/",), ("/home/",)]


def user_names(text: str) -> Iterator[tuple[int, int, str, str]]:
    """``(start, end, "USERNAME", detector)`` for account names with evidence: when one of
    ``_TRIGGERS`` occurs (one pass of an automaton), each pattern whose needed literal occurs."""
    present = set(_TRIGGER_AUTOMATON.find_matches_as_strings(text, overlapping=True))
    if not present:
        return
    for (pattern, detector), needed in zip(_PATTERNS, _NEEDED, strict=True):
        if needed is not None and present.isdisjoint(needed):
            continue
        for m in pattern.finditer(text):
            v = m.group("v").rstrip(".")
            if len(v) < 2 or v.lower() in SYSTEM_USERS or v.startswith("<") or re.fullmatch(r"[\d.]+", v):
                continue
            if detector == "shell_prompt" and m.group("h").lower() in ("github.com", "gitlab.com", "bitbucket.org"):
                continue  # git@github.com:org/repo is a remote, not a prompt
            yield m.start("v"), m.start("v") + len(v), "USERNAME", detector


_TRAILERS = (r"Author|Commit|Committer|From|To|Cc|Reply-To|Signed-off-by|Co-authored-by|Co-Authored-By|Reviewed-by|"
             r"Acked-by|Tested-by|Reported-by|Suggested-by|Helped-by|Reviewed-on-behalf-of|Maintainer|Contact")
_PERSON_WORD = r"[A-Z][a-z\u00e0-\u024f'’-]+|[A-Z]\.|[a-z]{1,3}(?= [A-Z])"  # "Ana", "J.", "van", "de"
_PERSON = r"(?:" + _PERSON_WORD + r")(?: (?:" + _PERSON_WORD + r")){1,4}"
_PERSON_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"(?m)^[ \t>]*(?:" + _TRAILERS + r")\s*:\s*\"?(?P<v>[^<>\"\n@:]{2,80}?)\"?\s*<(?P<e>[^<>\s@]+@[^<>\s]+)>"),
     "git_trailer"),
    (re.compile(r"(?P<q>\")(?P<v>[^\"<>\n@]{3,60})\"\s*<(?P<e>[^<>\s@]+@[^<>\s]+)>"), "display_name"),
    (re.compile(r"(?<![\w\"])(?P<v>" + _PERSON + r")\s*<(?P<e>[^<>\s@]+@[^<>\s]+)>"), "display_name"),
    (re.compile(r"git config (?:--global |--local )?user\.name\s+[\"'](?P<v>[^\"'\n]{3,60})[\"']"), "git_config"),
    (re.compile(r"(?m)^\s*name\s*=\s*(?P<v>" + _PERSON + r")\s*$(?=[\s\S]{0,200}^\s*email\s*=)"), "git_config"),
]
_BOTS = re.compile(r"bot\b|\[bot\]|github|gitlab|actions|dependabot|renovate|noreply|no-reply|jenkins|ci\b|system|"
                   r"administrator|root|unknown|anonymous|your name|first last|john doe|jane doe", re.I)


def person_names(text: str) -> Iterator[tuple[int, int, str, str]]:
    """``(start, end, "PERSON", detector)`` for names in structured places."""
    if "<" not in text and "user.name" not in text and "name =" not in text:
        return
    for pattern, detector in _PERSON_PATTERNS:
        for m in pattern.finditer(text):
            v = m.group("v")
            stripped = v.strip().strip("\"'")
            if not stripped or not re.search(r"[A-Za-z]", stripped) or _BOTS.search(stripped):
                continue
            email = m.groupdict().get("e") or ""
            if email and _reserved_email(email):
                continue
            if detector == "git_trailer" and (not re.search(r"[A-Za-z]{2,}", stripped)
                                              or (" " not in stripped and stripped.lower() in COMMON_WORDS)):
                continue  # "Author: Dev <...>": a role, not a name
            s = m.start("v") + (len(v) - len(v.lstrip())) + (1 if v.lstrip()[:1] in "\"'" else 0)
            yield s, s + len(stripped), "PERSON", detector


_RESERVED_DOMAINS = re.compile(r"(?:^|\.)(?:example\.(?:com|net|org)|example|test|invalid|localhost|local)$", re.I)


def _reserved_email(email: str) -> bool:
    return bool(_RESERVED_DOMAINS.search(email.rsplit("@", 1)[-1].rstrip(".>")))


def reserved_domain(domain: str) -> bool:
    """RFC 2606 / 6761 names: ``example.com`` and friends, ``.test``, ``.invalid``, ``.localhost``."""
    return bool(_RESERVED_DOMAINS.search(domain.rstrip(".")))
