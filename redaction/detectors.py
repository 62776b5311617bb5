"""Secret and personal-data detectors: shapes, structures, validators, and look-alikes to keep.

Each detector is a ``Shape``: an entity type, a compiled pattern whose group ``v`` (or the whole
match) is the sensitive value, and an optional validator. Three families:

- provider credentials by shape (AWS, GitHub, GitLab, Slack, Stripe, OpenAI, Anthropic, Google,
  Hugging Face, npm, PyPI, Twilio, SendGrid, JWT, PEM private keys, ...);
- structures known to carry secrets: ``NAME=value`` / ``name: value`` assignments to secret-like
  names (env dumps, .env, .npmrc, .pypirc, YAML), ``.netrc`` passwords, HTTP auth / cookie /
  API-key headers, passwords in URLs and connection strings, docker ``"auth"`` entries;
- personal data: user names in home-directory paths (here) and emails, phone numbers, IP
  addresses and Luhn-checked card numbers (presidio's recognizers, see ``redaction.pii``).

Look-alikes are not flagged: git SHAs, UUIDs, sha256 and image digests, version strings,
documented example keys and placeholders (``YOUR_API_KEY``, ``xxxx``, ``${VAR}``, ``<token>``).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

#: values documented as examples by providers, and obvious placeholders: never secrets
EXAMPLE_VALUES = frozenset({
    "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "AKIAI44QH8DHBEXAMPLE",
    "je7MtGbClwBF/2Zp9Utk/h3yCo8nvbEXAMPLEKEY",
})
_PLACEHOLDER = re.compile(
    r"^(?:<[^>]*>|\$\{?[A-Za-z_][A-Za-z0-9_]*\}?|%\([a-z_]+\)s|\{\{.*\}\}|[xX*.#]{3,}|"
    r"(?:your|my|insert|enter|replace|example|sample|dummy|fake|placeholder|redacted|changeme|secret|"
    r"password|token|none|null|true|false|undefined|xxx)(?:[-_ ][-_a-z0-9 ]*)?|"
    r"[a-z0-9-]*x{6,}[a-z0-9-]*|.*(?:EXAMPLE|PLACEHOLDER|YOUR_|_HERE|REDACTED).*)$",
    re.I,
)
#: our own placeholders (idempotence: redacting redacted text changes nothing)
PLACEHOLDER_RE = re.compile(r"<[A-Z][A-Z0-9_]*:[0-9a-f]{4,16}:[a-z]+>")


def merge_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Overlapping or touching ``(start, end)`` spans merged, in order."""
    merged: list[tuple[int, int]] = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def entropy(value: str) -> float:
    """Shannon entropy in bits per character."""
    if not value:
        return 0.0
    counts = Counter(value)
    n = len(value)
    return -sum(c / n * math.log2(c / n) for c in counts.values())


def is_lookalike(value: str) -> bool:
    """Hashes, ids and versions that look random but are not secrets."""
    v = value.strip("'\"")
    return bool(
        re.fullmatch(r"[0-9a-f]{7,64}", v)  # git SHAs, sha1/sha256 hex digests
        or re.fullmatch(r"(?:sha256|sha512|sha1|md5):[0-9a-f]{16,128}", v, re.I)  # image / content digests
        or re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", v, re.I)  # UUIDs
        or re.fullmatch(r"v?\d+(?:\.\d+){1,3}(?:[-+.][0-9A-Za-z.]+)?", v)  # versions
        or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", v) and not re.search(r"\d", v) and len(v) < 32  # identifiers
    )


def is_placeholder(value: str) -> bool:
    v = value.strip("'\"")
    return v in EXAMPLE_VALUES or bool(_PLACEHOLDER.match(v)) or bool(PLACEHOLDER_RE.search(v))


def plausible_secret(value: str, min_len: int = 8, min_entropy: float = 2.5) -> bool:
    """A value assigned to a secret-looking name: long enough, random enough, not code, not a
    look-alike. Code is the main source of false alarms in trajectories (``token = value.get(``,
    ``key=self.key``), so brackets, template markers and dotted names are refused."""
    v = value.strip("'\",;")
    if len(v) < min_len or is_placeholder(v) or is_lookalike(v) or is_lookalike(v.rstrip(":.!?")):
        return False
    if any(c in v for c in "()[]{}<>$`") or re.fullmatch(r"[A-Za-z_]+(?:\.[A-Za-z_]+)+\.?", v):
        return False
    if re.fullmatch(r"\d+", v) and len(v) < 12:  # ports, counts, ids
        return False
    if v.startswith(("/", "./", "~/", "http://localhost", "file:")) and len(v.split("/")) > 2:  # paths
        return False
    classes = sum((any(c.islower() for c in v), any(c.isupper() for c in v), any(c.isdigit() for c in v),
                   any(not c.isalnum() for c in v)))
    return classes >= 2 and entropy(v) >= min_entropy


def _not_placeholder(value: str) -> bool:
    return not is_placeholder(value)


def aws_secret(value: str) -> bool:
    return not is_placeholder(value) and not is_lookalike(value) and entropy(value) > 3.5


@dataclass(frozen=True)
class Shape:
    """``triggers``: literal strings that every match contains (searched in the lower-cased text
    when ``fold`` is set); the pattern then runs only on the lines around them. No triggers: the
    pattern runs over the whole text (fine when it starts with a literal)."""

    entity: str
    pattern: re.Pattern[str]
    validate: Callable[[str], bool] | None = None
    detector: str = ""
    triggers: tuple[str, ...] = ()
    fold: bool = False

    def find(self, text: str, base: int = 0):
        for m in self.pattern.finditer(text):
            group = "v" if "v" in self.pattern.groupindex and m.group("v") is not None else 0
            value = m.group(group)
            if not value or (self.validate and not self.validate(value)):
                continue
            yield base + m.start(group), base + m.end(group), self.entity, self.detector or self.entity.lower()


def _s(entity: str, pattern: str, validate: Callable[[str], bool] | None = _not_placeholder,
       flags: int = 0, detector: str = "", triggers: tuple[str, ...] = (), fold: bool = False) -> Shape:
    return Shape(entity, re.compile(pattern, flags), validate, detector, triggers, fold)


_B = r"(?<![A-Za-z0-9_/+-])"  # left boundary for tokens (``KEY=token`` is fine: no '=' here)
_E = r"(?![A-Za-z0-9_/+=-])"  # right boundary

#: provider credentials by shape (prefixes from the providers' documentation)
PROVIDER_SHAPES: list[Shape] = [
    _s("AWS_ACCESS_KEY", _B + r"(?P<v>(?:AKIA|ASIA|ABIA|ACCA|AGPA|AIDA|AIPA|ANPA|ANVA|AROA|APKA|ASCA)[A-Z0-9]{16})" + _E,
       triggers=("AKIA", "ASIA", "ABIA", "ACCA", "AGPA", "AIDA", "AIPA", "ANPA", "ANVA", "AROA", "APKA", "ASCA")),
    _s("AWS_SECRET_KEY", r"(?i)aws.{0,20}?(?:secret|sk).{0,20}?[\"'=:\s]+(?P<v>[A-Za-z0-9/+]{40})" + _E, aws_secret,
       triggers=("aws",), fold=True),
    _s("GITHUB_TOKEN", _B + r"(?P<v>(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{36,255}|github_pat_[A-Za-z0-9_]{22,255})" + _E,
       triggers=("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_")),
    _s("GITLAB_TOKEN", _B + r"(?P<v>glpat-[A-Za-z0-9_-]{20,})" + _E, triggers=("glpat-",)),
    _s("SLACK_TOKEN", _B + r"(?P<v>xox[abposr]-[A-Za-z0-9-]{10,})" + _E, triggers=("xox",)),
    _s("SLACK_WEBHOOK", r"(?P<v>https://hooks\.slack\.com/services/[A-Za-z0-9/_-]{20,})"),
    _s("STRIPE_KEY", _B + r"(?P<v>(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{20,})" + _E,
       triggers=("k_live_", "k_test_")),
    _s("ANTHROPIC_KEY", _B + r"(?P<v>sk-ant-(?:api|admin)\d{2}-[A-Za-z0-9_-]{20,})" + _E, triggers=("sk-ant-",)),
    _s("OPENAI_KEY", _B + r"(?P<v>sk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{20,})" + _E,
       lambda v: not v.startswith("sk-ant-") and _not_placeholder(v) and entropy(v) > 3.0, triggers=("sk-",)),
    _s("GOOGLE_API_KEY", _B + r"(?P<v>AIza[0-9A-Za-z_-]{35})" + _E, triggers=("AIza",)),
    _s("HF_TOKEN", _B + r"(?P<v>hf_[A-Za-z0-9]{30,})" + _E, triggers=("hf_",)),
    _s("NPM_TOKEN", _B + r"(?P<v>npm_[A-Za-z0-9]{36})" + _E, triggers=("npm_",)),
    _s("PYPI_TOKEN", _B + r"(?P<v>pypi-AgE[A-Za-z0-9_-]{50,})" + _E, triggers=("pypi-AgE",)),
    _s("TWILIO_KEY", _B + r"(?P<v>SK[0-9a-f]{32})" + _E, triggers=("SK",)),
    _s("SENDGRID_KEY", _B + r"(?P<v>SG\.[A-Za-z0-9_-]{22}\.[A-Za-z0-9_-]{43})" + _E, triggers=("SG.",)),
    _s("JWT", _B + r"(?P<v>eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,})" + _E,
       triggers=("eyJ",)),
    *[_s(entity, _B + r"(?P<v>" + pattern + r")" + _E, triggers=triggers) for entity, pattern, triggers in (
        # formats as public secret scanners (gitleaks, trufflehog) document them
        ("TELEGRAM_BOT_TOKEN", r"\d{8,10}:AA[0-9A-Za-z_-]{32,33}", (":AA",)),
        ("DISCORD_WEBHOOK", r"https://(?:ptb\.|canary\.)?discord(?:app)?\.com/api/webhooks/\d{5,20}/[\w-]{60,70}", ("discord",)),
        ("MAILGUN_KEY", r"key-[0-9a-f]{32}", ("key-",)),
        ("MAILCHIMP_KEY", r"[0-9a-f]{32}-us\d{1,2}", ("-us",)),
        ("SHOPIFY_TOKEN", r"shp(?:at|ca|pa|ss)_[a-fA-F0-9]{32}", ("shp",)),
        ("SQUARE_TOKEN", r"sq0(?:atp|csp)-[0-9A-Za-z_-]{22,43}|EAAA[A-Za-z0-9_-]{60}", ("sq0", "EAAA")),
        ("DIGITALOCEAN_TOKEN", r"do[opr]_v1_[a-f0-9]{64}", ("_v1_",)),
        ("DATABRICKS_TOKEN", r"dapi[a-f0-9]{32}(?:-\d)?", ("dapi",)),
        ("DOPPLER_TOKEN", r"dp\.(?:pt|st|sa|ct|scim|audit)\.[A-Za-z0-9]{40,44}", ("dp.",)),
        ("LINEAR_KEY", r"lin_(?:api|oauth)_[A-Za-z0-9]{40}", ("lin_",)),
        ("POSTMAN_KEY", r"PMAK-[a-fA-F0-9]{24}-[a-fA-F0-9]{34}", ("PMAK-",)),
        ("PULUMI_TOKEN", r"pul-[a-f0-9]{40}", ("pul-",)),
        ("GRAFANA_TOKEN", r"glsa_[A-Za-z0-9]{32}_[A-Fa-f0-9]{8}|glc_[A-Za-z0-9+/]{32,400}={0,2}", ("glsa_", "glc_")),
        ("NEWRELIC_KEY", r"NR(?:AK|II|JS)-[A-Za-z0-9]{27}|NRAA-[a-f0-9]{27}", ("NRAK-", "NRII-", "NRJS-", "NRAA-")),
        ("VAULT_TOKEN", r"hv[sbr]\.[A-Za-z0-9_-]{24,}", ("hvs.", "hvb.", "hvr.")),
        ("AGE_SECRET_KEY", r"AGE-SECRET-KEY-1[QPZRY9X8GF2TVDW0S3JN54KHCE6MUA7L]{58}", ("AGE-SECRET-KEY-",)),
        ("SUPABASE_TOKEN", r"sb[pa]_[a-f0-9]{40}|sb_secret_[A-Za-z0-9_-]{20,}", ("sbp_", "sba_", "sb_secret_")),
        ("GROQ_KEY", r"gsk_[A-Za-z0-9]{52}", ("gsk_",)),
        ("REPLICATE_TOKEN", r"r8_[A-Za-z0-9]{37}", ("r8_",)),
        ("GOOGLE_OAUTH_SECRET", r"GOCSPX-[A-Za-z0-9_-]{28}", ("GOCSPX-",)),
        ("GOOGLE_OAUTH_TOKEN", r"ya29\.[0-9A-Za-z_-]{20,}", ("ya29.",)),
        ("SLACK_TOKEN", r"xapp-\d-[A-Za-z0-9-]{20,}", ("xapp-",)),
        ("DOCKERHUB_TOKEN", r"dckr_pat_[A-Za-z0-9_-]{27}", ("dckr_pat_",)),
        ("RUBYGEMS_KEY", r"rubygems_[a-f0-9]{48}", ("rubygems_",)),
        ("AIRTABLE_TOKEN", r"pat[A-Za-z0-9]{14}\.[a-f0-9]{64}", ("pat",)),
        ("SENDINBLUE_KEY", r"xkeysib-[a-f0-9]{64}-[A-Za-z0-9]{16}", ("xkeysib-",)),
        ("PLANETSCALE_TOKEN", r"pscale_(?:tkn|pw|oauth)_[A-Za-z0-9_.=-]{32,64}", ("pscale_",)),
        ("ALIBABA_KEY", r"LTAI[A-Za-z0-9]{20}", ("LTAI",)),
        ("AZURE_AD_SECRET", r"[A-Za-z0-9_~.]{3}\dQ~[A-Za-z0-9_~.-]{31,34}", ("Q~",)),
        ("DYNATRACE_TOKEN", r"dt0c01\.[A-Z0-9]{24}\.[A-Z0-9]{64}", ("dt0c01.",)),
        ("NOTION_TOKEN", r"ntn_[A-Za-z0-9]{40,50}|secret_[A-Za-z0-9]{43}", ("ntn_", "secret_")),
        ("SENTRY_TOKEN", r"sntr[ysu]_[A-Za-z0-9+/=_-]{40,}", ("sntr",)),
        ("HEROKU_KEY", r"HRKU-AA[0-9a-zA-Z_-]{58}", ("HRKU-",)),
        ("TERRAFORM_TOKEN", r"[a-zA-Z0-9]{14}\.atlasv1\.[a-zA-Z0-9_=-]{60,70}", (".atlasv1.",)),
        ("CLOJARS_TOKEN", r"CLOJARS_[a-z0-9]{60}", ("CLOJARS_",)),
        ("PERPLEXITY_KEY", r"pplx-[A-Za-z0-9]{48}", ("pplx-",)),
        ("XAI_KEY", r"xai-[A-Za-z0-9]{80}", ("xai-",)),
        ("LANGSMITH_KEY", r"lsv2_(?:pt|sk)_[a-f0-9]{32}_[a-f0-9]{10}", ("lsv2_",)),
        ("GITLAB_TOKEN", r"gl(?:dt|rt|ptt|ft|imt|oas|soat|cbt|ffct|agent)-[A-Za-z0-9_-]{20,}|GR1348941[A-Za-z0-9_-]{20}",
         ("gl", "GR1348941")),
        ("EASYPOST_KEY", r"EZ[AT]K[a-zA-Z0-9]{54}", ("EZAK", "EZTK")),
        ("SHIPPO_TOKEN", r"shippo_(?:live|test)_[a-fA-F0-9]{40}", ("shippo_",)),
        ("DUFFEL_TOKEN", r"duffel_(?:test|live)_[A-Za-z0-9_=-]{43}", ("duffel_",)),
        ("FLUTTERWAVE_KEY", r"FLW(?:PUBK|SECK)_TEST-[a-hA-H0-9]{32}-X", ("FLW",)),
        ("PREFECT_KEY", r"pnu_[a-zA-Z0-9]{36}", ("pnu_",)),
        ("ADAFRUIT_KEY", r"aio_[A-Za-z0-9]{28}", ("aio_",)),
        ("MAPBOX_TOKEN", r"sk\.eyJ[A-Za-z0-9_-]{20,}\.[A-Za-z0-9_-]{20,}", ("sk.eyJ",)),
        ("JFROG_TOKEN", r"AKCp[A-Za-z0-9]{69}|cmVmdGtuOjAxOj[A-Za-z0-9]{40,}", ("AKCp", "cmVmdGtuOjAxOj")),
        ("ATLASSIAN_TOKEN", r"AT(?:ATT|CTT)3[A-Za-z0-9_=-]{186}", ("ATATT3", "ATCTT3")),
        ("FLYIO_TOKEN", r"fm[12][ar]?_[A-Za-z0-9+/]{100,}={0,3}", ("fm1", "fm2")),
        ("TWITCH_TOKEN", r"oauth:[a-z0-9]{30}", ("oauth:",)),
        ("AZURE_STORAGE_KEY", r"(?<=AccountKey=)[A-Za-z0-9+/]{86}==", ("AccountKey=",)),
    )],
    _s("DISCORD_TOKEN", r"(?<![\w.-])(?P<v>[MNO][A-Za-z\d_-]{23,25}\.[\w-]{6}\.[\w-]{27,38})(?![\w.-])",
       lambda v: _not_placeholder(v) and entropy(v) > 3.5,
       triggers=("MT", "Mj", "Mz", "ND", "NT", "Nj", "Nz", "OD", "OT")),  # base64 of a snowflake user id
    _s("PRIVATE_KEY", r"(?P<v>-----BEGIN (?:[A-Z]+ )*PRIVATE KEY( BLOCK)?-----[\s\S]*?-----END (?:[A-Z]+ )*PRIVATE KEY( BLOCK)?-----)"),
]

#: the secret-like word of a name (``DB_PASSWORD``, ``apiKey``, ``_authToken``): the match starts at the word,
#: not at the start of the name, so the regex engine can skip quickly to candidate letters
_SECRET_WORD = (r"(?:passw(?:or)?d|passwd|pwd|secret|token|api[_-]?key|apikey|access[_-]?key|"
                r"auth(?:[_-]?token|[_-]?key)?(?![a-z])|credential|private[_-]?key|client[_-]?secret|session[_-]?id|"
                r"signing[_-]?key|encryption[_-]?key)")
_SECRET_NAME = r"(?:[A-Za-z0-9_.-]*?" + _SECRET_WORD + r"[A-Za-z0-9_.-]*)"

#: structures known to carry secrets (context-keyed values are found by ``redaction.keyed``)
STRUCTURE_SHAPES: list[Shape] = [
    _s("SECRET", r"(?i)<meta[^>]+name=[\"'][^\"']*(?:key|token|secret|auth|csrf)[^\"']*[\"'][^>]*content=[\"'](?P<v>[^\"']{8,})",
       plausible_secret, detector="html_meta", triggers=("<meta",), fold=True),
    _s("SECRET", r"(?i)\b(?:set|export|use|using|changed?|rotated?)\s+(?:the\s+)?" + _SECRET_NAME
       + r"\s+(?:to|as|=|with)\s+[\"'`]?(?P<v>[^\s\"'`,;]{8,})", plausible_secret, detector="prose", fold=True,
       triggers=("pass", "pwd", "secret", "token", "key", "auth", "credential", "session")),
    _s("PASSWORD", r"(?i)\b(?:password|passphrase|passwd|pin)\s+(?:is|was|=|:)\s+[\"'`]?(?P<v>[^\s\"'`,;]{6,})",
       plausible_secret, detector="prose", triggers=("pass", "pin "), fold=True),
    _s("SECRET", r"(?i)\b(?:the\s+)?(?:new\s+)?(?:one|key|token|secret|password)\s+is\s+[\"'`]?(?P<v>[A-Za-z0-9_./+=:~-]{16,})",
       plausible_secret, detector="prose", triggers=("one is", "key is", "token is", "secret is", "password is"), fold=True),
    _s("PASSWORD", r"(?im)^\s*(?:machine\s+\S+\s+)?(?:login\s+\S+\s+)?password\s+(?P<v>\S{4,})", plausible_secret,
       detector="netrc", triggers=("password",), fold=True),
    _s("AUTH_HEADER", r"(?i)\b(?:authorization|proxy-authorization)[\"']?\s*[:=]\s*[\"']?(?:bearer|basic|token|digest)\s+"
       r"(?P<v>[A-Za-z0-9._~+/=-]{8,})", _not_placeholder, detector="http_header", triggers=("authorization",), fold=True),
    _s("BEARER_TOKEN", r"(?i)\bbearer\s+(?P<v>[A-Za-z0-9._~+/-]{16,}=*)", plausible_secret, detector="bearer",
       triggers=("bearer",), fold=True),
    _s("API_KEY_HEADER", r"(?i)\b(?:x-api-key|x-auth-token|api-key|x-access-token)[\"']?\s*[:=]\s*[\"']?(?P<v>[A-Za-z0-9._~+/=-]{8,})",
       _not_placeholder, detector="http_header", triggers=("api-key", "x-auth", "x-access"), fold=True),
    _s("PASSWORD", r"(?i)\b[a-z][a-z0-9+.-]{1,20}://[^\s:/@]{1,64}:(?P<v>[^\s@/]{3,128})@[^\s/]", _not_placeholder,
       detector="url_credentials", triggers=("://",)),
    _s("DOCKER_AUTH", r"\"auth\"\s*:\s*\"(?P<v>[A-Za-z0-9+/]{12,}={0,2})\"", _not_placeholder, detector="docker_config",
       triggers=('"auth"',)),
]

ALL_SHAPES: list[Shape] = PROVIDER_SHAPES + STRUCTURE_SHAPES
