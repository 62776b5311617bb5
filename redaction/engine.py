"""The redactor: find sensitive spans fast, replace them with typed, scoped placeholders.

Fast path (why it beats presidio's analyzer by an order of magnitude on trajectory text):
provider shapes start with literal prefixes, which Python's regex engine finds with a fast
substring search, so they run over the whole text; the expensive, case-insensitive structure
rules and presidio's personal-data recognizers run only on small windows around cheap
triggers (a secret-like word found with ``str.find`` on the lower-cased text, an ``@``, a run
of digits). Base64 blobs and URL-encoded strings are decoded and rescanned; a hit inside marks
the whole blob.

Placeholders look like ``<AWS_ACCESS_KEY:3f9a2c:ep>``: the type, a short id, the scope kind.
The id is an HMAC of (type, value) under a key derived from the warehouse salt and the scope
(an episode by default), so one value keeps one placeholder within its scope, different values
get different ids, and ids cannot be linked across scopes or reversed without the vault.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any
from urllib.parse import quote, unquote

import ahocorasick_rs
import orjson
from trajwh.redaction.detectors import ALL_SHAPES, PLACEHOLDER_RE, PROVIDER_SHAPES, merge_spans
from trajwh.redaction.keyed import find_keyed, keyed_value_ok, secret_name
from trajwh.redaction.people import COMMON_WORDS, person_names, reserved_domain, user_names
from trajwh.redaction.pii import card_issued, keep_ip, person_analyzer, phone_number, public_domain

#: 1.1: a normalized repository remote is kept (grouping identity); 2.0: context-keyed secrets in every
#: syntax, user names only with evidence and in every spelling, person names from structure, private
#: addresses redacted, reserved example domains and documentation ranges kept, issuer-checked cards,
#: national phone formats, more provider shapes
POLICY_VERSION = "2.0.0"
SCOPE_KINDS = {"episode": "ep", "repository": "repo", "dataset": "ds"}

_SHORT = 1024
_NAME_TRIGGER = re.compile(r"\b[A-Z][a-z]{1,20}(?:\s+[A-Z][a-z]{1,20})+\b")
_WORD = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_"
_PII_LEFT = {"IP_ADDRESS": _WORD + ".", "CREDIT_CARD": _WORD + ".-"}
#: cheap shapes that find the candidates of each kind of personal data
#: an address is ``[A-Za-z0-9][A-Za-z0-9._%+-]*@`` + this, found from its ``@`` (``_emails``)
_EMAIL_DOMAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*\.[A-Za-z]{2,}")
_ALNUM = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
_LOCAL_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._%+-")
#: every IPv4, card and phone candidate lies in a run like this (a digit first and last, 7+ long;
#: a ``+`` or ``(`` just before it belongs to it, added in Python: a pattern that starts with \d
#: lets the engine skip ahead fast, an optional first character does not)
_DIGIT_RUN = re.compile(r"\d[\d ().-]{5,}\d")
#: ``_DIGIT_RUN`` over an ASCII text translated by ``_DIGIT_TABLE`` (``_digit_run_spans``)
_DIGIT_TABLE = bytes(0x64 if chr(b) in "0123456789" else 0x73 if chr(b) in " ().-" else 0x20 for b in range(256))
_DIGIT_RUN_MARKS = re.compile(rb"d[ds]{5,}d")
# no look-behind at the start: a pattern that starts with \d lets the engine skip ahead fast;
# the left boundary is checked in Python (``_PII_LEFT``)
_IPV4 = re.compile(r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}(?![\d.]|\.\d)")
_IPV6 = re.compile(r"(?<![\w:.])([0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{0,4}){2,7})(?![\w:.])")
#: every IPv6 candidate holds two colons with at most four hex digits between them (a literal
#: first character: fast to find), and starts where its run of ``[\w:.]`` characters starts
_IPV6_HINT = re.compile(r":[0-9A-Fa-f]{0,4}:")
_WORD_RUN = re.compile(r"[\w:.]*")
_HEX_COLON = frozenset("0123456789abcdefABCDEF:")
_HEX_COLON_RUN = re.compile(r"[0-9A-Fa-f:]*")
_PHONE_HINT = re.compile(r"[+(]?\d[\d ().-]{6,30}\d")  # a cheap superset of the candidates below
_CARD = re.compile(r"\d(?:[ -]?\d){11,39}(?![\d-])")
_PHONE = re.compile(r"(?<![\w.+:/#=%-])(?:(?:\+\d{1,3}[ -]?)?(?:\(\d{1,5}\)[ -]?)?\d{1,5}(?:[ -]\d{1,8}){1,5}"
                    r"|(?:\+\d{1,3}[ .]?)?\d{2}(?:\.\d{2}){3,4}|\(?\d{3}\)?\.\d{3}\.\d{4})(?![\w:/%]|[.-]\d)")
_B64 = re.compile(r"(?<![A-Za-z0-9+/_-])([A-Za-z0-9+/]{24,}={0,2}|[A-Za-z0-9_-]{32,}={0,2})(?![A-Za-z0-9+/=_-])")
#: every blob lies in a run like this (its characters and padding): the blob pattern runs only there
_B64_RUN = re.compile(r"[A-Za-z0-9+/_=-]{24,}")
#: ``_B64_RUN``'s characters as ``a``, every other byte as a blank: an ASCII text's runs are found
#: with ``bytes.find`` on its translation (``_b64_runs``)
_B64_TABLE = bytes(0x61 if chr(b) in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/_=-" else 0x20
                   for b in range(256))
_B64_MIN = b"a" * 24
_PERCENT = re.compile(r"%[0-9A-Fa-f]{2}")
_TOKEN_STOP = re.compile(r"[\s\"'<>]")


def _b64_runs(text: str) -> Iterator[tuple[int, int]]:
    """The spans of ``_B64_RUN``'s matches. An ASCII text (nearly every one) is translated to
    blanks and ``a``s in one C pass and searched with ``bytes.find``, whose skip search passes
    most of the text without a look: 4-6x the regex, which tries every position of every word
    (13 % of detection was this scan)."""
    if not text.isascii():
        for m in _B64_RUN.finditer(text):
            yield m.span()
        return
    marks = text.encode("ascii").translate(_B64_TABLE)
    pos = 0
    while (start := marks.find(_B64_MIN, pos)) >= 0:
        end = marks.find(b" ", start + len(_B64_MIN))
        pos = len(marks) if end < 0 else end
        yield start, pos


def _digit_runs(text: str) -> list[tuple[int, int]]:
    """Where IPv4, card and phone candidates can be: each ``_DIGIT_RUN`` with the ``+`` or ``(``
    just before it, and two characters after it (what the candidates' look-aheads read)."""
    return [(a - 1 if a and text[a - 1] in "+(" else a, b + 2) for a, b in _digit_run_spans(text)]


def _digit_run_spans(text: str) -> Iterator[tuple[int, int]]:
    """``_DIGIT_RUN``'s matches. An ASCII text (whose only digits are 0-9) is translated in one C
    pass to ``d`` (digit), ``s`` (a separator the run may hold) and blanks, where the run pattern
    starts with a literal the engine skips to at once (4x the scan for the category of digits)."""
    if not text.isascii():
        for m in _DIGIT_RUN.finditer(text):
            yield m.span()
        return
    for m in _DIGIT_RUN_MARKS.finditer(text.encode("ascii").translate(_DIGIT_TABLE)):
        yield m.span()


def _ipv6_candidates(text: str):
    """``_IPV6``'s matches in ``text``, found only in the runs of ``[\\w:.]`` characters that hold
    a hint. A match is its whole run (its look-behind and look-ahead refuse any other place), so
    a run with a character other than a hex digit or a colon holds none: the walk back from a hint
    stops at the first such character, and a run found to hold one is skipped (pytest's
    ``tests/x.py::test_y`` is such a run: 10 % of detection went into walking them)."""
    last = 0
    for h in _IPV6_HINT.finditer(text):
        if h.start() < last:
            continue
        start = h.start()
        while start and text[start - 1] in _HEX_COLON:
            start -= 1
        last = _WORD_RUN.match(text, h.start()).end()
        if start and (text[start - 1].isalnum() or text[start - 1] in "_."):  # what \w matches, and .
            continue  # the run goes on before with another character
        if _HEX_COLON_RUN.fullmatch(text, start, last):
            yield from _IPV6.finditer(text, start, last)


def _urlencoded_tokens(text: str):
    """The whitespace- or quote-delimited tokens that hold a percent escape (``start, end, token``)."""
    last = -1
    for m in _PERCENT.finditer(text):
        if m.start() < last:
            continue
        left = max(text.rfind(c, 0, m.start()) for c in " \n\t\r\"'<>") + 1
        stop = _TOKEN_STOP.search(text, m.end())
        right = stop.start() if stop else len(text)
        last = right
        yield left, right, text[left:right]

#: which type wins when spans overlap (more specific first)
_PRIORITY = {"PRIVATE_KEY": 0, **{sh.entity: 1 for sh in PROVIDER_SHAPES if sh.entity != "PRIVATE_KEY"},
             "PASSWORD": 2, "AUTH_HEADER": 3, "API_KEY_HEADER": 3, "BEARER_TOKEN": 3, "DOCKER_AUTH": 3,
             "SESSION_ID": 3, "COOKIE": 4, "SECRET": 4, "EMAIL": 5, "CREDIT_CARD": 5, "PHONE": 6, "IP_ADDRESS": 6,
             "USERNAME": 6, "PERSON": 7}


@dataclass(frozen=True)
class Finding:
    start: int
    end: int
    entity: str
    detector: str
    canonical: str | None = None  # the value this span spells (escaped / encoded recurrences)


@dataclass
class Replacement:
    """One replacement in one field (offsets in the original field text)."""

    field: str
    start: int
    end: int
    entity: str
    detector: str
    placeholder: str


@dataclass
class Scope:
    """Placeholders minted in one scope: the same value always gets the same placeholder."""

    kind: str
    key: bytes
    minted: dict[tuple[str, str], str] = field(default_factory=dict)
    values: dict[str, tuple[str, str]] = field(default_factory=dict)  # placeholder -> (entity, value)
    learned: dict[str, list[Finding]] = field(default_factory=dict)  # findings of the learning pass, by text
    by_value: dict[str, str] = field(default_factory=dict)  # value -> its placeholder

    def placeholder(self, entity: str, value: str) -> str:
        """One value, one placeholder in its scope, whichever detector saw it first."""
        got = self.minted.get((entity, value)) or self.by_value.get(value)
        if got:
            return got
        digest = hmac.new(self.key, f"{entity}\0{value}".encode(), hashlib.sha256).hexdigest()
        for width in (6, 8, 12, 16):  # widen on the (rare) collision inside one scope
            ph = f"<{entity}:{digest[:width]}:{SCOPE_KINDS.get(self.kind, self.kind)}>"
            if ph not in self.values:
                break
        self.minted[(entity, value)] = ph
        self.by_value[value] = ph
        self.values[ph] = (entity, value)
        return ph


def _automaton(triggers: set[str]) -> ahocorasick_rs.AhoCorasick:
    """Aho-Corasick over the shapes' triggers: every trigger in a text in one pass, overlaps included
    (``ahocorasick-rs``: 3.5x pyahocorasick on step texts, 0.14 -> 0.04 s of a detector's 0.93 s)."""
    return ahocorasick_rs.AhoCorasick(sorted(triggers))


_TRIGGERS_CASED = _automaton({t for sh in ALL_SHAPES if not sh.fold for t in sh.triggers})
_TRIGGERS_FOLDED = _automaton({t for sh in ALL_SHAPES if sh.fold for t in sh.triggers})
#: shapes by position: those without triggers always run, the others when one of theirs is present
_ALWAYS = frozenset(i for i, sh in enumerate(ALL_SHAPES) if not sh.triggers)
_SHAPES_OF: dict[str, list[int]] = {}
for _i, _sh in enumerate(ALL_SHAPES):
    for _t in _sh.triggers:
        _SHAPES_OF.setdefault(_t, []).append(_i)


def _windows(lower: str, needles: tuple[str, ...]) -> list[tuple[int, int]]:
    """The lines (at most 2,000 characters either side) around each occurrence of the needles, merged."""
    spans = []
    for needle in needles:
        i = lower.find(needle)
        while i >= 0:
            start = lower.rfind("\n", 0, i) + 1
            end = lower.find("\n", i)
            end = len(lower) if end < 0 else end
            spans.append((max(start, i - 2000), min(end, i + 2000)))
            i = lower.find(needle, i + len(needle))
    return merge_spans(spans)


#: texts whose findings a detector remembers (characters of text held as keys, in two generations:
#: when the newer one is full it becomes the older, so the texts that keep coming back survive).
#: Trajectories repeat themselves (a harness's system prompt in every episode, the task statement and
#: the files read in every attempt of a task), and detection is a function of the text alone.
#: Measured on the synthetic corpus at 20,000 episodes (303 M characters, 26 % distinct): share of
#: the characters still scanned with 16 M / 32 M / 64 M characters remembered: 0.41 / 0.35 / 0.30
#: (clearing when full instead: 0.46 / 0.39 / 0.32). 64 M characters cost about 100 MB per process:
#: the size at the default memory budget, scaled to a build's (``default_memo_chars``).
MEMO_CHARS = 64_000_000


def default_memo_chars() -> int:
    """``MEMO_CHARS`` scaled to the build's memory budget (``lineage.parallel.scaled_mb``)."""
    from trajwh.lineage.parallel import scaled_mb

    return scaled_mb(MEMO_CHARS // 1_000_000, floor=4) * 1_000_000
_MEMO_ENTRY = 100  # what an entry costs beyond its text (dict slot, tuple), counted as characters


class Detector:
    """Finds sensitive spans in text; the result is a sorted list of non-overlapping findings."""

    def __init__(self, *, personal_data: bool = True, decode: bool = True, redact_private_ips: bool = True,
                 memo_chars: int | None = None):
        """``memo_chars``: the characters of texts whose findings are remembered (default
        ``default_memo_chars()``, 0 turns the memo off)."""
        memo_chars = default_memo_chars() if memo_chars is None else memo_chars
        self._memo: dict[str, tuple[Finding, ...]] = {}
        self._older: dict[str, tuple[Finding, ...]] = {}  # the previous generation, kept until the next turn
        self._memo_chars, self._memo_budget = 0, memo_chars
        self.memo_misses = 0
        self.personal_data = personal_data
        self.decode = decode
        self.redact_private = redact_private_ips
        if personal_data:
            public_domain("example.org")  # load the public-suffix list now, not in the first text
        self.persons = person_analyzer() if personal_data else None

    def find(self, text: str, depth: int = 0) -> list[Finding]:
        if not text:
            return []
        if depth or len(text) > self._memo_budget // 4:
            return self._find(text, depth)
        hit = self._memo.get(text)
        if hit is None:
            hit = self._older.get(text)
            if hit is None:
                self.memo_misses += 1
                hit = tuple(self._find(text, depth))
            cost = len(text) + _MEMO_ENTRY
            if self._memo_chars + cost > self._memo_budget // 2:  # two generations: the hot texts survive
                self._older, self._memo, self._memo_chars = self._memo, {}, 0
            self._memo[text] = hit
            self._memo_chars += cost
        return list(hit)

    def _find(self, text: str, depth: int) -> list[Finding]:
        found: list[Finding] = []
        lower = text.lower()
        # which triggers occur at all: one pass of a combined pattern per case mode, not one test per shape
        present = (set(_TRIGGERS_CASED.find_matches_as_strings(text, overlapping=True))
                   | set(_TRIGGERS_FOLDED.find_matches_as_strings(lower, overlapping=True)))
        windows: dict[tuple[tuple[str, ...], bool], list[tuple[int, int]]] = {}
        short = len(text) <= _SHORT
        wanted = set(_ALWAYS)
        for t in present:
            wanted.update(_SHAPES_OF.get(t, ()))
        for i in sorted(wanted):  # in ALL_SHAPES order, only the shapes whose triggers occur
            shape = ALL_SHAPES[i]
            if not shape.triggers:
                found += [Finding(*f) for f in shape.find(text)]
                continue
            if short:  # a short text: the pattern on all of it
                found += [Finding(*f) for f in shape.find(text)]
                continue
            key = (shape.triggers, shape.fold)
            if key not in windows:
                windows[key] = _windows(lower if shape.fold else text, shape.triggers)
            for start, end in windows[key]:
                found += [Finding(*f) for f in shape.find(text[start:end], start)]
        found += [Finding(*f) for f in find_keyed(text, lower)]
        if self.personal_data:
            found += [Finding(*f) for f in user_names(text)]
            found += [Finding(*f) for f in person_names(text)]
            found += self._personal(text, found)
            if self.persons is not None:
                found += self._person_names(text)
        if self.decode and depth == 0:
            found += self._decoded(text)
        return _resolve(found, text)

    def _personal(self, text: str, already: list[Finding]) -> list[Finding]:
        """E-mail addresses (presidio's recognizer confirms the candidate; the span is the
        address itself), IP addresses (``pii.keep_ip``), issuer-checked card numbers and
        telephone numbers (libphonenumber), each only where no shape has claimed the text."""
        out: list[Finding] = []

        def free(s: int, e: int) -> bool:
            return not any(f.start <= s and e <= f.end for f in already)

        for s, e in _emails(text):
            domain = text[s:e].rsplit("@", 1)[1]
            if (s and text[s - 1] in _WORD + ".") or not free(s, e) or reserved_domain(domain):
                continue
            if text[e:e + 1] == ":" and not text[e + 1:e + 2].isspace():
                continue  # git@github.com:org/repo.git is a remote (scp-like), not an address
            if public_domain(domain):
                out.append(Finding(s, e, "EMAIL", "email"))
        runs = _digit_runs(text)
        for m in (m for a, b in runs for m in _IPV4.finditer(text, a, b)):
            s, e = m.start(), m.end()
            if (s and text[s - 1] in _PII_LEFT["IP_ADDRESS"]) or not free(s, e):
                continue
            if not keep_ip(m.group(0), text[max(0, s - 12):s], text[e:e + 6], redact_private=self.redact_private):
                out.append(Finding(s, e, "IP_ADDRESS", "ip"))
        if "::" in text or text.count(":") >= 5:
            for m in _ipv6_candidates(text):
                value = m.group(1)
                if value.count(":") < 2 or not re.search(r"\d", value) or not free(m.start(1), m.end(1)):
                    continue
                if not keep_ip(value, "", "", redact_private=self.redact_private):
                    out.append(Finding(m.start(1), m.end(1), "IP_ADDRESS", "ip"))
        for m in (m for a, b in runs for m in _CARD.finditer(text, a, b)):
            glued = m.start() and text[m.start() - 1] in _PII_LEFT["CREDIT_CARD"]
            best = _card_in(m.group(0), skip_first=bool(glued))
            if best is not None:
                s, e = m.start() + best[0], m.start() + best[1]
                if free(s, e):
                    out.append(Finding(s, e, "CREDIT_CARD", "card"))
        hints = (h for a, b in runs for h in _PHONE_HINT.finditer(text, a, b))
        for m in (m for h in hints for m in _PHONE.finditer(text, h.start(), h.end())):
            value, s, e = m.group(0), m.start(), m.end()
            if not free(s, e) or not _phone_context(text, s, e) or not phone_number(value):
                continue
            out.append(Finding(s, e, "PHONE", "phonenumbers"))
        return out

    def _person_names(self, text: str) -> list[Finding]:
        """Person names by NER (when a model is installed), only around capitalized word pairs."""
        out = []
        for m in _NAME_TRIGGER.finditer(text):
            start, end = max(0, m.start() - 60), min(len(text), m.end() + 60)
            for r in self.persons.analyze(text[start:end], entities=["PERSON"], language="en"):
                if r.score >= 0.5:
                    out.append(Finding(start + r.start, start + r.end, "PERSON", "presidio:spacy-ner"))
        return out

    def _decoded(self, text: str) -> list[Finding]:
        """Secrets hidden in base64 or URL encoding: decode, rescan, mark the encoded blob."""
        out = []
        for m in (m for a, b in _b64_runs(text) for m in _B64.finditer(text, a, b)):
            blob = m.group(1)
            try:
                raw = base64.b64decode(blob + "=" * (-len(blob) % 4), altchars=b"-_" if "-" in blob or "_" in blob else None)
                inner = raw.decode("utf-8")
            except (binascii.Error, UnicodeDecodeError, ValueError):
                continue
            if not inner.isprintable() and not all(c.isprintable() or c in "\n\r\t" for c in inner):
                continue
            hits = self.find(inner, depth=1)
            if hits:
                out.append(Finding(m.start(1), m.end(1), hits[0].entity, f"base64>{hits[0].detector}"))
        if "%" in text:
            for start, _, blob in _urlencoded_tokens(text):
                decoded = unquote(blob)
                if decoded != blob:
                    for h in self.find(decoded, depth=1):  # the encoded spelling of the hit, else the blob
                        value = decoded[h.start:h.end]
                        for spelled in (quote(value, safe=""), quote(value, safe="/:@"), value):
                            i = blob.find(spelled)
                            if i >= 0:
                                out.append(Finding(start + i, start + i + len(spelled), h.entity,
                                                   f"urlencoded>{h.detector}", value))
                                break
                        else:
                            out.append(Finding(start, start + len(blob), h.entity, f"urlencoded>{h.detector}"))
        return out


def _emails(text: str):
    """E-mail candidates (``start, end``), found from each ``@`` instead of tried at every letter:
    the local part is the run of its characters before the ``@`` (not reaching into the previous
    address), from its first letter or digit; the domain is matched after it."""
    at, prev_end = text.find("@"), 0
    while at >= 0:
        start = at
        while start > prev_end and text[start - 1] in _LOCAL_CHARS:
            start -= 1
        while start < at and text[start] not in _ALNUM:
            start += 1
        m = _EMAIL_DOMAIN.match(text, at + 1) if start < at else None
        if m:
            yield start, m.end()
            prev_end = m.end()
            at = text.find("@", prev_end)
        else:
            at = text.find("@", at + 1)


def _card_in(run: str, skip_first: bool = False) -> tuple[int, int] | None:
    """The longest run of whole digit groups inside ``run`` that is a Luhn-valid card number
    (a run of digits can join a card to a neighbouring number: "44 4111 1111 1111 1111"; a first
    group glued to a word before it is not part of a card)."""
    groups = [(m.start(), m.end()) for m in re.finditer(r"\d+", run)][1 if skip_first else 0:]
    best = None
    for i in range(len(groups)):
        for j in range(len(groups) - 1, i - 1, -1):
            s, e = groups[i][0], groups[j][1]
            digits = re.sub(r"\D", "", run[s:e])
            if (best is None or e - s > best[1] - best[0]) and _luhn(run[s:e]) and card_issued(digits, run[s:e]):
                best = (s, e)
                break
    return best


def _luhn(candidate: str) -> bool:
    digits = [int(c) for c in candidate if c.isdigit()]
    total = 0
    for i, d in enumerate(reversed(digits)):
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return 13 <= len(digits) <= 19 and total % 10 == 0


def _phone_context(text: str, s: int, e: int) -> bool:
    """A number written like a phone number, not a date, a version or a column of a table
    (``ps``, ``ls -l``, ``df`` rows: many numbers on one line, none of them marked ``+`` or ``(``)."""
    value = text[s:e]
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}.*|\d{1,2}[./-]\d{1,2}[./-]\d{2,4}|\d{5}-\d{4}", value):
        return False  # dates, US ZIP+4 codes (the GPL's "Boston, MA 02110-1301")
    if "." in value and not (re.fullmatch(r"(?:\+\d{1,3}[ .]?)?\d{2}(?:\.\d{2}){3,4}", value)
                             or re.fullmatch(r"\(?\d{3}\)?\.\d{3}\.\d{4}", value)):
        return False  # dotted: only the French (06.12.34.56.78) and North American (415.555.2671) ways
    if value[0] in "+(":
        return True
    line_start, line_end = text.rfind("\n", 0, s) + 1, text.find("\n", e)
    line = text[line_start:s] + " " + text[e:line_end if line_end >= 0 else len(text)]
    return len(re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])", line)) < 8


_NAMES = ("USERNAME", "PERSON")


@lru_cache(maxsize=65_536)
def _spellings(value: str) -> frozenset[str]:
    """How a value recurs in other encodings: JSON-escaped (once and twice), URL-encoded (asked once
    per value and text: remembered)."""
    out = {value}
    escaped = orjson.dumps(value).decode()[1:-1]
    out.add(escaped)
    out.add(orjson.dumps(escaped).decode()[1:-1])
    out.add(quote(value, safe=""))
    out.add(quote(value, safe="/"))
    return frozenset(v for v in out if v)


def _known_values(text: str, scope: Scope) -> list[Finding]:
    """Occurrences of the scope's known values in ``text``, in every spelling: secrets of 6+
    characters wherever they recur (shorter ones than 10 only as a whole token); user and person
    names as whole words (a boundary may be a percent escape: ``%2Fhome%2Fjdoe``), common words
    among them only in the path and prompt spellings that identified them."""
    out = []
    for (entity, value), _ in scope.minted.items():
        if entity in _NAMES:
            out += _name_recurrences(text, entity, value)
            continue
        if len(value) < 6:
            continue
        for spelled in _spellings(value):
            if spelled not in text:
                continue
            i = text.find(spelled)
            while i >= 0:
                j = i + len(spelled)
                if len(value) >= 10 or ((not i or not text[i - 1].isalnum()) and (j >= len(text) or not text[j].isalnum())):
                    out.append(Finding(i, j, entity, "repeat", value))
                i = text.find(spelled, j)
    return out


def _name_recurrences(text: str, entity: str, value: str) -> list[Finding]:
    if len(value) < 3:
        return []
    out = []
    common = value.lower() in COMMON_WORDS
    for spelled in _spellings(value):
        if spelled not in text:
            continue
        if common:
            pattern = r"(?:(?<=/home/)|(?<=/Users/)|(?<=\\Users\\)|(?<=-home-)|(?<=-Users-)|(?<=%2Fhome%2F))" \
                      + re.escape(spelled) + r"(?![A-Za-z0-9])|(?<![\w@])" + re.escape(spelled) + r"(?=@[\w.-]+:[~/])"
        else:
            pattern = r"(?:(?<![A-Za-z0-9])|(?<=%[0-9A-Fa-f]{2}))" + re.escape(spelled) + r"(?![A-Za-z0-9])"
        out += [Finding(m.start(), m.end(), entity, "repeat", value) for m in re.finditer(pattern, text)]
    return out


def _resolve(found: list[Finding], text: str) -> list[Finding]:
    """Drop findings inside our own placeholders; keep one finding per overlapping group."""
    if not found:
        return []
    protected = [(m.start(), m.end()) for m in PLACEHOLDER_RE.finditer(text)]
    found = [f for f in found if f.end > f.start and not any(ps <= f.start < pe or ps < f.end <= pe for ps, pe in protected)]
    # within each group of overlapping findings the most specific one wins, with its own span:
    # a GitHub token inside a URL stays a GitHub token, the host around it is not swallowed
    rank = sorted(found, key=lambda f: (_PRIORITY.get(f.entity, 9), -(f.end - f.start), f.start))
    chosen: list[Finding] = []
    for f in rank:
        if not any(f.start < c.end and c.start < f.end for c in chosen):
            chosen.append(f)
    return sorted(chosen, key=lambda f: f.start)


class Redactor:
    """Redacts text and JSON with one ``Detector``; placeholders come from the given ``Scope``."""

    def __init__(self, salt: bytes, *, scope_kind: str = "episode", detector: Detector | None = None):
        if scope_kind not in SCOPE_KINDS:
            raise ValueError(f"scope must be one of {', '.join(SCOPE_KINDS)}")
        self.salt = salt
        self.scope_kind = scope_kind
        self.detector = detector or Detector()

    def scope(self, scope_id: str) -> Scope:
        key = hmac.new(self.salt, f"{self.scope_kind}\0{scope_id}".encode(), hashlib.sha256).digest()
        return Scope(self.scope_kind, key)

    def text(self, value: str | None, scope: Scope, field_name: str, events: list[Replacement]) -> str | None:
        """Redact one text. Values already seen in this scope are replaced wherever they recur,
        even without the context that gave them away the first time."""
        if not value:
            return value
        findings = scope.learned.pop(value, None)  # detected once already in the learning pass
        if findings is None:
            findings = self.detector.find(value)
        for f in findings:  # register first, so a value repeated later in this text is caught too
            scope.placeholder(f.entity, f.canonical or value[f.start:f.end])
        findings = _resolve(findings + _known_values(value, scope), value)
        if not findings:
            return value
        parts, pos = [], 0
        for f in findings:
            ph = scope.placeholder(f.entity, f.canonical or value[f.start:f.end])
            parts += [value[pos:f.start], ph]
            events.append(Replacement(field_name, f.start, f.end, f.entity, f.detector, ph))
            pos = f.end
        parts.append(value[pos:])
        return "".join(parts)

    def learn(self, value: str | None, scope: Scope) -> None:
        """Detect without replacing: register the values in the scope (first pass of an episode)."""
        if value:
            findings = self.detector.find(value)
            scope.learned[value] = findings
            for f in findings:
                scope.placeholder(f.entity, f.canonical or value[f.start:f.end])

    def json_text(self, value: str | None, scope: Scope, field_name: str, events: list[Replacement]) -> str | None:
        """Redact the string leaves of a JSON document; the result is still valid JSON."""
        if not value:
            return value
        try:
            doc = orjson.loads(value)
        except orjson.JSONDecodeError:
            return self.text(value, scope, field_name, events)
        before = len(events)
        red = self._walk(doc, scope, field_name, "$", events)
        if len(events) == before:
            return value
        return orjson.dumps(red, option=orjson.OPT_SORT_KEYS if isinstance(red, dict) else 0).decode()

    def _walk(self, node: Any, scope: Scope, field_name: str, path: str, events: list[Replacement]) -> Any:
        if isinstance(node, str):
            return self.text(node, scope, f"{field_name}{path[1:]}" if path != "$" else field_name, events)
        if isinstance(node, list):
            return [self._walk(v, scope, field_name, f"{path}[{i}]", events) for i, v in enumerate(node)]
        if isinstance(node, dict):
            return {k: self._keyed(k, v, scope, field_name, f"{path}.{k}", events) for k, v in node.items()}
        return node

    def _keyed(self, key: str, node: Any, scope: Scope, field_name: str, path: str, events: list[Replacement]) -> Any:
        """A JSON string under a secret name is a secret whatever it looks like (``redaction.keyed``)."""
        if isinstance(node, str) and secret_name(key) and keyed_value_ok(node, quoted=True) \
                and not PLACEHOLDER_RE.fullmatch(node):
            ph = scope.placeholder("SECRET", node)  # a value seen before keeps its placeholder and type
            events.append(Replacement(f"{field_name}{path[1:]}", 0, len(node), scope.values[ph][0], "json_key", ph))
            return ph
        return self._walk(node, scope, field_name, path, events)
