"""A labelled evaluation set for the redactor: trajectory-like texts with planted secrets and decoys.

Each case is ``{"id", "text", "secrets": [{"type", "value"}], "decoys": [...]}``. Contexts mimic
what agents see: shell sessions (env dumps, curl, git remotes), tracebacks, tool-call JSON,
config files (.env, .npmrc, .pypirc, .netrc, docker config.json, Kubernetes Secrets, connection
strings), HTML, and chat that repeats a secret in prose. Every secret type appears in several
contexts; decoys (SHAs, UUIDs, digests, versions, example keys, placeholders, local addresses,
timestamps) surround them. Deterministic by seed.
"""

from __future__ import annotations

import base64
import json
import random
import string
from collections.abc import Callable
from urllib.parse import quote

from trajwh.synth.world import _jwt, _luhn_complete, alnum, hexstr

A = string.ascii_letters + string.digits
UP = string.ascii_uppercase + string.digits


def _makers(r: random.Random) -> dict[str, Callable[[], str]]:
    return {
        "AWS_ACCESS_KEY": lambda: "AKIA" + alnum(r, 16, UP),
        "AWS_SECRET_KEY": lambda: alnum(r, 40, A + "/+"),
        "GITHUB_TOKEN": lambda: r.choice(["ghp_", "gho_", "ghs_"]) + alnum(r, 36),
        "GITLAB_TOKEN": lambda: "glpat-" + alnum(r, 20, A + "_-"),
        "SLACK_TOKEN": lambda: f"xoxb-{r.randint(10**10, 10**11)}-{r.randint(10**10, 10**11)}-{alnum(r, 24)}",
        "STRIPE_KEY": lambda: r.choice(["sk_live_", "rk_live_"]) + alnum(r, 24),
        "OPENAI_KEY": lambda: "sk-proj-" + alnum(r, 48, A + "_-"),
        "ANTHROPIC_KEY": lambda: "sk-ant-api03-" + alnum(r, 90, A + "_-"),
        "GOOGLE_API_KEY": lambda: "AIza" + alnum(r, 35, A + "_-"),
        "HF_TOKEN": lambda: "hf_" + alnum(r, 34),
        "NPM_TOKEN": lambda: "npm_" + alnum(r, 36),
        "PYPI_TOKEN": lambda: "pypi-AgEIcHlwaS5vcmc" + alnum(r, 60, A + "_-"),
        "TWILIO_KEY": lambda: "SK" + hexstr(r, 32),
        "SENDGRID_KEY": lambda: f"SG.{alnum(r, 22, A + '_-')}.{alnum(r, 43, A + '_-')}",
        "JWT": lambda: _jwt(r),
        "PRIVATE_KEY": lambda: "-----BEGIN OPENSSH PRIVATE KEY-----\n" + "\n".join(
            alnum(r, 70, A + "+/") for _ in range(5)) + "\n-----END OPENSSH PRIVATE KEY-----",
        "PASSWORD": lambda: alnum(r, 10) + r.choice("!#%^*") + alnum(r, 4),
        "BEARER_TOKEN": lambda: alnum(r, 40, A + "-._"),
        "BASIC_AUTH": lambda: base64.b64encode(f"svc:{alnum(r, 14)}".encode()).decode(),
        "COOKIE": lambda: alnum(r, 32, A),
        "SECRET": lambda: alnum(r, 32, A + "+/"),
        "EMAIL": lambda: f"{r.choice(['ana', 'li.wei', 'omar', 'j.doe', 'kofi'])}{r.randint(1, 99)}@{r.choice(['corp-mail.com', 'uni.edu', 'mailbox.org', 'posteo.de'])}",
        "PHONE": lambda: r.choice([f"+1 ({r.randint(201, 989)}) {r.randint(200, 999)}-{r.randint(1000, 9999)}",
                                   f"+44 20 {r.randint(7000, 8999)} {r.randint(1000, 9999)}",
                                   f"+49 30 {r.randint(10000000, 99999999)}"]),
        "IP_ADDRESS": lambda: f"{r.choice([34, 52, 104, 185, 81])}.{r.randint(1, 254)}.{r.randint(1, 254)}.{r.randint(1, 254)}",
        "CREDIT_CARD": lambda: _luhn_complete(r, r.choice(["4", "51", "55"]), 16),
        "USERNAME": lambda: r.choice(["mgarcia", "tkowalski", "aiyer", "schen", "jbrown", "nokafor"]) + str(r.randint(1, 9)),
    }


DECOYS = [
    "AKIAIOSFODNN7EXAMPLE", "YOUR_API_KEY", "sk-xxxxxxxxxxxxxxxxxxxxxxxx", "<your-token-here>", "${GITHUB_TOKEN}",
    "550e8400-e29b-41d4-a716-446655440000", "v2.31.0", "1.26.18", "127.0.0.1", "0.0.0.0", "192.0.2.20",
    "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "d2c0b4a7e1f64a8b9c3d5e7f9a1b3c5d7e9f1a3b", "2024-03-04 10:22:31", "changeme",
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855", "/home/runner/work", "3.11.7",
]


def _context(r: random.Random, kind: str, value: str, decoy: str) -> str:
    """One text that carries ``value`` of type ``kind`` in a realistic place."""
    sha = hexstr(r, 40)
    env_name = {"AWS_ACCESS_KEY": "AWS_ACCESS_KEY_ID", "AWS_SECRET_KEY": "AWS_SECRET_ACCESS_KEY",
                "GITHUB_TOKEN": "GH_TOKEN", "GITLAB_TOKEN": "GITLAB_TOKEN", "SLACK_TOKEN": "SLACK_BOT_TOKEN",
                "STRIPE_KEY": "STRIPE_API_KEY", "OPENAI_KEY": "OPENAI_API_KEY", "ANTHROPIC_KEY": "ANTHROPIC_API_KEY",
                "GOOGLE_API_KEY": "GOOGLE_API_KEY", "HF_TOKEN": "HF_TOKEN", "NPM_TOKEN": "NPM_TOKEN",
                "PYPI_TOKEN": "TWINE_PASSWORD", "TWILIO_KEY": "TWILIO_API_KEY", "SENDGRID_KEY": "SENDGRID_API_KEY",
                "SECRET": "APP_SECRET", "PASSWORD": "DB_PASSWORD", "JWT": "SESSION_TOKEN"}.get(kind, "VALUE")
    if kind in ("EMAIL",):
        return r.choice([
            f"commit {sha}\nAuthor: Dev <{value}>\nDate:   Tue Mar 4 10:00:00 2025 +0000\n\n    Fix parser ({decoy})",
            f"<p>Contact <a href=\"mailto:{value}\">{value}</a> — build {decoy}</p>",
            f"User: can you email the report to {value}? Version {decoy}.",
        ])
    if kind == "PHONE":
        return r.choice([f"MAINTAINERS\n  on-call: {value} (pager)\n  release: {decoy}",
                         f"Assistant: I found a support line in the README: call {value}. Build id {decoy}."])
    if kind == "IP_ADDRESS":
        return r.choice([f"$ curl -s http://{value}:9200/_cluster/health\n{{\"status\":\"green\"}}  # local {decoy}",
                         f"sshd[812]: Accepted publickey for deploy from {value} port 52144 ssh2 ({decoy})",
                         f"ERROR connecting to {value}:5432 (timeout after 30s); fallback {decoy}"])
    if kind == "CREDIT_CARD":
        return r.choice([f'{{"order": 1182, "card_number": "{value}", "currency": "EUR", "trace": "{decoy}"}}',
                         f"<input name=\"cc\" value=\"{value[:4]} {value[4:8]} {value[8:12]} {value[12:]}\"> {decoy}"]
                        ).replace(f"{value[:4]} {value[4:8]} {value[8:12]} {value[12:]}", value)
    if kind == "USERNAME":
        return r.choice([
            f"Traceback (most recent call last):\n  File \"/home/{value}/projects/app/main.py\", line 12, in <module>\n"
            f"    main()\nValueError: bad input ({decoy})",
            f"$ ls /Users/{value}/Projects\napp  notes.md  {decoy}",
            f"PS C:\\Users\\{value}\\repo> pytest -q\n3 passed in 0.41s ({decoy})",
        ])
    if kind == "PRIVATE_KEY":
        return f"$ cat deploy/id_ed25519\n{value}\n$ git log -1 --format=%H\n{sha} ({decoy})"
    if kind == "BASIC_AUTH":
        return r.choice([f"> GET /api/v1/items HTTP/1.1\n> Host: api.internal\n> Authorization: Basic {value}\n> Accept: */*\n({decoy})",
                         f'{{"auths": {{"registry.example.com": {{"auth": "{value}"}}}}, "note": "{decoy}"}}'])
    if kind == "BEARER_TOKEN":
        return r.choice([f"curl -H 'Authorization: Bearer {value}' https://api.example.com/v2/runs  # {decoy}",
                         f'{{"name": "http_get", "arguments": {{"url": "https://api.example.com", "headers": {{"Authorization": "Bearer {value}"}}}}}} {decoy}'])
    if kind == "COOKIE":
        return r.choice([f"< HTTP/1.1 200 OK\n< Set-Cookie: sessionid={value}; Path=/; HttpOnly\n< X-Request-Id: {decoy}",
                         f"GET /dashboard\nCookie: csrftoken=abc; sessionid={value}\n({decoy})"])
    if kind == "PASSWORD":
        return r.choice([
            f"DATABASE_URL=postgres://app:{value}@db.internal:5432/prod  # {decoy}",
            f"$ git clone https://deploy:{value}@git.example.com/team/repo.git\nCloning into 'repo'... ({decoy})",
            f"machine api.example.com\n  login deploy\n  password {value}\n# {decoy}",
            f"[pypi]\nusername = __token__\npassword = {value}\n# {decoy}",
            f"apiVersion: v1\nkind: Secret\nmetadata:\n  name: db\ndata:\n  password: {base64.b64encode(value.encode()).decode()}\n# {decoy}",
            f"User: my password is {value}, please log in. Ref {decoy}",
        ])
    # provider keys, JWTs and generic high-entropy secrets
    forms = [
        f"$ env | sort\nHOME=/root\n{env_name}={value}\nLANG=C.UTF-8\nVERSION={decoy}",
        f'{{"tool": "bash", "arguments": {{"command": "export {env_name}=\\"{value}\\" && python deploy.py"}}}} # {decoy}',
        f"# .env\n{env_name}='{value}'\nDEBUG=true\nIMAGE={decoy}",
        f"Assistant: I set {env_name} to {value} and re-ran the job ({decoy}). The key {value} now works.",
        f"<meta name=\"api-key\" content=\"{value}\"><!-- {decoy} -->",
    ]
    if kind == "NPM_TOKEN":
        forms.append(f"//registry.npmjs.org/:_authToken={value}\nregistry=https://registry.npmjs.org/ # {decoy}")
    if kind in ("OPENAI_KEY", "STRIPE_KEY", "HF_TOKEN", "SECRET"):
        b64 = base64.b64encode(f"{env_name}={value}".encode()).decode()
        forms.append(f"config blob: {b64} (decoded at startup) {decoy}")
    if kind in ("GITHUB_TOKEN", "SECRET", "JWT"):
        forms.append(f"GET /callback?state=xyz&access_token={quote(value, safe='')}&next=%2Fhome HTTP/1.1 ({decoy})")
    return r.choice(forms)


SECRET_TYPES = list(_makers(random.Random(0)))


def make_eval_set(n_per_type: int = 40, seed: int = 0, n_decoy_only: int = 200) -> list[dict]:
    r = random.Random(seed)
    makers = _makers(r)
    cases = []
    for kind in SECRET_TYPES:
        for i in range(n_per_type):
            value = makers[kind]()
            decoy = r.choice(DECOYS)
            cases.append({"id": f"{kind.lower()}-{i}", "text": _context(r, kind, value, decoy),
                          "secrets": [{"type": kind, "value": value}], "decoys": [decoy]})
    for i in range(n_decoy_only):  # texts with look-alikes only
        picks = r.sample(DECOYS, 3)
        text = r.choice([
            f"$ git log --oneline -3\n{hexstr(r, 7)} Merge {picks[0]}\n{hexstr(r, 7)} Bump {picks[1]}\n"
            f"{hexstr(r, 7)} Pin {picks[2]}\n",
            f"docker pull python@{picks[0]}\nDigest: {picks[1]}\nStatus: up to date ({picks[2]})",
            f"request_id={picks[0]} version={picks[1]} host={picks[2]} took 231ms",
            f'{{"id": "{picks[0]}", "build": "{picks[1]}", "listen": "{picks[2]}", "api_key": "YOUR_API_KEY"}}',
        ])
        cases.append({"id": f"decoy-{i}", "text": text, "secrets": [], "decoys": picks})
    return cases


if __name__ == "__main__":  # pragma: no cover
    for c in make_eval_set(2)[:60]:
        print(json.dumps(c)[:300])
