"""A killed ingest leaves nothing visible and can be rerun; concurrent writers never corrupt."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from conftest import trajwh_cmd

from lineage.catalog import Warehouse
from synth.generator import SynthConfig, generate_corpus


def _count(wh: Warehouse, sql: str) -> int:
    return wh.query(sql).column(0)[0].as_py()


def test_kill_9_mid_ingest_then_rerun_completes_without_duplicates(tmp_path, cli_env):
    corpus = tmp_path / "corpus"
    generate_corpus(SynthConfig(episodes=1500, seed=3, gzip_every=0), corpus)
    wh = Warehouse(cli_env["TRAJWH_WAREHOUSE"])
    cmd = [*trajwh_cmd(), "ingest", str(corpus), "--source", "synthetic", "--flush-mb", "0.5"]
    proc = subprocess.Popen(cmd, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    parts = wh.root / "raw" / "raw_records"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if parts.is_dir() and any(p.name.startswith("part-") for p in parts.iterdir()):
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "ingest finished before it could be killed"
    written = [p for p in parts.iterdir() if p.name.startswith("part-")]
    assert written, "the kill was meant to land after some data files were written"

    # the warehouse is readable and shows no partial batch
    assert _count(wh, "SELECT count(*) FROM raw_records") == 0
    assert _count(wh, "SELECT count(*) FROM batches") == 0

    # the same ingest again completes, removes the orphans, stores every record once
    done = subprocess.run(cmd, env=cli_env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "1500 new, 0 already present" in done.stdout
    assert _count(wh, "SELECT count(*) FROM raw_records") == 1500
    assert _count(wh, "SELECT count(DISTINCT record_id) FROM raw_records") == 1500
    listed = {p.name for p in wh.files("raw_records")}
    on_disk = {p.name for p in parts.iterdir()}
    assert on_disk == listed, "orphaned files of the killed batch were not collected"


def test_second_writer_fails_clearly_when_it_cannot_wait(tmp_path, cli_env, cases):
    wh = Warehouse(cli_env["TRAJWH_WAREHOUSE"])
    with wh.write_session("test-holder"):
        r = subprocess.run([*trajwh_cmd(), "ingest", str(cases / "two_episodes.jsonl"), "--wait", "1"],
                           env=cli_env, capture_output=True, text=True)
    assert r.returncode == 3
    assert "busy" in r.stderr and f"pid {os.getpid()}" in r.stderr and "test-holder" in r.stderr
    assert _count(wh, "SELECT count(*) FROM raw_records") == 0


def test_two_ingests_at_once_both_land(tmp_path, cli_env):
    a, b = tmp_path / "a", tmp_path / "b"
    generate_corpus(SynthConfig(episodes=300, seed=11), a)
    generate_corpus(SynthConfig(episodes=300, seed=12), b)
    procs = [subprocess.Popen([*trajwh_cmd(), "ingest", str(p), "--source", p.name, "--wait", "120"],
                              env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for p in (a, b)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    wh = Warehouse(cli_env["TRAJWH_WAREHOUSE"])
    assert _count(wh, "SELECT count(*) FROM raw_records") == 600
    assert _count(wh, "SELECT count(*) FROM batches") == 2
    assert _count(wh, "SELECT sum(rows) FROM table_files WHERE table_name = 'raw_records'") == 600
