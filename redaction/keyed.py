"""Context-keyed secrets: a value is secret because of the name it is given, in any syntax.

A *secret name* contains a secret word (password, passwd, pwd, pass, secret, token, api key,
access key, auth, credential, private key, client secret, session, cookie, passphrase, signature,
or an env-style ``*_KEY``) and no word that says the value is something else (``max_tokens``,
``token_count``, ``password_file``, ``credential-providers``, ``session_timeout``...).

Syntaxes read (``find_keyed``): ``NAME=value`` (env files, ``export``, INI, TOML, ``.properties``,
kwargs), ``name: value`` (YAML, properties), ``"name": "value"`` (JSON, also escaped and double
escaped inside tool-call arguments), ``name => value``, ``name := value``, CLI flags
(``--password VALUE``, ``--token=VALUE``, ``mysql -pVALUE``, ``curl -u user:VALUE``), URL query
parameters (``?access_token=...&limit=5``: the value ends at ``&``), cookie pairs in ``Cookie`` /
``Set-Cookie`` headers, and the data of a Kubernetes ``Secret``. Under a secret name, hex, UUID
and base64 values are secrets even when no provider shape matches them; what is refused is what a
name cannot make secret: code (``self.password``, ``os.environ[...]``, calls), placeholders and
template references, paths, URLs, booleans, short numbers, version ranges.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import ahocorasick_rs
from trajwh.redaction.detectors import entropy, is_placeholder, merge_spans

#: words that make a name secret (matched inside the name, case-insensitively)
_SECRET_WORDS = re.compile(
    r"passw(?:or)?d|passwd|pwd|passphrase|secret|token|api[_-]?key|apikey|access[_-]?key|auth(?!or|ority|ors)|credential|"
    r"private[_-]?key|signing[_-]?key|encryption[_-]?key|master[_-]?key|session|sessid|cookie|csrf|xsrf|"
    r"(?:^|[_.-])pass$|^pass|connection[_-]?string|(?:app|client|account|service|storage|"
    r"admin|deploy|webhook|license|consumer|shared|hmac|jwt|otp|totp)[_-]?key", re.I)
#: env-style names ending in KEY (``APP_KEY``, ``STRIPE_KEY``) are secret names too
_ENV_KEY = re.compile(r"^[A-Z0-9_]*[A-Z0-9]_?KEY$")
#: a name with one of these words names something that is not the secret itself
_NOT_SECRET = re.compile(
    r"(?:^|[^a-z])(?:count|max|min|len|length|limit|type|types|name|names|url|uri|endpoint|file|files|path|dir|"
    r"expiry|expires|expiration|ttl|timeout|lifetime|age|usage|prompt|completion|completions|total|budget|policy|"
    r"prefix|suffix|header|field|env|var|reset|rotation|required|enabled|enable|disabled|format|regex|pattern|hint|"
    r"placeholder|label|description|provider|providers|manager|helper|kind|mode|scheme|cache|store|id|ids|"
    r"index|size|hash|digest|sha|checksum|integrity|public|publishable|pub|pk|fingerprint|algorithm|alg|"
    r"method|class|module|version|level|strength|policy|encoding|tokenizer|tokenize|tokens|"
    r"in|out|input|output|cached|reasoning|estimate|estimated|budget|window|key_id|keyid|storage|"
    r"length|min_length|location|region|state|status|error|errors|callback|redirect|handler|middleware)(?:[^a-z]|$)",
    re.I)
#: names where "session"/"token"/"auth" are usually about the code, not a credential
_CODE_NAMES = re.compile(r"^(?:auth|session|token|cookie|secret|credential|credentials|signature)s?$", re.I)

_BOOLEANS = {"true", "false", "yes", "no", "on", "off", "null", "none", "nil", "undefined", "required", "optional",
             "string", "str", "int", "bool", "object", "any", "empty", "default", "secret", "password", "token",
             "redacted", "hidden", "masked", "changeme", "notset", "unset", "env", "file", "prompt"}


_DUMMY_WORDS = {"test", "testing", "tests", "dummy", "fake", "sample", "example", "demo", "mock", "placeholder",
                "default", "changeme", "local", "dev", "foo", "bar", "baz", "my", "your", "not", "real", "invalid"}


def secret_name(name: str) -> bool:
    """Does this name say its value is a secret?"""
    bare = name.strip("\"'\\ -$@:").rsplit(".", 1)[-1] if name.count(".") and not name.startswith(".") else name.strip("\"'\\ -$@:")
    if not bare or len(bare) > 64:
        return False
    if not (_SECRET_WORDS.search(bare) or _ENV_KEY.match(bare)):
        return False
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", bare)  # camelCase -> camel_Case, so the word test sees parts
    if re.search(r"example|sample|dummy|fake|placeholder", bare, re.I):
        return False  # EXAMPLE_KEY, sample_token: the name says it is not real
    return not _NOT_SECRET.search(words)


def keyed_value_ok(value: str, *, quoted: bool) -> bool:
    """Could this be the secret value of a secret name? (Code, placeholders, paths, flags refused.)"""
    v = value.strip()
    if len(v) < 6 or len(v) > 4096 or v.lower().rstrip(".,;:!") in _BOOLEANS or is_placeholder(v):
        return False
    if re.search(r"[A-Za-z_]\w+\([\w\s.,=*'\"]*\)", v) and re.search(r"[\s=,]", v):
        return False  # a call with arguments: code, quoted or not
    if v.startswith(("$", "%(", "{{", "<%", "${", "#{", "@", "&", "*", "!!", "/", "./", "~/", "file:", "-")):
        return False
    if re.fullmatch(r"https?://\S+", v) and "@" not in v:
        return False
    if re.fullmatch(r"[~^<>=!]*\s*v?\d+(?:\.\d+)*(?:[-+.][\w.]+)?(?:\s*(?:,|\|\|)?\s*[~^<>=!]*\s*v?\d+(?:\.\d+)*)*", v):
        return False  # versions and version ranges ("^3.948.0", ">=1.2, <2")
    if re.fullmatch(r"\d+", v):
        return len(v) >= 8
    if re.fullmatch(r"(?:sha\d{1,3}|md5|blake2b?)[:-][0-9a-fA-F+/=]{16,}", v, re.I):
        return False  # a content digest names a hash, not a credential
    if not quoted and re.match(r"[A-Za-z_]+[.(\[]", v):
        return False  # value.get(...), self.token, config[...]: code
    if re.fullmatch(r"[\w.]+\(.*\)?|[\w]+(?:\.[A-Za-z_]\w*)+|[\w.]+\[.*\]?|[\w.]+\s*(?:\?|\|\||&&|or|and)\s*.*", v) \
            and not re.search(r"\d", v.split("(")[0]) and not quoted:
        return False  # code: calls, attribute access, indexing, fallbacks
    if not quoted and re.fullmatch(r"[A-Za-z_]+", v):
        return len(v) >= 16 and any(c.isupper() for c in v) and any(c.islower() for c in v) and entropy(v) > 3.5
    if quoted and re.fullmatch(r"[a-z_]+|[A-Z_]+", v) and len(v) < 12:
        return False  # a quoted identifier or word ("password", "DB_PASSWORD")
    if re.fullmatch(r"[A-Za-z]+(?: [A-Za-z]+){2,}", v):
        return False  # prose
    words = re.split(r"[-_.]", v.lower())
    if len(words) > 1 and all(w.isalpha() for w in words) and _DUMMY_WORDS.intersection(words):
        return False  # "test-secret-key", "dummy_password": fixtures, not credentials
    return True


# name, then the separator, then the value; the name may be quoted in one of the JSON escapings
_Q = r"(?:\\\\\\\"|\\\"|\"|')?"  # \\\" (double-escaped), \" (escaped), " or ' (plain), or nothing
_NAME = r"(?P<name>[A-Za-z_$@.][A-Za-z0-9_.\-]{1,63})"
_ASSIGN = re.compile(
    r"(?:^|(?<=[\s{,;(\[?&'\"\\:/]))" + _Q + _NAME + _Q +
    r"(?P<sep>[ \t]*(?:=>|:=|=|:)[ \t]*)"
    r"(?P<open>\\\\\\\"|\\\"|\"|'|`)?",
    re.M)
_FLAG = re.compile(r"(?<![\w-])--?(?P<name>[A-Za-z][A-Za-z0-9-]{1,40})(?:=|[ \t]+)(?P<open>[\"'])?")
_MYSQL = re.compile(r"\b(?:mysql|mysqldump|mariadb|mysqladmin)\b[^\n|;&]*?\s-p(?P<v>[^\s'\"-][^\s'\"]{3,})")
_CURL_USER = re.compile(r"(?:\s-u|--user)[ \t]+[\"']?(?P<u>[^\s:\"']{1,64}):(?P<v>[^\s\"']{4,})")
_COOKIE_LINE = re.compile(r"(?im)^[<> ]*(?:set-)?cookie\s*:\s*(?P<body>[^\r\n]+)")
_COOKIE_ATTRS = {"path", "domain", "expires", "max-age", "samesite", "httponly", "secure", "priority", "partitioned",
                 "version", "comment", "theme", "lang", "locale", "tz", "timezone"}
_K8S_DATA = re.compile(r"(?m)^(?P<indent>[ \t]*)(?:data|stringData)[ \t]*:[ \t]*$")
_CLOSE = {"\\\\\\\"": "\\\\\\\"", "\\\"": "\\\"", "\"": "\"", "'": "'", "`": "`"}


def _value_span(text: str, start: int, opener: str | None, url_query: bool) -> tuple[int, int] | None:
    """Where the value that starts at ``start`` ends: at its closing quote when quoted, else at the
    first whitespace or terminator (``&`` too in a URL query)."""
    if opener:
        close = _CLOSE[opener]
        end = text.find(close, start)
        while end > start and opener in ('"', "'") and text[end - 1] == "\\" and not text[end - 2:end] == "\\\\":
            end = text.find(close, end + 1)  # an escaped quote inside the value
        if end < 0 or "\n" in text[start:end]:
            return None
        return start, end
    stop = re.compile(r"[\s&#\"'<>`]" if url_query else r"[\s\"'`<>;,\\)\]}]")
    m = stop.search(text, start)
    end = m.start() if m else len(text)
    return (start, end) if end > start else None


#: URL query parameters that carry credentials though their names say little
_QUERY_NAMES = {"key", "sig", "signature", "code_verifier", "x-amz-signature", "x-goog-signature", "pwd", "pass"}


#: a secret name holds one of these (lower-cased); names are looked for only around them
_NEEDLES = ("pass", "pwd", "secret", "token", "key", "auth", "credential", "session", "sessid", "cookie", "csrf",
            "xsrf", "sig", "connection", "verifier")
_NEEDLE_AUTOMATON = ahocorasick_rs.AhoCorasick(list(_NEEDLES))
#: the characters a name (or a flag with its dashes) is made of, and what may stand before it
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-$@")
_NAME_RUN_RIGHT = re.compile(r"[A-Za-z0-9_.\-]{0,80}")
#: the longest quote before or after a name (``\\\"``, double-escaped JSON), and before the value
_QUOTE_MAX = 4
_LEFT_MARGIN = _QUOTE_MAX


#: a flag's dashes stand at most this far before a needle in its name (``_FLAG``'s name: 41 characters)
_FLAG_REACH = 44


def _reach(text: str, right: int) -> tuple[int, bool]:
    """Where an assignment (``_ASSIGN``) or flag (``_FLAG``) whose name ends at ``right`` ends at
    the latest: after the name's closing quote, blanks, the separator (``=>``, ``:=``, ``=``, ``:``),
    blanks and the value's opening quote; each part is skipped as far as its characters go (a
    window that ran 200 characters past every name scanned twice the text for the same matches).
    And whether a separator is there (else no assignment can name this name)."""
    n, p = len(text), right
    while p < n and p - right < _QUOTE_MAX and text[p] in "\\\"'":
        p += 1
    while p < n and text[p] in " \t":
        p += 1
    sep = p
    while p < n and p - sep < 2 and text[p] in "=:>":
        p += 1
    assigned = p > sep and text[sep] != ">"
    while p < n and text[p] in " \t":
        p += 1
    return min(n, p + _QUOTE_MAX), assigned


def _name_windows(text: str, lower: str | None = None) -> list[tuple[int, int]]:
    """Small windows around each name that holds a needle (the name, its quotes, separator and
    opening quote: ``_reach``), merged: assignments are matched only there, not along whole lines
    (a secret word in a line is common in code; an assignment to it is not). ``lower``: the text
    lower-cased, when the caller has it."""
    lower = text.lower() if lower is None else lower
    if len(lower) != len(text):  # a character whose lower case is longer ("İ"): offsets would shift
        return [(0, len(text))]
    spans = []
    for _, i, after in _NEEDLE_AUTOMATON.find_matches_as_indexes(lower, overlapping=True):  # overlaps too
        right = _NAME_RUN_RIGHT.match(text, after).end()
        reach, assigned = _reach(text, right)
        if not assigned and "-" not in text[max(0, i - _FLAG_REACH):i]:
            continue  # neither an assignment to this name nor a flag: most needles are words in prose or output
        start, floor = i, max(0, i - 80)
        while start > floor and text[start - 1] in _NAME_CHARS:
            start -= 1
        start = max(0, start - _LEFT_MARGIN)
        line_start = text.rfind("\n", 0, i) + 1
        line_end = text.find("\n", right)
        stop = min(len(text) if line_end < 0 else line_end, reach)
        spans.append((max(start, line_start), stop))
    return merge_spans(spans)


def find_keyed(text: str, lower: str | None = None) -> Iterator[tuple[int, int, str, str]]:
    """``(start, end, entity, detector)`` of context-keyed secret values in ``text`` (``lower``: the
    text lower-cased, when the caller has it)."""
    for start, end in _name_windows(text, lower):
        for s, e, entity, detector in _find_assignments(text, start, end):
            yield s, e, entity, detector
    for pattern, detector, needed in ((_MYSQL, "cli_flag", ("mysql", "mariadb")), (_CURL_USER, "cli_flag", ("-u",))):
        if any(n in text for n in needed):  # every match holds one of these
            for m in pattern.finditer(text):
                if not is_placeholder(m.group("v")):
                    yield m.start("v"), m.end("v"), "PASSWORD", detector
    yield from _cookies(text)
    yield from _k8s_secret_data(text)


def _find_assignments(text: str, start: int, end: int) -> Iterator[tuple[int, int, str, str]]:
    for m in _ASSIGN.finditer(text, start, end):
        name = m.group("name")
        pre = text[m.start() - 1] if m.start() else ""
        sep = m.group("sep").strip()
        if not secret_name(name) and not (pre in ("?", "&") and sep == "=" and name.lower() in _QUERY_NAMES):
            continue
        if sep == ":" and text[m.end("sep"):m.end("sep") + 2] == "//":
            continue  # a URL scheme ("auth://"), not a name
        if sep == ":" and name[0].isdigit():
            continue
        url_query = pre in ("?", "&")
        span = _value_span(text, m.end(), m.group("open"), url_query)
        if not span:
            continue
        s, e = span
        value = text[s:e]
        if m.group("open") is None and _CODE_NAMES.match(name.strip("\"'")) and not url_query and sep != "=":
            if not re.search(r"\d", value) or re.search(r"\($|\.[A-Za-z_]\w*$", value):
                continue  # "session: sess" / "token: getToken(" / "auth: self.auth" in code
        if value.lower().startswith("base64:") and len(value) > 12:
            yield s, e, "SECRET", "keyed"
            continue
        if keyed_value_ok(value, quoted=m.group("open") is not None):
            yield s, e, "SECRET", "keyed_url" if url_query else "keyed"
    for m in _FLAG.finditer(text, start, end):
        if not secret_name(m.group("name").replace("-", "_")):
            continue
        span = _value_span(text, m.end(), m.group("open"), False)
        if span and keyed_value_ok(text[span[0]:span[1]], quoted=m.group("open") is not None):
            yield span[0], span[1], "SECRET", "cli_flag"


def _cookies(text: str) -> Iterator[tuple[int, int, str, str]]:
    if "ookie" not in text and "OOKIE" not in text:
        return
    for m in _COOKIE_LINE.finditer(text):
        body, base = m.group("body"), m.start("body")
        for pair in re.finditer(r"(?:^|;)\s*(?P<n>[^=;\s]+)=(?P<v>[^;\r\n]*)", body):
            name, value = pair.group("n"), pair.group("v").strip()
            if name.lower() in _COOKIE_ATTRS or len(value) < 8 or is_placeholder(value):
                continue
            if secret_name(name) or (len(value) >= 12 and entropy(value) >= 3.0):
                s = base + pair.start("v") + (len(pair.group("v")) - len(pair.group("v").lstrip()))
                yield s, s + len(value), "COOKIE", "cookie"


def _k8s_secret_data(text: str) -> Iterator[tuple[int, int, str, str]]:
    """Every value under ``data:`` / ``stringData:`` of a document that says ``kind: Secret``."""
    if "kind: Secret" not in text and '"kind": "Secret"' not in text:
        return
    for block in _K8S_DATA.finditer(text):
        indent = len(block.group("indent").expandtabs())
        pos = block.end() + 1
        for line in text[pos:].split("\n"):
            m = re.match(r"(?P<ind>[ \t]*)(?P<k>[\w.-]+)\s*:\s*(?P<v>\S+)[ \t]*$", line)
            if line.strip() and len(line) - len(line.lstrip()) <= indent:
                break  # the block ended
            if m:
                v = m.group("v").strip("\"'")
                if len(v) >= 4 and not is_placeholder(v):
                    s = pos + m.start("v") + (1 if m.group("v")[:1] in "\"'" else 0)
                    yield s, s + len(v), "SECRET", "k8s_secret"
            pos += len(line) + 1
