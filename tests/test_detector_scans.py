"""The detector's fast scans find exactly what the plain patterns find (anchored e-mail search,
one digit-run pass for IP / card / phone candidates, assignments only around secret words), and
remembering findings per text changes nothing but the time."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st
from trajwh.redaction import engine
from trajwh.redaction.engine import Detector, Redactor
from trajwh.redaction.keyed import _find_assignments, _name_windows

#: the pattern the anchored search stands for (as it was written before it was anchored)
EMAIL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._%+-]*@[A-Za-z0-9][A-Za-z0-9.-]*\.[A-Za-z]{2,}")

_EMAILISH = st.text(alphabet="ab9.-_%+@ x:\n", max_size=60)
_DIGITISH = st.text(alphabet="0123456789 .-()+a\n:\t٣é", max_size=60)  # an Arabic-Indic digit: a digit, not ASCII
_KEYEDISH = st.lists(st.sampled_from(["token", "password", "=", ":", " ", '"', "'", "\\\"", "x9Kq2mZ7pL4w", "--api-key",
                                      "\n", "KEY", "API_KEY", "abc", "&", "?", "{", ",", "session", "pass", "\t",
                                      "=>", ":=", "      ", "\\\\\\\"", "`", "-p", "_"]),
                     max_size=14).map("".join)


@settings(max_examples=400, deadline=None)
@given(_EMAILISH)
def test_email_candidates_equal_the_plain_pattern(text):
    assert list(engine._emails(text)) == [m.span() for m in EMAIL.finditer(text)]


def test_email_candidates_on_hand_made_cases():
    for text in ("a@b.com.x@y.org", "foo@bar@baz.com", "..x@y.co.uk, me+tag@mail.example.com", "@@a@b.cc",
                 "user@host", "x.@y.io"):
        assert list(engine._emails(text)) == [m.span() for m in EMAIL.finditer(text)], text


@settings(max_examples=400, deadline=None)
@given(_DIGITISH)
def test_digit_runs_hold_every_ip_card_and_phone_candidate(text):
    runs = engine._digit_runs(text)
    assert list(engine._digit_run_spans(text)) == [m.span() for m in engine._DIGIT_RUN.finditer(text)]
    for pattern in (engine._IPV4, engine._CARD, engine._PHONE_HINT):
        assert [m.span() for a, b in runs for m in pattern.finditer(text, a, b)] == \
               [m.span() for m in pattern.finditer(text)], pattern.pattern


@settings(max_examples=300, deadline=None)
@given(_KEYEDISH)
def test_keyed_windows_find_what_whole_lines_find(text):
    lines = [m.span() for m in re.finditer(r"[^\n]+", text)]
    whole = {f for a, b in lines for f in _find_assignments(text, a, b)}
    assert {f for a, b in _name_windows(text) for f in _find_assignments(text, a, b)} == whole


def test_keyed_windows_on_hand_made_cases():
    for text in ('{"db": {"password": "Zq8rT4uLm2Vx9"}}', "export GH_TOKEN=Zq8rT4uLm2Vx9Kp", "--api-key  Zq8rT4uLm2Vx9Kp",
                 'cfg = {\\"auth_token\\": \\"Zq8rT4uLm2Vx9Kp\\"}', "GET /cb?code_verifier=Zq8rT4uLm2Vx9Kp&x=1",
                 "x" * 50 + "_secret = 'Zq8rT4uLm2Vx9Kp'"):
        lines = [m.span() for m in re.finditer(r"[^\n]+", text)]
        whole = {f for a, b in lines for f in _find_assignments(text, a, b)}
        assert whole and {f for a, b in _name_windows(text) for f in _find_assignments(text, a, b)} == whole, text


def test_memo_gives_the_same_findings_and_stays_bounded():
    texts = [f"export API_TOKEN=ghp_{'a1B2c3D4e5' * 4}{i % 7} and mail bob{i % 5}@corp-mail.com from 52.1.2.{i % 9}"
             for i in range(300)]
    plain = Detector(memo_chars=0)
    remembered = Detector(memo_chars=2_000)
    for t in texts + texts:
        assert remembered.find(t) == plain.find(t)
        assert remembered._memo_chars <= 2_000
    red = Redactor(b"s", detector=remembered)
    scope = red.scope("e")
    first = red.text(texts[0], scope, "f", [])
    assert "ghp_" not in first and first == red.text(texts[0], scope, "f", [])


def test_memo_returns_copies():
    d = Detector()
    text = "password = 'Zq8!rT4u#Lm2Vx9'" + " " * 30
    got = d.find(text)
    got.clear()
    assert d.find(text)


_USERISH = st.lists(st.sampled_from(["/Users/", "Bob", "/home/", "alice", "/.bashrc", "-home-", "-Users-", "jdoe", "@",
                                     "devbox", ":~/x$ ", "whoami\n", "USER=", "LOGNAME=", "HOME=", "echo $HOME\n",
                                     "C:\\Users\\", "c:\\users\\", " ", "\n", "/", "pwd\n", "'"]), max_size=16).map("".join)


@settings(max_examples=400, deadline=None)
@given(_USERISH)
def test_user_name_patterns_run_only_where_their_literal_is_and_find_the_same(text):
    """Each user-name pattern runs only when a literal every match of it holds occurs: the same
    findings as every pattern run whenever any trigger occurs."""
    from trajwh.redaction import people

    def plain(text):
        if not any(t in text for t in people._TRIGGERS):
            return []
        out = []
        for pattern, detector in people._PATTERNS:
            for m in pattern.finditer(text):
                v = m.group("v").rstrip(".")
                if len(v) < 2 or v.lower() in people.SYSTEM_USERS or v.startswith("<") or re.fullmatch(r"[\d.]+", v):
                    continue
                if detector == "shell_prompt" and m.group("h").lower() in ("github.com", "gitlab.com", "bitbucket.org"):
                    continue
                out.append((m.start("v"), m.start("v") + len(v), "USERNAME", detector))
        return out

    assert list(people.user_names(text)) == plain(text)


def test_every_user_name_pattern_still_finds_its_case():
    from trajwh.redaction import people

    cases = ["open /Users/jdoe/notes.txt", "ls /Users/jdoe", r"C:\Users\jdoe\x", "cat /home/jdoe/.bashrc",
             "file -home-jdoe-proj", "jdoe@devbox:~/x$ ls", "$ whoami\njdoe\n", "USER=jdoe", "echo $HOME\n/home/jdoe\n",
             "HOME=/home/jdoe"]
    found = [{d for *_, d in people.user_names(t)} for t in cases]
    assert found == [{"home_path"}, {"home_path"}, {"home_path"}, {"home_path"}, {"home_path_name"}, {"shell_prompt"},
                     {"whoami"}, {"env_user"}, {"home_echo"}, {"env_user"}], found
