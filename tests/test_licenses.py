"""Licenses and opt-out (docs/licenses.md): facts per episode, eligibility by rule, the opt-out
registry, and every consumer honouring them (fragments, packs, exports, forget)."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest
from conftest import SHARED_CORPUS
from trajwh.ingest.export import export_episodes
from trajwh.ingest.raw_store import IngestOptions, ingest_paths
from trajwh.licenses.optout import (
    OptOutSelector,
    add_opt_out,
    addresses,
    email_digest,
    remove_opt_out,
)
from trajwh.licenses.policy import LicensePolicy
from trajwh.licenses.spdx import decide, parse
from trajwh.lineage.catalog import Warehouse
from trajwh.pipelines.definitions import build
from trajwh.pipelines.settings import license_policy
from trajwh.schemas.config import LicenseSettings, load_settings, settings_from
from trajwh.schemas.errors import ConfigError

BASE_TOML = """
[splits]
fractions = [1.0, 0.0, 0.0]
cutoff = "none"
[packing]
seq_len = 2048
[licenses]
policy_terms = { "teacher-*" = "LicenseRef-Teacher-Terms" }
repositories = { "https://github.com/acme/widgets" = "MIT" }
"""


# --- SPDX expressions and decisions ------------------------------------------------------------


def test_expressions_are_validated_and_normalized():
    assert parse("mit or apache-2.0").normalized == "MIT OR Apache-2.0"
    assert parse("LicenseRef-Teacher-Terms AND MIT").normalized == "LicenseRef-Teacher-Terms AND MIT"
    assert parse("GPL-2.0-only WITH Classpath-exception-2.0").valid
    assert "Foo-1.0" in parse("Foo-1.0").error  # not on the SPDX list, not a LicenseRef
    assert not parse("MIT ANDD BSD-3-Clause").valid
    assert not parse("").valid


@pytest.mark.parametrize("expr, decision", [
    ("MIT", "allow"),
    ("MIT OR GPL-3.0-only", "allow"),  # the licensee's choice: the best branch
    ("MIT AND GPL-3.0-only", "review"),  # every part binds: the worst
    ("GPL-3.0-only AND Proprietary-Unknown", None),  # invalid: not decided by patterns at all
    ("LicenseRef-Teacher-Terms", "block"),  # neither allowed nor under review
    ("GPL-2.0-only WITH Classpath-exception-2.0", "allow"),  # the exception is allowed by name
    ("BSD-3-Clause", "allow"),
])
def test_decisions_follow_and_or_with(expr, decision):
    p = parse(expr)
    if decision is None:
        assert not p.valid
        return
    allow, review = ("MIT", "BSD-*", "GPL-2.0-only WITH Classpath-exception-2.0"), ("GPL-*",)
    assert decide(p, allow, review)[0] == decision


def test_policy_and_mapping_errors_name_the_place(tmp_path):
    with pytest.raises(ConfigError, match="licenses.release.unknown"):
        settings_from({"licenses": {"release": {"unknown": "maybe"}}})
    with pytest.raises(ConfigError, match="unknown license fact kind"):
        settings_from({"licenses": {"train": {"require": ["author"]}}})
    bad = tmp_path / "trajwh.toml"
    bad.write_text('[licenses]\nrepositories = { "github.com/a/b" = "Mit-ish" }\n')
    with pytest.raises(ConfigError, match=r"Mit-ish.*licenses.repositories"):
        license_policy(load_settings(str(bad)))
    (tmp_path / "repos.csv").write_text("repository,license\ngithub.com/a/b,MIT\ngithub.com/c/d,NotALicense\n")
    bad.write_text('[licenses]\nrepository_file = "repos.csv"\n')
    with pytest.raises(ConfigError, match=r"repos.csv:3"):
        license_policy(load_settings(str(bad)))
    (tmp_path / "repos.csv").write_text("github.com/a/b,MIT\n")
    policy = license_policy(load_settings(str(bad)))
    assert policy.repositories["github.com/a/b"][0] == "MIT"


def test_required_and_invalid_facts_get_the_unknown_decision():
    policy = LicensePolicy.from_settings(LicenseSettings())
    unknown = policy.decide(policy.facts({"license": None}))
    assert (unknown.train, unknown.release, unknown.eligibility) == ("allow", "block", "train")
    assert unknown.reasons == ("release: block source license unknown",)
    invalid = policy.decide(policy.facts({"license": "MIT", "meta_license": "Not-A-License-9"}))
    assert invalid.release == "block" and "release: block source license not valid SPDX" in invalid.reasons
    opted = policy.decide(policy.facts({"license": "MIT"}), [("oo-1", "email")])
    assert opted.eligibility == "blocked" and opted.opt_out_ids == ("oo-1",)


def test_ingest_refuses_a_license_that_is_not_spdx(wh, cases):
    with pytest.raises(ConfigError, match=r"Apache-2\.5.*--license"):
        ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(license="Apache-2.5"))
    s = ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(license="mit or apache-2.0"))
    assert wh.query("SELECT DISTINCT license FROM raw_records").column(0).to_pylist() == ["MIT OR Apache-2.0"]
    assert s.n_new == 2


# --- the warehouse: eligibility, opt-outs and their consumers ----------------------------------


def _warehouse(tmp_path: Path, toml: str = BASE_TOML) -> Warehouse:
    wh = Warehouse(tmp_path / "wh")
    wh.root.mkdir(parents=True)
    (wh.root / "trajwh.toml").write_text(toml)
    return wh


def _build(wh: Warehouse) -> None:
    assert build(str(wh.root)).success


def _by_episode(wh: Warehouse, sql: str) -> dict[str, object]:
    return {r["source_episode_id"]: r["v"] for r in wh.query(
        f"SELECT e.source_episode_id, {sql} AS v FROM redacted_episodes e LEFT JOIN eligibility g USING (trajectory_key) "
        "ORDER BY 1").to_pylist()}


def _trained(wh: Warehouse) -> set[str]:
    """Episodes with fragments and episodes in packs."""
    frag = set(wh.query("SELECT DISTINCT e.source_episode_id FROM fragments f JOIN redacted_episodes e "
                        "USING (trajectory_key)").column(0).to_pylist())
    packed = set(wh.query("SELECT DISTINCT e.source_episode_id FROM (SELECT unnest(segments).trajectory_key AS "
                          "trajectory_key FROM packs) p JOIN redacted_episodes e USING (trajectory_key)").column(0).to_pylist())
    return frag | packed


@pytest.fixture
def licensed(tmp_path, cases, monkeypatch):
    monkeypatch.delenv("TRAJWH_VAULT_KEY", raising=False)
    monkeypatch.delenv("TRAJWH_VAULT_KEY_FILE", raising=False)
    wh = _warehouse(tmp_path)
    ingest_paths(wh, [cases / "licenses" / "episodes.jsonl"], IngestOptions(source="cases", license="CC-BY-4.0"))
    _build(wh)
    return wh


def test_facts_and_eligibility_with_their_origins(licensed):
    wh = licensed
    facts = wh.query("""SELECT e.source_episode_id AS ep, f.kind, f.expression, f.status, f.origin
                        FROM license_facts f JOIN redacted_episodes e USING (trajectory_key) ORDER BY 1, 2, 3""").to_pylist()
    got = {(f["ep"], f["kind"], f["expression"] or f["status"]) for f in facts}
    assert ("lic-a", "policy_terms", "LicenseRef-Teacher-Terms") in got
    assert ("lic-a", "repository", "MIT") in got and ("lic-b", "repository", "MIT") in got
    assert ("lic-c", "repository", "GPL-3.0-only") in got and ("lic-c", "source", "Apache-2.0") in got
    assert ("lic-e", "source", "invalid") in got
    assert all(f["origin"] for f in facts)
    assert next(f for f in facts if f["ep"] == "lic-c" and f["kind"] == "repository")["origin"] == \
        "source metadata $.repository_license"
    assert _by_episode(wh, "g.eligibility") == {"lic-a": "train", "lic-b": "release", "lic-c": "train",
                                                "lic-d": "release", "lic-e": "train"}
    assert _by_episode(wh, "g.release")["lic-c"] == "review"  # GPL: a person decides before a release
    assert _trained(wh) == {"lic-a", "lic-b", "lic-c", "lic-d", "lic-e"}  # training allows all by default


def test_an_allow_list_change_moves_episodes_and_redoes_only_them(licensed):
    wh = licensed
    before = {r["fragment_id"]: r["_run_id"] for r in wh.query("SELECT fragment_id, _run_id FROM fragments").to_pylist()}
    (wh.root / "trajwh.toml").write_text(BASE_TOML + '[licenses.train]\nallow = ["CC-BY-4.0", "MIT", "Apache-2.0"]\n')
    _build(wh)
    # lic-a: the teacher's terms are not allowed for training now; lic-c: GPL; lic-e: invalid stays allowed
    # (train's `unknown` is allow)
    assert _by_episode(wh, "g.train") == {"lic-a": "block", "lic-b": "allow", "lic-c": "block", "lic-d": "allow",
                                          "lic-e": "allow"}
    assert _trained(wh) == {"lic-b", "lic-d", "lic-e"}
    after = {r["fragment_id"]: r["_run_id"] for r in wh.query("SELECT fragment_id, _run_id FROM fragments").to_pylist()}
    assert after and all(before[f] == run for f, run in after.items())  # the others were kept, not redone
    withheld = orjson.loads(wh.query("SELECT counts FROM runs WHERE job = 'fragments' ORDER BY finished_at DESC "
                                     "LIMIT 1").column(0)[0].as_py())["withheld"]
    assert withheld == {"license_block": 2}
    (wh.root / "trajwh.toml").write_text(BASE_TOML)  # and back
    _build(wh)
    assert _trained(wh) == {"lic-a", "lic-b", "lic-c", "lic-d", "lic-e"}


def test_opt_outs_added_after_a_build_exclude_at_the_next(licensed, cases):
    wh = licensed
    email = add_opt_out(wh, "author:JANE.DOE@acme-corp.example", "the author asked to be left out")
    content = add_opt_out(wh, "content:PROPRIETARY-DO-NOT-TRAIN", "vendor code")
    repo = add_opt_out(wh, "repository:https://github.com/other/lib.git", "the repository went private")
    assert (email["episodes"], content["episodes"], repo["episodes"]) == (1, 1, 2)
    # the registry holds a digest, never the address
    stored = wh.query("SELECT kind, value FROM opt_outs ORDER BY kind").to_pylist()
    assert {"kind": "email", "value": email_digest("jane.doe@acme-corp.example")} in stored
    assert not any("acme-corp" in r["value"] for r in stored)
    assert repo["value"] == "github.com/other/lib"
    _build(wh)
    assert _by_episode(wh, "g.eligibility") == {"lic-a": "blocked", "lic-b": "release", "lic-c": "blocked",
                                                "lic-d": "blocked", "lic-e": "train"}
    assert _trained(wh) == {"lic-b", "lic-e"}
    reasons = _by_episode(wh, "g.reasons")
    assert f"train: block opted out (email, {email['opt_out_id']})" in reasons["lic-a"]
    # a later batch is matched on arrival (the same address in other case; the marker)
    s = ingest_paths(wh, [cases / "licenses" / "later_batch.jsonl"], IngestOptions(source="cases", license="MIT"))
    assert s.opted_out == {"content": 1, "email": 1}
    _build(wh)
    elig = _by_episode(wh, "g.eligibility")
    assert elig["lic-f"] == "blocked" and elig["lic-g"] == "blocked"
    assert _trained(wh) == {"lic-b", "lic-e"}
    # removing an opt-out gives the data back at the next build
    remove_opt_out(wh, repo["opt_out_id"])
    _build(wh)
    assert _by_episode(wh, "g.train")["lic-c"] == "allow" and "lic-c" in _trained(wh)


def test_export_never_releases_a_blocked_episode(licensed, tmp_path):
    wh = licensed
    with pytest.raises(ConfigError, match=r"3 selected episode\(s\) may not be released.*--eligible-only"):
        export_episodes(wh, "native", tmp_path / "all.jsonl")
    assert not (tmp_path / "all.jsonl").exists()
    # an opt-out added after the build is honoured at once, before any rebuild
    add_opt_out(wh, "task:acme__widgets-2", "task withdrawn")
    n = export_episodes(wh, "native", tmp_path / "ok.jsonl", eligible_only=True)
    out = [orjson.loads(line) for line in (tmp_path / "ok.jsonl").read_bytes().splitlines()]
    assert n == len(out) == 1 and out[0]["episode_id"] == "lic-d"
    # the restricted zone's own export is not a release (it never leaves the owner-only layers)
    assert export_episodes(wh, "native", tmp_path / "n.jsonl", layer="normalized") == 5
    # a changed policy must be built before anything is released under it
    with pytest.raises(ConfigError, match="changed since the last build"):
        export_episodes(wh, "native", tmp_path / "x.jsonl", eligible_only=True, policy_digest="0" * 16)


def test_addresses_are_found_from_their_at_sign():
    text = (b'Author: Jane <Jane.Doe@Acme-Corp.example>, cc x@y and user@localhost, '
            b'"ops+alerts@mail.example.org"; @handle.example has no local part')
    assert addresses(text) == {b"jane.doe@acme-corp.example", b"ops+alerts@mail.example.org"}
    assert addresses(b"no address here") == set()


def test_opt_out_selectors_are_checked():
    with pytest.raises(ConfigError, match="not an e-mail address"):
        OptOutSelector.parse("email:not-an-address")
    with pytest.raises(ConfigError, match="not a regular expression"):
        OptOutSelector.parse("content:([")
    with pytest.raises(ConfigError, match="KIND:VALUE"):
        OptOutSelector.parse("person:someone")
    a = OptOutSelector.parse("author:Jane@Example.org")
    assert a == OptOutSelector.parse("email:jane@example.org") and "jane" not in a.shown()
    with pytest.raises(ConfigError, match="needs a reason"):
        add_opt_out(Warehouse("/nonexistent"), "source:x", " ")


def test_an_opt_out_becomes_a_deletion_request(licensed):
    from trajwh.lineage.forget import forget

    wh = licensed
    oo = add_opt_out(wh, "content:PROPRIETARY-DO-NOT-TRAIN", "vendor code")
    result = forget(wh, f"opt-out:{oo['opt_out_id']}", "the opt-out asked for deletion")
    assert result.status == "verified"
    assert "lic-d" not in set(wh.query("SELECT source_episode_id FROM episodes").column(0).to_pylist())
    req = wh.query("SELECT record_ids, trajectory_keys FROM deletions WHERE request_id = ?",
                   [result.request_id]).to_pylist()[0]
    assert len(req["record_ids"]) == len(req["trajectory_keys"]) == 1
    for table, column, wanted in (("raw_records", "record_id", req["record_ids"]),
                                  ("license_facts", "trajectory_key", req["trajectory_keys"]),
                                  ("eligibility", "trajectory_key", req["trajectory_keys"]),
                                  ("fragments", "trajectory_key", req["trajectory_keys"])):
        assert not wh.query(f"SELECT count(*) FROM {table} WHERE list_contains(?, {column})", [wanted]).column(0)[0].as_py()
    assert not wh.query("SELECT count(*) FROM opt_out_matches").column(0)[0].as_py()  # its record ids went too


@pytest.mark.skipif(not SHARED_CORPUS.is_dir(), reason=f"real corpus not found at {SHARED_CORPUS}")
def test_real_trajectories_an_author_opts_out_by_e_mail(tmp_path, monkeypatch):
    """A real SWE-agent trajectory quotes a commit author's address: opting out by it (in other
    case) excludes exactly the episodes whose raw bytes hold it, and stores no address."""
    monkeypatch.delenv("TRAJWH_VAULT_KEY", raising=False)
    folder = SHARED_CORPUS / "swe-agent-traj"
    if not folder.is_dir():
        pytest.skip(f"{folder} is absent")
    wh = _warehouse(tmp_path)
    ingest_paths(wh, [folder], IngestOptions(source="swe-agent", license="MIT"))
    pattern = re.compile(rb"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+\.(?:com|org|net|io)\b")
    counts: dict[bytes, set[str]] = {}
    for r in wh.query("SELECT record_id, payload FROM raw_records").to_pylist():
        for m in set(pattern.findall(r["payload"])):
            counts.setdefault(m.lower(), set()).add(r["record_id"])
    if not counts:
        pytest.skip("no e-mail address in these trajectories")
    address, records = sorted(counts.items(), key=lambda kv: (-len(kv[1]), kv[0]))[0]
    oo = add_opt_out(wh, "email:" + address.decode().upper(), "the author asked")
    _build(wh)
    blocked = set(wh.query("SELECT e._record_id FROM eligibility g JOIN redacted_episodes e USING (trajectory_key) "
                           "WHERE list_contains(g.opt_out_ids, ?)", [oo["opt_out_id"]]).column(0).to_pylist())
    assert blocked == records
    assert not _trained(wh) & set(wh.query("SELECT source_episode_id FROM redacted_episodes WHERE list_contains(?, "
                                          "_record_id)", [sorted(records)]).column(0).to_pylist())
    wh_bytes = b"".join(p.read_bytes() for p in [wh.root / "catalog.duckdb"])
    assert address not in wh_bytes.lower()


def test_a_new_batch_is_decided_alone(licensed, cases, tmp_path):
    """Eligibility goes batch by batch: a later batch (no opt-out matches it) is decided alone, the
    first batch's files stay as they were, and the decisions equal deciding everything again."""
    import shutil

    from trajwh.licenses.eligibility import build_eligibility

    wh = licensed

    def files() -> dict[str, str]:
        return {r["path"]: r["batch_id"] for r in wh.query(
            "SELECT path, batch_id FROM table_files WHERE table_name IN ('eligibility', 'license_facts')").to_pylist()}

    before = files()
    assert before and all(before.values())  # every file belongs to one batch
    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="more", license="MIT"))
    _build(wh)
    after = files()
    assert set(before) <= set(after)
    added = {p: b for p, b in after.items() if p not in before}
    assert added and len(set(added.values())) == 1 and set(added.values()).isdisjoint(before.values())
    params = orjson.loads(wh.query("SELECT params FROM runs WHERE job = 'eligibility' ORDER BY finished_at DESC "
                                   "LIMIT 1").column(0)[0].as_py())
    assert params["batches_decided"] == 1
    decided = _by_episode(wh, "g.eligibility || '/' || array_to_string(g.reasons, ';')")
    full = Warehouse(tmp_path / "full")
    shutil.copytree(wh.root, full.root)
    policy = license_policy(load_settings(str(full.root / "trajwh.toml")))
    assert build_eligibility(full, run_id="f", policy=policy, full=True).episodes == len(decided)
    assert _by_episode(full, "g.eligibility || '/' || array_to_string(g.reasons, ';')") == decided
