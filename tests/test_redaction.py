"""Redaction: recall and decoys on the labelled set, scoped placeholders, idempotence, valid JSON,
the redacted layer and its events, the vault, and `trajwh redact-text`."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections import Counter

import orjson
import pytest
from conftest import trajwh_cmd
from hypothesis import given, settings
from hypothesis import strategies as st
from trajwh.ingest.normalize import normalize_warehouse
from trajwh.ingest.raw_store import IngestOptions, ingest_paths
from trajwh.redaction.audit import rescan_sample
from trajwh.redaction.engine import PLACEHOLDER_RE, Detector, Redactor
from trajwh.redaction.evaluation import load_cases, score
from trajwh.redaction.layer import redact_warehouse
from trajwh.redaction.vault import Vault, load_key, new_key_file
from trajwh.schemas.errors import ConfigError
from trajwh.synth.secrets_eval import SECRET_TYPES, make_eval_set

SALT = b"test-salt"


@pytest.fixture(scope="module")
def redactor():
    return Redactor(SALT)


def test_recall_and_decoys_on_the_labelled_set(redactor):
    cases = make_eval_set(25, seed=11)  # another seed than the benchmark's
    found, total = Counter(), Counter()
    decoys = kept = 0
    for c in cases:
        out = redactor.text(c["text"], redactor.scope(c["id"]), "text", [])
        for s in c["secrets"]:
            total[s["type"]] += 1
            found[s["type"]] += s["value"] not in out
        decoys += len(c["decoys"])
        kept += sum(d in out for d in c["decoys"])
    assert set(total) == set(SECRET_TYPES)
    assert sum(found.values()) / sum(total.values()) >= 0.98
    assert {t: found[t] / total[t] for t in total if found[t] / total[t] < 0.95} == {}
    assert kept / decoys >= 0.98


@pytest.mark.parametrize("text", [
    "commit 9fceb02d0ae598e95dc970b74767f19372d61af8", "id 123e4567-e89b-12d3-a456-426614174000",
    "sha256:2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824", "pip install requests==2.31.0",
    "AWS_ACCESS_KEY_ID=AKIAIOSFODNN7EXAMPLE", "OPENAI_API_KEY=YOUR_API_KEY", "api_key = os.environ['API_KEY']",
    "token = value.get('token')", "listen on 127.0.0.1:8080 and 0.0.0.0", "password: ${DB_PASSWORD}",
])
def test_lookalikes_are_not_flagged(text):
    assert Detector().find(text) == []


def test_secrets_hidden_in_base64_and_url_encoding_are_found(redactor):
    import base64
    from urllib.parse import quote

    key = "sk-proj-" + "Ab3dE5fG7hJ9kL1mN3pQ5rS7tU9vW1xY3zA5bC7dE9fG1hJ3kL5m"
    blob = base64.b64encode(f"OPENAI_API_KEY={key}".encode()).decode()
    out = redactor.text(f"config: {blob}", redactor.scope("a"), "t", [])
    assert blob not in out and "<OPENAI_KEY:" in out
    out = redactor.text(f"GET /cb?token={quote(key, safe='')}&x=1", redactor.scope("b"), "t", [])
    assert quote(key, safe="") not in out


def test_placeholders_are_scoped_stable_and_distinct():
    red = Redactor(SALT)
    a, b = "ghp_" + "a" * 10 + "B3c4D5e6F7g8H9i0J1k2L3m4N5o6", "ghp_" + "z" * 10 + "Y3x4W5v6U7t8S9r0Q1p2O3n4M5l6"
    ep = red.scope("episode-1")
    p1 = red.text(f"use {a}", ep, "t", [])
    p2 = red.text(f"again {a} and {b}", ep, "t", [])
    ph_a = PLACEHOLDER_RE.findall(p1)[0]
    assert p2.count(ph_a) == 1 and len(set(PLACEHOLDER_RE.findall(p2))) == 2  # same value, same placeholder
    other = red.text(f"use {a}", red.scope("episode-2"), "t", [])
    assert PLACEHOLDER_RE.findall(other)[0] != ph_a  # not linkable across scopes
    assert Redactor(b"other-salt").text(f"use {a}", Redactor(b"other-salt").scope("episode-1"), "t", []) != p1
    assert ph_a.startswith("<GITHUB_TOKEN:") and ph_a.endswith(":ep>")


secretish = st.sampled_from([
    "ghp_" + "Q" * 6 + "w8E7r6T5y4U3i2O1p0A9s8D7f6G5h4J3", "AKIA" + "Z7Y6X5W4V3U2T1S0", "alice.smith@example-corp.com",
    "+1 (415) 555-2671", "52.10.33.44", "4111111111111111", "/home/jsmith/app", "password=Tr0ub4dor&3xyz",
    "Authorization: Bearer abcDEF123456ghiJKL789mno"])
noise = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(secretish, noise), max_size=6))
def test_redacting_redacted_text_changes_nothing(parts):
    red = Redactor(SALT)
    text = " ".join(parts)
    once = red.text(text, red.scope("s"), "t", [])
    assert red.text(once, red.scope("s"), "t", []) == once
    assert red.text(once, red.scope("other"), "t", []) == once


def test_tool_call_arguments_stay_valid_json(redactor):
    args = json.dumps({"command": "curl -H 'Authorization: Bearer abcDEF123456ghiJKL789mno' https://x.org",
                       "env": {"AWS_ACCESS_KEY_ID": "AKIAZ7Y6X5W4V3U2T1S0"}, "n": 3})
    events: list = []
    out = redactor.json_text(args, redactor.scope("j"), "tool_calls[0].arguments", events)
    doc = json.loads(out)
    assert doc["n"] == 3 and "AKIA" not in out and "abcDEF123456" not in out
    assert {e.field for e in events} == {"tool_calls[0].arguments.command", "tool_calls[0].arguments.env.AWS_ACCESS_KEY_ID"}


@pytest.fixture
def redacted_wh(redaction_case_wh):
    return redaction_case_wh


def test_one_token_is_one_placeholder_across_the_episode(redacted_wh, monkeypatch, tmp_path):
    key_file = new_key_file(tmp_path / "vault.key")
    monkeypatch.setenv("TRAJWH_VAULT_KEY_FILE", str(key_file))
    s = redact_warehouse(redacted_wh, run_id="r")
    assert s.vault_written and s.episodes == 1
    steps = redacted_wh.query("SELECT step_index, text, observation, tool_calls FROM redacted_steps ORDER BY 1").to_pylist()
    blob = json.dumps(steps, default=str)
    assert "ghp_" not in blob and "ops.lead@corp-mail.com" not in blob
    tokens = set(PLACEHOLDER_RE.findall(blob.replace("\\u003c", "<").replace("\\u003e", ">")))
    gh = {t for t in tokens if t.startswith("<GITHUB_TOKEN:")}
    assert len(gh) == 1  # tool call (URL and nested env), observation and prose: one placeholder
    json.loads(steps[1]["tool_calls"][0]["arguments"])  # still JSON
    for keep in ("d2c0b4a7e1f64a8b9c3d5e7f9a1b3c5d7e9f1a3b", "550e8400-e29b-41d4-a716-446655440000",
                 "AKIAIOSFODNN7EXAMPLE", "v2.31.0"):
        assert keep in steps[4]["observation"]
    events = redacted_wh.query("SELECT * FROM redaction_events").to_pylist()
    assert "ghp_" not in json.dumps(events, default=str)  # events never hold the value
    assert {e["entity_type"] for e in events} == {"GITHUB_TOKEN", "EMAIL"}
    revealed = Vault(redacted_wh, load_key()).reveal(next(iter(gh)))
    assert revealed and revealed[0]["value"].startswith("ghp_")
    for path in (redacted_wh.root / "vault").rglob("*"):
        assert stat.S_IMODE(os.stat(path).st_mode) in (0o600, 0o700)
    assert rescan_sample(redacted_wh)["secret_violations"] == 0


def test_without_a_key_the_vault_is_not_written(redacted_wh):
    s = redact_warehouse(redacted_wh, run_id="r")
    assert not s.vault_written and s.replacements > 0
    assert not list((redacted_wh.root / "vault").glob("*/part-*.parquet"))
    with pytest.raises(ConfigError, match="no vault key"):
        Vault(redacted_wh, None).reveal("<GITHUB_TOKEN:abcdef:ep>")


def test_a_key_that_appears_later_writes_the_missing_vault(redacted_wh, tmp_path, monkeypatch):
    first = redact_warehouse(redacted_wh, run_id="r1")
    assert not first.vault_written and first.replacements > 0
    before = redacted_wh.query("SELECT step_id, text, observation FROM redacted_steps ORDER BY step_id").to_pylist()
    monkeypatch.setenv("TRAJWH_VAULT_KEY_FILE", str(new_key_file(tmp_path / "vault.key")))
    second = redact_warehouse(redacted_wh, run_id="r2")
    assert second.vault_written and second.vault_backfilled == 1 and second.batches_done == 1
    # the same placeholders (the warehouse's salt), now with their values in the vault
    assert redacted_wh.query("SELECT step_id, text, observation FROM redacted_steps ORDER BY step_id").to_pylist() == before
    placeholder = redacted_wh.query("SELECT placeholder FROM redaction_events LIMIT 1").column(0)[0].as_py()
    assert Vault(redacted_wh, load_key()).reveal(placeholder)
    third = redact_warehouse(redacted_wh, run_id="r3")  # and then nothing is left to do
    assert third.vault_backfilled == 0 and third.batches_done == 0


def test_planted_secrets_of_the_synthetic_corpus_do_not_survive(wh, small_corpus, monkeypatch):
    monkeypatch.delenv("TRAJWH_VAULT_KEY", raising=False)
    monkeypatch.delenv("TRAJWH_VAULT_KEY_FILE", raising=False)
    ingest_paths(wh, [small_corpus], IngestOptions(source="synthetic"))
    normalize_warehouse(wh, run_id="n")
    redact_warehouse(wh, run_id="r")
    truth = [orjson.loads(x) for x in (small_corpus / ".truth" / "labels.jsonl").read_bytes().splitlines()]
    planted = [s["value"] for t in truth for s in t["secrets"]]
    assert len(planted) > 20
    red = wh.query("SELECT string_agg(coalesce(text, '') || coalesce(observation, '') || "
                   "coalesce(list_aggregate(list_transform(tool_calls, lambda c: c.arguments), 'string_agg', ' '), ''), ' ') "
                   "FROM redacted_steps").column(0)[0].as_py()
    assert [v for v in planted if v in red] == []
    assert "AKIAIOSFODNN7EXAMPLE" in red or "127.0.0.1" in red  # decoys the generator planted survive
    assert rescan_sample(wh)["secret_violations"] == 0


def test_redact_text_command(tmp_path, cli_env):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"id": "a", "text": "key AKIAZ7Y6X5W4V3U2T1S0 and again AKIAZ7Y6X5W4V3U2T1S0"}\n'
                   '{"id": "b", "text": "key AKIAZ7Y6X5W4V3U2T1S0"}\n')
    r = subprocess.run([*trajwh_cmd(), "redact-text", str(src), str(dst)], env=cli_env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [o["id"] for o in out] == ["a", "b"]
    a = PLACEHOLDER_RE.findall(out[0]["redacted_text"])
    assert len(a) == 2 and a[0] == a[1] and PLACEHOLDER_RE.findall(out[1]["redacted_text"])[0] != a[0]
    src.write_text('{"id": "a", "text": "ok"}\nnot json\n')
    bad = subprocess.run([*trajwh_cmd(), "redact-text", str(src), str(dst)], env=cli_env, capture_output=True, text=True)
    assert bad.returncode == 2 and "in.jsonl:2" in bad.stderr


def test_person_names_need_a_ner_model_and_use_it_when_installed(tmp_path, monkeypatch):
    import spacy
    from trajwh.redaction.pii import _register_lemma_component, person_analyzer

    text = "Thanks, Alice Smith reviewed it; the Python Package Index is up."
    monkeypatch.delenv("TRAJWH_NER_MODEL", raising=False)
    person_analyzer.cache_clear()
    if not spacy.util.is_package("en_core_web_sm"):
        assert Redactor(SALT).text(text, Redactor(SALT).scope("a"), "t", []) == text  # offline default: none
    # a real spaCy pipeline whose NER component (an entity ruler) knows one name
    _register_lemma_component()
    nlp = spacy.blank("en")
    nlp.add_pipe("trajwh_lemma")
    nlp.add_pipe("entity_ruler").add_patterns([{"label": "PERSON", "pattern": "Alice Smith"}])
    nlp.to_disk(tmp_path / "ner")
    monkeypatch.setenv("TRAJWH_NER_MODEL", str(tmp_path / "ner"))
    person_analyzer.cache_clear()
    try:
        red = Redactor(SALT)
        out = red.text(text, red.scope("a"), "t", [])
        assert "Alice Smith" not in out and "<PERSON:" in out and "Python Package Index" in out
    finally:
        person_analyzer.cache_clear()


# --- issue 12: redaction that generalizes ---------------------------------------------------------

@pytest.mark.parametrize("text", [
    "cd /home/fastjson2 && git apply /home/test.patch", "/home/Catch2/src/catch2/catch_all.hpp:12: FAILED",
    "bash /home/run.sh", "Collecting pyerfa-2.0.1.5\n  Downloading pyerfa-2.0.1.5-cp39-abi3-manylinux2014.whl",
    "--- a/x.py\t2024-03-05 12:33:21.123456789 +0000\n+++ b/x.py\t2024-03-05 12:35:02.987654321 +0000",
    "root       733  0.0  0.0 123456  7890 ?        Ss   10:00   0:00 /usr/sbin/sshd -D",
    "<__main__.Node object at 0x7f3a2b1c4d50> id=140234567891234", "src/auth.ts:9:import { session } from './session'",
    "def handle(%{session_id: ^session_id} = msg, state), do: :ok", '"@aws-sdk/credential-providers": "^3.948.0"',
    "assert validate('test@example.com') and validate('a@foo.test') and not validate('x@y.invalid')",
    "listen 192.0.2.10; upstream 198.51.100.7; 2001:db8::1; 127.0.0.1; 169.254.169.254; fe80::1",
    "order 1000123412341230 shipped", "Foundation, Inc., 51 Franklin St, Fifth Floor, Boston, MA 02110-1301 USA",
    "git clone git@github.com:acme/widget.git", "Author: Dev <dev@example.com>",
    "api_key = os.environ.get('API_KEY')\nsecret = settings.SECRET\ntoken = value.get('token')",
    "Old signature: `integrate(dim, datetime_unit=None)`", "EXAMPLE_KEY=550e8400-e29b-41d4-a716-446655440000",
    "see section 4.1.2.3 and libfoo 1.2.3.4", "std::vector<int> v; a::b::c(); ns::add1::fn",
])
def test_real_text_comes_out_unchanged(redactor, text):
    assert redactor.text(text, redactor.scope("s"), "t", []) == text


def test_spans_are_exact(redactor):
    out = redactor.text("send(email='omar.haddad@outlook.com')", redactor.scope("s"), "t", [])
    assert out.startswith("send(email='<EMAIL:") and out.endswith(">')")
    out = redactor.text("GET /v1?access_token=Zq8XbN3vR5tY7uK2wE4sD6fG1hJ9&limit=5&page=2", redactor.scope("s"), "t", [])
    assert out.endswith("&limit=5&page=2") and "Zq8X" not in out


def test_a_user_name_goes_in_every_spelling_and_in_tool_call_arguments(redactor):
    scope = redactor.scope("ep")
    texts = ["$ pwd\n/Users/okonkwo/notes", "-rw-r--r-- 1 okonkwo staff 120 Jan 2 notes.md",
             "~/.claude/projects/-Users-okonkwo-notes/a.jsonl", "file%3A%2F%2F%2FUsers%2Fokonkwo%2Fnotes",
             json.dumps({"path": "/Users/okonkwo/notes/todo.md"}), "owner=okonkwo"]
    for t in texts:
        redactor.learn(t, scope)
    outs = [redactor.text(t, scope, "t", []) for t in texts[:-2]]
    outs.append(redactor.json_text(texts[-2], scope, "tool_calls[0].arguments", []))
    outs.append(redactor.text(texts[-1], scope, "t", []))
    assert not any("okonkwo" in o for o in outs), outs
    assert len({m for o in outs for m in PLACEHOLDER_RE.findall(o)}) == 1  # one name, one placeholder
    assert "staff 120 Jan 2 notes.md" in outs[1]


@pytest.mark.parametrize("text, value", [
    ("DB_PASSWORD=Tr0ub4dor&3xyz", "Tr0ub4dor&3xyz"),
    ("export GITHUB_WEBHOOK_SECRET=8b1118b376c313ed420e5133ba91307817ed52c2", "8b1118b376c313ed420e5133ba91307817ed52c2"),
    ("database:\n  password: hunter2hunter2\n  pool: 5", "hunter2hunter2"),
    ('{"arguments": "{\\"password\\": \\"S3cr3t!pass\\"}"}', "S3cr3t!pass"),
    ('[pypi]\npassword = "pypi-AgEIcHlwaS5vcmcCJGQ4ZTk3NmRhLTU0Zj"', "pypi-AgEIcHlwaS5vcmcCJGQ4ZTk3NmRhLTU0Zj"),
    ("spring.datasource.password=Sup3rS3cret!", "Sup3rS3cret!"),
    ("docker login r.io --username ci --password=Qw3rty!9876", "Qw3rty!9876"),
    ("mysql -h db -u root -pS3cr3tPassw0rd -e 'show databases'", "S3cr3tPassw0rd"),
    ("curl -u deploy:Pa55w0rd-x https://x.io", "Pa55w0rd-x"),
    ("Cookie: theme=dark; sessionid=a8f5f167f44f4964e6c998dee827110c", "a8f5f167f44f4964e6c998dee827110c"),
    ("X-Api-Key: 9f8e7d6c5b4a39281706f5e4d3c2b1a0", "9f8e7d6c5b4a39281706f5e4d3c2b1a0"),
    ("//registry.npmjs.org/:_authToken=c0272f2b-659c-499c-a1ac-278d8c79d2a9", "c0272f2b-659c-499c-a1ac-278d8c79d2a9"),
    ("APP_KEY=base64:9JvGQn7y2n4m8Kx1Zr5T0wq3Yb6Uc8Ed1Fh2Gj3Kk4L=", "base64:9JvGQn7y2n4m8Kx1Zr5T0wq3Yb6Uc8Ed1Fh2Gj3Kk4L="),
    ("kind: Secret\ndata:\n  password: c3VwZXJzZWNyZXRwYXNzd29yZA==\n", "c3VwZXJzZWNyZXRwYXNzd29yZA=="),
    ("TELEGRAM=1234567890:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsaw0", "1234567890:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsaw0"),
])
def test_context_keyed_and_provider_secrets_in_every_syntax(redactor, text, value):
    assert value not in redactor.text(text, redactor.scope("s"), "t", [])


@pytest.mark.parametrize("text, value, entity", [
    ("Author: Jane Whitfield <jane.w@protonmail.com>", "Jane Whitfield", "PERSON"),
    ("Signed-off-by: Tomasz Wrobel <tomasz@wrobel.pl>", "Tomasz Wrobel", "PERSON"),
    ('To: "Beatriz Oliveira" <bia@uol.com.br>', "Beatriz Oliveira", "PERSON"),
    ("/Users/Jane Smith/Library/Caches", "Jane Smith", "USERNAME"),
    ("rahulk@devbox:~/shop$ ls", "rahulk", "USERNAME"),
    ("call 07700 900461 or +33 6 12 34 56 78", "07700 900461", "PHONE"),
    ("ssh deploy@10.2.3.4 uptime", "10.2.3.4", "IP_ADDRESS"),
    ("inet6 fd12:3456:789a:1::5/64", "fd12:3456:789a:1::5", "IP_ADDRESS"),
    ("card: 4539 1488 0343 6467 exp 04/27", "4539 1488 0343 6467", "CREDIT_CARD"),
])
def test_personal_data_from_structure(text, value, entity):
    found = [(text[f.start:f.end], f.entity) for f in Detector().find(text)]
    assert (value, entity) in found


def test_private_addresses_are_configurable():
    keep = Detector(redact_private_ips=False)
    assert [f.entity for f in keep.find("ssh 10.2.3.4 and 52.14.3.200")] == ["IP_ADDRESS"]
    assert len(Detector().find("ssh 10.2.3.4 and 52.14.3.200")) == 2


def test_the_held_out_set_holds():
    """The held-out evaluation (tests/cases/redaction_eval/heldout.jsonl, written from public
    scanners' documented formats and real trajectory shapes, not from our detectors)."""
    red = Redactor(SALT)
    result = score(load_cases(), lambda c: red.text(c["text"], red.scope(c["id"]), "text", []))
    assert result["recall"] >= 0.98 and result["decoys_kept"] >= 0.98, (result["missed"], result["destroyed"])
    assert min(v["recall"] for v in result["per_type"].values()) >= 0.95, result["per_type"]


def test_another_vault_key_fails_clearly_and_rotation_keeps_every_value(redacted_wh, monkeypatch, tmp_path):
    first = new_key_file(tmp_path / "a.key")
    monkeypatch.setenv("TRAJWH_VAULT_KEY_FILE", str(first))
    redact_warehouse(redacted_wh, run_id="r1")
    placeholder = redacted_wh.query("SELECT placeholder FROM redaction_events WHERE entity_type = 'EMAIL' LIMIT 1"
                                    ).column(0)[0].as_py()
    other = new_key_file(tmp_path / "b.key")
    monkeypatch.setenv("TRAJWH_VAULT_KEY_FILE", str(other))
    with pytest.raises(ConfigError, match="another key"):
        redact_warehouse(redacted_wh, run_id="r2", full=True)
    monkeypatch.setenv("TRAJWH_VAULT_KEY_FILE", str(first))
    n = Vault(redacted_wh, load_key()).rotate(other.read_bytes().strip())
    assert n > 0
    monkeypatch.setenv("TRAJWH_VAULT_KEY_FILE", str(other))
    assert Vault(redacted_wh, load_key()).reveal(placeholder)[0]["value"] == "ops.lead@corp-mail.com"
    redact_warehouse(redacted_wh, run_id="r3", full=True)  # the new key now opens the vault
    monkeypatch.setenv("TRAJWH_VAULT_KEY_FILE", str(first))
    with pytest.raises(ConfigError, match="another key"):
        Vault(redacted_wh, load_key()).check_key()


def test_worker_processes_give_the_same_redacted_layer(wh, small_corpus, monkeypatch, tmp_path):
    """Big batches are redacted by worker processes (episode scope); the result must not depend on it."""
    import shutil

    import trajwh.redaction.layer as layer

    monkeypatch.delenv("TRAJWH_VAULT_KEY", raising=False)
    monkeypatch.setenv("TRAJWH_VAULT_KEY_FILE", str(new_key_file(tmp_path / "k.key")))
    import trajwh.ingest.normalize as normalize

    ingest_paths(wh, [small_corpus], IngestOptions(source="synthetic"))
    monkeypatch.setattr(normalize, "FLUSH_STEPS", 400)  # several steps files: several tasks for the workers
    normalize_warehouse(wh, run_id="n")
    assert len(wh.files("steps")) > 2
    Vault(wh, load_key()).salt()
    other = tmp_path / "other"
    shutil.copytree(wh.root, other)
    monkeypatch.setenv("TRAJWH_WORKERS", "1")
    redact_warehouse(wh, run_id="serial")
    monkeypatch.setenv("TRAJWH_WORKERS", "2")
    monkeypatch.setattr(layer, "PARALLEL_MIN_EPISODES", 1)
    monkeypatch.setattr(layer, "_CHUNK_EPISODES", 7)
    from trajwh.lineage.catalog import Warehouse

    wh2 = Warehouse(other)
    redact_warehouse(wh2, run_id="parallel")
    _same_redacted_layer(wh, wh2)
    a = sorted((r["placeholder"], r["scope_id"]) for r in pq_rows(wh.root / "vault"))
    b = sorted((r["placeholder"], r["scope_id"]) for r in pq_rows(other / "vault"))
    assert a == b and a


def test_redaction_reads_a_steps_file_a_row_group_at_a_time(wh, small_corpus, monkeypatch, tmp_path):
    """A steps file is redacted a row group at a time, an episode whose steps span row groups
    waiting for its last one: the redacted layer is the one a file of one row group gives."""
    import shutil

    import pyarrow.parquet as pq
    import trajwh.ingest.normalize as normalize
    import trajwh.lineage.storage as storage
    from trajwh.lineage.catalog import Warehouse

    monkeypatch.delenv("TRAJWH_VAULT_KEY", raising=False)
    monkeypatch.setenv("TRAJWH_VAULT_KEY_FILE", str(new_key_file(tmp_path / "k.key")))
    monkeypatch.setenv("TRAJWH_WORKERS", "1")
    ingest_paths(wh, [small_corpus], IngestOptions(source="synthetic"))
    Vault(wh, load_key()).salt()
    other = Warehouse(tmp_path / "other")
    shutil.copytree(wh.root, other.root)
    normalize_warehouse(wh, run_id="n")
    redact_warehouse(wh, run_id="whole")
    monkeypatch.setattr(storage, "ROW_GROUP_ROWS", 5)
    monkeypatch.setattr(normalize, "FLUSH_STEPS", 60)
    normalize_warehouse(other, run_id="n")
    spanning = 0
    for path in other.files("steps"):
        f = pq.ParquetFile(path)
        keys = [f.read_row_group(g, columns=["trajectory_key"]).column(0).to_pylist() for g in range(f.num_row_groups)]
        spanning += sum(a[-1] == b[0] for a, b in zip(keys, keys[1:], strict=False))
    assert spanning > 3  # the test has teeth: episodes go on across row groups
    redact_warehouse(other, run_id="groups")
    _same_redacted_layer(wh, other)


def _same_redacted_layer(a, b) -> None:
    """The redacted rows and their events of two warehouses are the same."""
    for table, cols in (("redacted_steps", "step_id, text, observation, tool_calls, metadata"),
                        ("redacted_episodes", "trajectory_key, task_text, metadata"),
                        ("redaction_events", "event_id, placeholder, entity_type, start, \"end\"")):
        q = f"SELECT {cols} FROM {table} ORDER BY 1"
        assert a.query(q).to_pylist() == b.query(q).to_pylist(), table


def pq_rows(folder):
    import pyarrow.parquet as pq

    return [r for p in sorted(folder.glob("*/part-*.parquet")) for r in pq.read_table(p).to_pylist()]


_PREFILTER_CHARS = "0123456789abcdefABCDEFgz:.:: _-/+=(é\n\"'"


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=_PREFILTER_CHARS, max_size=120))
def test_fast_candidate_scans_find_what_the_full_patterns_find(text):
    """The IPv6 and base64 scans look only where their hints are; on any text they must give
    the matches of the plain patterns run over the whole text (digit runs: test_detector_scans)."""
    from trajwh.redaction import engine

    assert [m.span(1) for m in engine._ipv6_candidates(text)] == [m.span(1) for m in engine._IPV6.finditer(text)]
    assert list(engine._b64_runs(text)) == [m.span() for m in engine._B64_RUN.finditer(text)]
    blobs = [m.span(1) for a, b in engine._b64_runs(text) for m in engine._B64.finditer(text, a, b)]
    assert blobs == [m.span(1) for m in engine._B64.finditer(text)]


@pytest.mark.parametrize("text,found", [
    ("peer 2a00:1450:4001:82a::200e connected", "2a00:1450:4001:82a::200e"),
    ("addr=2606:4700:4700::1111, ok", "2606:4700:4700::1111"),
    ("at 12:30:45 the job ended", None),
    ("token " + "QUtJQUlPU0ZPRE5ON0VYQU1QTEU=" * 2 + " end", None),
])
def test_ipv6_addresses_are_found_in_their_runs(text, found):
    spans = [text[f.start:f.end] for f in Detector().find(text) if f.entity == "IP_ADDRESS"]
    assert spans == ([found] if found else [])


def test_the_rescan_check_goes_batch_by_batch(redaction_case_wh, cases, monkeypatch):
    """Each batch is rescanned once while its files are unchanged; a new batch is rescanned alone,
    and a secret left in its redacted steps is still found."""
    import pyarrow.parquet as pq
    from trajwh.redaction.audit import rescan_by_batch

    wh = redaction_case_wh
    redact_warehouse(wh, run_id="r")
    first = rescan_by_batch(wh)
    assert first["secret_violations"] == 0 and first["batches_cached"] == 0 and first["steps_scanned"] > 0
    assert rescan_by_batch(wh)["cached"] is True
    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="cases"))
    normalize_warehouse(wh, run_id="n2")
    redact_warehouse(wh, run_id="r2")
    second = rescan_by_batch(wh)
    assert second["batches_cached"] == 1 and not second["cached"] and second["secret_violations"] == 0
    assert second["steps_scanned"] > first["steps_scanned"]
    # a secret the redaction missed in the new batch (its steps file rewritten behind its back)
    new_batch = wh.query("SELECT batch_id FROM table_files WHERE table_name = 'redacted_steps' "
                         "ORDER BY added_at DESC LIMIT 1").column(0)[0].as_py()
    (path,) = wh.files("redacted_steps", batch_id=new_batch)
    t = pq.read_table(path)
    rows = t.to_pylist()
    rows[0]["text"] = (rows[0]["text"] or "") + " token ghp_a8Fk2LmN4pQ7rS1tU3vW5xY9zB6cD0eF2gH4"
    with wh.write_session("test") as session:
        session.commit([session.write("redacted_steps", type(t).from_pylist(rows, schema=t.schema))], removed=[path],
                       batch_id=new_batch)
    third = rescan_by_batch(wh)
    assert third["secret_violations"] >= 1 and third["batches_cached"] == 1
    assert third["examples"][0]["step_id"] == rows[0]["step_id"]
    # a big batch is rescanned in parts (touched steps dealt by id, the sample in the first): the
    # parts together scan and find what one scan does, and the planted secret is found once
    from trajwh.redaction import audit

    one = rescan_sample(wh, 50, batch_id=new_batch)
    halves = [rescan_sample(wh, 50, batch_id=new_batch, part=(i, 2)) for i in range(2)]
    assert sum(h["steps_scanned"] for h in halves) == one["steps_scanned"]
    assert sorted(h["secret_violations"] for h in halves) == [0, one["secret_violations"]]
    monkeypatch.setattr(audit, "PARALLEL_MIN_STEPS", 1)
    steps = wh.query("SELECT count(*) FROM redacted_steps WHERE _batch_id = ?", [new_batch]).column(0)[0].as_py()
    parted = audit.rescan_batch(wh, new_batch, steps)
    alone = rescan_sample(wh, audit.batch_sample(steps), batch_id=new_batch)
    assert {k: parted[k] for k in ("steps_scanned", "secret_violations")} == \
        {k: alone[k] for k in ("steps_scanned", "secret_violations")}
