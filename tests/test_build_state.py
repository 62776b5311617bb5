"""Up-to-date builds (issue 14: a no-op build under 5 s): after a whole build whose checks pass,
`trajwh build` on an unchanged warehouse starts nothing; any input a build reads makes it build."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from conftest import trajwh_cmd
from trajwh.ingest.raw_store import IngestOptions, ingest_paths
from trajwh.licenses.optout import add_opt_out
from trajwh.lineage.build_state import build_inputs_digest, build_params, up_to_date
from trajwh.lineage.catalog import Warehouse
from trajwh.pipelines.definitions import build


def current(wh: Warehouse, **params) -> bool:
    return up_to_date(wh, build_inputs_digest(wh, build_params(**params))) is not None


def test_a_build_on_what_a_build_left_changes_nothing(tmp_path: Path, small_corpus: Path, cases: Path):
    """The rule the shortcut rests on: the state a whole build leaves is a fixed point (a further
    run of the graph changes none of a build's inputs and redoes no stage)."""
    wh = Warehouse(tmp_path / "wh")
    ingest_paths(wh, [small_corpus], IngestOptions(source="synthetic"))
    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="cases"))
    first = build(str(wh.root))
    recorded = json.loads((wh.root / "_cache" / "build_state.json").read_text())
    assert recorded["run_id"] == first.run_id and current(wh)
    again = build(str(wh.root))
    assert again.success and all(c.passed for c in again.get_asset_check_evaluations())
    skipped = {m.asset_key.to_user_string(): m.materialization.metadata for m in again.get_asset_materialization_events()}
    for asset in ("episodes", "redacted_steps", "splits", "fragments", "packs", "data_card"):
        md = skipped[asset]
        flag = md.get("skipped_unchanged") or md.get("batches_unchanged")
        assert flag is not None and flag.value, (asset, md)
    assert build_inputs_digest(wh, build_params()) == recorded["inputs"]


def test_every_input_a_build_reads_makes_it_build_again(tmp_path: Path, small_corpus: Path, cases: Path,
                                                       monkeypatch):
    monkeypatch.delenv("TRAJWH_VAULT_KEY", raising=False)
    monkeypatch.delenv("TRAJWH_VAULT_KEY_FILE", raising=False)
    monkeypatch.chdir(tmp_path)  # no ./trajwh.toml of the checkout's
    wh = Warehouse(tmp_path / "wh")
    ingest_paths(wh, [small_corpus], IngestOptions(source="synthetic"))
    build(str(wh.root))
    assert current(wh)
    # build overrides
    assert not current(wh, scope="repository") and not current(wh, curate={"cutoff": "none"})
    assert current(wh, curate={"cutoff": None})  # an unset override is no override
    # the environment: a vault key appears (the next build writes the vault)
    monkeypatch.setenv("TRAJWH_VAULT_KEY", "k" * 44)
    assert not current(wh)
    monkeypatch.delenv("TRAJWH_VAULT_KEY")
    assert current(wh)
    # the settings file, and a file it names
    config = wh.root / "trajwh.toml"
    (wh.root / "repos.csv").write_text("repository,license\nhttps://github.com/a/b,MIT\n")
    config.write_text('[licenses]\nrepository_file = "repos.csv"\n')
    assert not current(wh)
    build(str(wh.root))
    assert current(wh)
    (wh.root / "repos.csv").write_text("repository,license\nhttps://github.com/a/b,Apache-2.0\n")
    assert not current(wh)
    build(str(wh.root))
    assert current(wh)
    # a catalog table (an opt-out), a selection that builds part of the graph, the card, new data
    add_opt_out(wh, "source:synthetic", "withdrawn")
    assert not current(wh)
    build(str(wh.root))
    assert current(wh)
    build(str(wh.root), only=["packs"])  # a partial build claims nothing
    assert not current(wh)
    build(str(wh.root))
    (wh.root / "card" / "README.md").unlink()
    assert not current(wh)
    build(str(wh.root))
    assert (wh.root / "card" / "README.md").is_file() and current(wh)
    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="cases"))
    assert not current(wh)


def test_trajwh_build_says_up_to_date_and_force_runs_the_graph(cli_env, cases):
    def run(*args):
        r = subprocess.run([*trajwh_cmd(), *args], env=cli_env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    run("ingest", str(cases / "two_episodes.jsonl"))
    first = run("build")
    assert "check no_group_crosses_splits" in first and "up to date" not in first
    second = run("build")
    assert "up to date" in second and "check " not in second and "splits:" in second
    wh = Warehouse(cli_env["TRAJWH_WAREHOUSE"])
    row = wh.query("SELECT status, params, counts FROM runs WHERE job = 'build' ORDER BY started_at DESC LIMIT 1"
                   ).to_pylist()[0]
    assert row["status"] == "succeeded" and json.loads(row["params"])["up_to_date"]
    assert json.loads(row["counts"])["up_to_date_since"]
    forced = run("build", "--force")
    assert "check no_group_crosses_splits" in forced and "up to date" not in forced
    assert "up to date" not in run("build", "--cutoff", "none")  # another override: another build
