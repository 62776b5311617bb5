"""trajwh.toml: validated, errors that name the key, the same settings for the CLI and Dagster."""

from __future__ import annotations

import json
import subprocess
from datetime import UTC, datetime

import pytest
from conftest import trajwh_cmd
from trajwh.pipelines.settings import curate_config, select_config, stats_config, with_overrides
from trajwh.schemas.config import Settings, load_settings
from trajwh.schemas.errors import ConfigError


def test_defaults_without_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRAJWH_CONFIG", raising=False)
    s = load_settings(None, tmp_path / "wh")
    assert s == Settings() and s.source is None
    cfg = curate_config(s)
    assert (cfg.splits.train, cfg.splits.valid, cfg.splits.test) == (0.8, 0.1, 0.1)
    assert cfg.splits.cutoff == datetime(2025, 6, 1, tzinfo=UTC) and cfg.digest == s.digest()


def test_file_in_the_warehouse_is_read_and_maps_onto_every_stage(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRAJWH_CONFIG", raising=False)
    wh = tmp_path / "wh"
    wh.mkdir()
    (wh / "trajwh.toml").write_text("""
[splits]
cutoff = "none"
fractions = "0.7,0.2,0.1"
whole_repository = true
[groups]
max_key_share = 0.5
[near_dup]
threshold = 0.9
[leaks]
hold_out_of_eval = false
train_fragments = true
[stats]
prior = [2.0, 3.0]
recency_half_life_days = 30
""")
    s = load_settings(None, wh)
    cfg, st, sel = curate_config(s), stats_config(s), select_config(s)
    assert cfg.splits.cutoff is None and (cfg.splits.train, cfg.splits.valid) == (0.7, 0.2)
    assert cfg.groups.whole_repository and cfg.groups.max_key_share == 0.5 and cfg.minhash.threshold == 0.9
    assert not cfg.splits.hold_out_leaks and sel.leak_fragments and not sel.controls
    assert (st.prior_alpha, st.prior_beta, st.recency_half_life_days) == (2.0, 3.0, 30)
    assert s.digest() != Settings().digest()
    over = with_overrides(s, cutoff="2025-01-01", fractions="0.8,0.1,0.1")
    assert curate_config(over).splits.cutoff == datetime(2025, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize("text, names", [
    ("[splits]\nfractions = [0.8, 0.1, 0.2]\n", "splits.fractions"),
    ("[splits]\ncutoff = \"last tuesday\"\n", "splits.cutoff"),
    ("[splits]\ncutof = \"2025-01-01\"\n", "splits.cutof: unknown key"),
    ("[groups]\nkeys = [\"task\", \"colour\"]\n", "groups.keys"),
    ("[stats]\nprior = [0, 1]\n", "stats.prior"),
    ("[nonsense]\nx = 1\n", "nonsense: unknown key"),
    ("[splits\n", "cannot read"),
])
def test_bad_settings_name_the_key_and_what_is_valid(tmp_path, text, names):
    f = tmp_path / "trajwh.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_settings(str(f))
    assert names in str(err.value) and str(f) in str(err.value)


def test_missing_named_config_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(str(tmp_path / "nope.toml"))


def test_outcome_rules_version_must_match_the_installed_taxonomy():
    with pytest.raises(ConfigError, match="rules_version"):
        stats_config(Settings(outcomes={"rules_version": "0.1"}))


def test_build_takes_split_controls_and_reports_realized_shares(tmp_path, small_corpus, cli_env):
    def run(*args, ok=True):
        r = subprocess.run([*trajwh_cmd(), *args], env=cli_env, capture_output=True, text=True, timeout=600)
        assert (r.returncode == 0) == ok, r.stderr[-2000:]
        return r

    run("ingest", str(small_corpus))
    bad = run("build", "--fractions", "0.5,0.5,0.5", ok=False)
    assert bad.returncode == 2 and "fractions" in bad.stderr and "summing to 1" in bad.stderr
    far = run("build", "--cutoff", "2030-01-01")
    assert "EMPTY" in far.stderr and "of 80% asked" in far.stdout  # nothing after the cutoff: said loudly
    assert "no task after the cutoff has usable times" in far.stdout
    a = json.loads(run("audit", "--json").stdout)
    assert {r["split"] for r in a["splits"]} == {"train"} and a["requested"]["cutoff"].startswith("2030-01-01")
    hashed = run("build", "--cutoff", "none", "--fractions", "0.6,0.2,0.2")
    a = json.loads(run("audit", "--json").stdout)
    realized = {r["split"]: r["realized"] for r in a["splits"] if r["split"] != "held_out"}
    assert "train" in realized and set(realized) & {"valid", "test"} and a["requested"]["fractions"]["train"] == 0.6
    assert abs(sum(realized.values()) - 1) < 1e-3  # shares of the episodes not held out
    assert a["violations"] == 0 and "splits: " in hashed.stdout
    whole = run("build", "--cutoff", "none", "--whole-repository")
    assert whole.returncode == 0
    groups = json.loads(run("audit", "--json").stdout)["groups"]
    repos = int(run("sql", "SELECT count(DISTINCT repository) AS n FROM task_groups", "--format", "csv").stdout.split()[1])
    assert groups == repos  # every synthetic episode names its repository: one group each
