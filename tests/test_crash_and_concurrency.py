"""A killed ingest leaves nothing visible and can be rerun; concurrent writers never corrupt."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from conftest import trajwh_cmd
from trajwh.lineage.catalog import Warehouse
from trajwh.synth.generator import SynthConfig, generate_corpus


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


# inputs_digest names the input files by their hashes (same rows from another run: other bytes)
_VOLATILE = ("_run_id", "run_id", "quarantined_at", "ingested_at", "vault_written", "inputs_digest")


def _fingerprint(wh: Warehouse) -> dict[str, str]:
    """Every table's content, run ids and wall-clock columns aside: equal fingerprints, equal data."""
    from trajwh.schemas.arrow import PARQUET_TABLES

    out = {}
    for table in PARQUET_TABLES:
        cols = [c for c in wh.query(f"SELECT * FROM {table} LIMIT 0").column_names if c not in _VOLATILE]
        # a global stage's version names its input files by their hashes: the same rows written by
        # another run are other bytes, so that digest is left out
        sel = ", ".join(f"regexp_replace(\"{c}\", 'inputs=[0-9a-f]+', '')" if c == "_transform_version" else f'"{c}"'
                        for c in cols)
        out[table] = wh.query(f"SELECT count(*) || ':' || coalesce(sum(hash(({sel}))), 0) FROM {table}").column(0)[0].as_py()
    return out


def test_build_killed_at_random_points_then_rebuilt_equals_a_clean_build(tmp_path, cli_env):
    """SIGKILL `trajwh build --full` at random moments (every stage gets hit over the runs), then a
    plain build: every table, lineage included, equals the never-killed build's."""
    import random
    import shutil

    corpus = tmp_path / "corpus"
    generate_corpus(SynthConfig(episodes=200, seed=5), corpus)
    wh = Warehouse(cli_env["TRAJWH_WAREHOUSE"])
    subprocess.run([*trajwh_cmd(), "ingest", str(corpus), "--source", "s"], env=cli_env, check=True, capture_output=True)
    from trajwh.redaction.vault import Vault

    Vault(wh, None).salt()  # one placeholder salt for both warehouses
    ref_root = tmp_path / "reference"
    shutil.copytree(wh.root, ref_root)
    ref_env = {**cli_env, "TRAJWH_WAREHOUSE": str(ref_root)}
    t0 = time.monotonic()
    subprocess.run([*trajwh_cmd(), "build"], env=ref_env, check=True, capture_output=True)
    full_time = max(2.0, time.monotonic() - t0)  # kills land anywhere from start-up to the last stage
    rng = random.Random(int(os.environ.get("TRAJWH_KILL_SEED", "7")))
    kills = int(os.environ.get("TRAJWH_BUILD_KILLS", "4"))
    for i in range(kills):
        proc = subprocess.Popen([*trajwh_cmd(), "build", *(["--full"] if i % 2 else [])], env=cli_env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.5, full_time * 1.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done = subprocess.run([*trajwh_cmd(), "build"], env=cli_env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    if os.environ.get("TRAJWH_KEEP_KILLED"):
        shutil.copytree(wh.root, os.environ["TRAJWH_KEEP_KILLED"] + "/killed", dirs_exist_ok=True)
        shutil.copytree(ref_root, os.environ["TRAJWH_KEEP_KILLED"] + "/reference", dirs_exist_ok=True)
    assert _fingerprint(wh) == _fingerprint(Warehouse(ref_root))
    gaps = wh.query("""SELECT count(*) FROM redacted_steps s LEFT JOIN (SELECT DISTINCT child_id FROM lineage_edges
                       WHERE child_table = 'redacted_steps') e ON e.child_id = s.step_id WHERE e.child_id IS NULL""")
    assert gaps.column(0)[0].as_py() == 0, "redacted steps without lineage edges"
    states = wh.query("SELECT status FROM runs").column(0).to_pylist()
    assert "succeeded" in states and all(s in ("succeeded", "running") for s in states)


def test_a_full_normalize_leaves_the_redaction_lineage_alone_and_a_lost_one_is_rebuilt(wh, cases, monkeypatch):
    """The normalize step owns only its own files (the redaction stage's versions embed the
    normalized version); and a redaction whose lineage files went missing is redone."""
    from trajwh.ingest.normalize import normalize_warehouse
    from trajwh.ingest.raw_store import IngestOptions, ingest_paths
    from trajwh.redaction.layer import redact_warehouse

    monkeypatch.delenv("TRAJWH_VAULT_KEY", raising=False)
    monkeypatch.delenv("TRAJWH_VAULT_KEY_FILE", raising=False)
    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="c"))
    normalize_warehouse(wh, run_id="n1")
    redact_warehouse(wh, run_id="r1")
    redact_edges = "SELECT count(*) FROM table_files WHERE table_name = 'lineage_edges' AND transform_version LIKE 'redact@%'"
    assert _count(wh, redact_edges) == 1
    normalize_warehouse(wh, run_id="n2", full=True)
    assert _count(wh, redact_edges) == 1, "a full normalize deleted the redaction stage's lineage files"
    with wh.write_session("test") as session:  # lose them, as a crash of another stage could
        paths = [wh.root / p for p in wh.query(redact_edges.replace("count(*)", "path")).column(0).to_pylist()]
        session.commit(removed=paths)
    assert _count(wh, redact_edges) == 0
    s = redact_warehouse(wh, run_id="r2")
    assert s.batches_done == 1 and _count(wh, redact_edges) == 1


def test_killed_runs_never_show_as_succeeded(wh):
    from trajwh.lineage.catalog import now_utc
    from trajwh.lineage.rebuild import mark_running
    from trajwh.lineage.status import run_state, warehouse_status

    with wh.write_session("test") as session:
        mark_running(session, "run-1", "build", now_utc())
    row = wh.query("SELECT * FROM runs").to_pylist()[0]
    assert row["status"] == "running" and run_state(row) == "running"  # this process is alive
    dead = subprocess.Popen(["true"])
    dead.wait()
    row["params"] = row["params"].replace(str(os.getpid()), str(dead.pid))
    assert run_state(row) == "interrupted"
    assert warehouse_status(wh)["runs"][0]["status"] == "running"


def test_a_catalog_creation_killed_half_way_is_invisible_and_cleaned(tmp_path, cli_env, cases):
    root = Warehouse(cli_env["TRAJWH_WAREHOUSE"]).root
    root.mkdir(parents=True)
    (root / ".catalog-4242.tmp").write_bytes(b"half a catalog")  # what a kill during creation leaves
    r = subprocess.run([*trajwh_cmd(), "status"], env=cli_env, capture_output=True, text=True)
    assert r.returncode == 2 and "no warehouse" in r.stderr and "Traceback" not in r.stderr
    ok = subprocess.run([*trajwh_cmd(), "ingest", str(cases / "two_episodes.jsonl")], env=cli_env,
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert not (root / ".catalog-4242.tmp").exists()


def test_the_cached_manifest_follows_every_commit(tmp_path, cli_env, cases):
    """Warehouse.manifest() is read once and kept (a build asks it dozens of times), but never
    outlives a change: another process's ingest, this process's commit; a write of this process
    that leaves table_files alone (a run row) keeps it."""
    from trajwh.ingest.raw_store import IngestOptions, ingest_paths
    from trajwh.lineage.rebuild import run_row

    wh = Warehouse(cli_env["TRAJWH_WAREHOUSE"])
    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="a"))
    first = wh.manifest()
    assert wh.manifest() is first  # kept
    with wh.write_session("test") as s:
        s.upsert_rows("runs", [run_row("r1", "test", first.column("added_at")[0].as_py(), params={}, counts={},
                                       code_version="")])
    assert wh.manifest() is first  # a run row leaves the manifest as it was
    r = subprocess.run([*trajwh_cmd(), "ingest", str(cases / "two_episodes.jsonl"), "--source", "b"], env=cli_env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    second = wh.manifest()  # another process committed
    assert second.num_rows > first.num_rows
    assert second.num_rows == wh.query("SELECT count(*) FROM table_files").column(0)[0].as_py()
    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="c"))  # this process committed
    third = wh.manifest()
    assert third.num_rows > second.num_rows
    assert wh.manifest_query("SELECT count(DISTINCT batch_id) AS n FROM table_files").column(0)[0].as_py() == 3


def test_catalog_reads_hold_nothing_between_questions_and_see_every_commit(tmp_path, cli_env, cases):
    """Warehouse.query reads through one DuckDB instance this process keeps (it attaches the
    catalog per question): between questions another process can open the catalog to write,
    its commit is seen by the next question, threads read at once, a forked child reads on its
    own, and this process's own writer opens the catalog after a read."""
    import threading

    from trajwh.ingest.raw_store import IngestOptions, ingest_paths

    wh = Warehouse(cli_env["TRAJWH_WAREHOUSE"])
    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="a"))
    count = "SELECT count(*) FROM table_files"
    before = wh.query(count).column(0)[0].as_py()
    # another process writes at once (a held file would make it wait, then fail: --wait 0)
    r = subprocess.run([*trajwh_cmd(), "ingest", str(cases / "two_episodes.jsonl"), "--source", "b", "--wait", "0"],
                       env=cli_env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    after = wh.query(count).column(0)[0].as_py()
    assert after > before  # its commit is seen
    answers, errors = [], []

    def ask() -> None:
        try:
            answers.extend(wh.query(count).column(0)[0].as_py() for _ in range(20))
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and answers == [after] * 80
    pid = os.fork()
    if pid == 0:  # the child must not use the parent's instance
        try:
            os._exit(0 if Warehouse(wh.root).query(count).column(0)[0].as_py() == after else 1)
        except BaseException:
            os._exit(2)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="c"))  # this process writes after reading
    assert wh.query(count).column(0)[0].as_py() > after


def test_a_catalog_reader_whose_detach_is_interrupted_still_lets_the_file_go(tmp_path, cli_env, cases):
    """Ctrl-C (any signal Python turns into an exception) can interrupt the statement that detaches
    the catalog after a question: the reader then closes its instance, so the file is not held by a
    process that lives on (a notebook), and the next question works."""

    from trajwh.ingest.raw_store import IngestOptions, ingest_paths
    from trajwh.lineage import catalog

    wh = Warehouse(cli_env["TRAJWH_WAREHOUSE"])
    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="a"))
    count = "SELECT count(*) FROM table_files"
    n = wh.query(count).column(0)[0].as_py()
    reader = catalog._READERS[(os.getpid(), str(wh.catalog_path))]

    reader.db = _Interrupted(reader.db)
    with pytest.raises(RuntimeError, match="interrupted"):
        wh.query(count)
    assert not reader.attached and not isinstance(reader.db, _Interrupted)
    assert _writer_can_open(wh.catalog_path)  # the file is not held
    assert wh.query(count).column(0)[0].as_py() == n


class _Interrupted:
    """A DuckDB instance whose DETACH is interrupted (a signal during the statement)."""

    def __init__(self, db):
        self.db = db

    def execute(self, sql, *args):
        if sql.startswith("DETACH"):
            raise RuntimeError("Query interrupted")
        return self.db.execute(sql, *args)

    def cursor(self):
        return self.db.cursor()

    def filesystem_is_registered(self, name):
        return self.db.filesystem_is_registered(name)

    def close(self):
        self.db.close()


def _writer_can_open(path) -> bool:
    """Whether another process can open the catalog file to write (nothing here holds it)."""
    import sys

    r = subprocess.run([sys.executable, "-c", "import duckdb, sys; duckdb.connect(sys.argv[1]).close()", str(path)],
                       capture_output=True, text=True, timeout=60)
    return r.returncode == 0


def test_catalog_connections_share_one_attachment_and_let_the_file_go(tmp_path, cli_env, cases):
    """Warehouse.connect attaches the catalog to an in-memory DuckDB instance this process keeps:
    connections open at once share the attachment (a write through one is seen by the other), one
    of the other mode is refused while they are open, the file is let go when the last closes (or
    is collected), the next attachment starts from the default settings, and a forked child opens
    its own."""
    import gc

    import duckdb
    from trajwh.ingest.raw_store import IngestOptions, ingest_paths
    from trajwh.schemas.errors import CatalogError

    wh = Warehouse(cli_env["TRAJWH_WAREHOUSE"])
    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="a"))
    a = wh.connect(read_only=False, manifest=False)
    b = wh.connect(read_only=False, manifest=False)
    a.execute("INSERT INTO meta VALUES ('test_shared', 'yes')")
    assert b.execute("SELECT value FROM meta WHERE key = 'test_shared'").fetchall() == [("yes",)]
    with pytest.raises(CatalogError, match="open for writing"):
        wh.connect(read_only=True)
    a.close()
    a.close()  # (a second close does nothing)
    assert not _writer_can_open(wh.catalog_path)  # b still holds it
    b.close()
    assert _writer_can_open(wh.catalog_path)
    assert wh.query("SELECT value FROM meta WHERE key = 'test_shared'").column(0).to_pylist() == ["yes"]
    with wh.connect() as c:
        c.execute("SET threads = 1")
        c.execute("SET memory_limit = '100MB'")
    default = duckdb.connect(":memory:").execute(
        "SELECT current_setting('threads'), current_setting('memory_limit')").fetchall()
    with wh.connect() as d:
        assert d.execute("SELECT current_setting('threads'), current_setting('memory_limit')").fetchall() == default
        # and what its queries freed goes back to the system between questions, not at the next one
        assert d.execute("SELECT current_setting('allocator_background_threads')").fetchall() == [(True,)]
    e = wh.connect(read_only=False, manifest=False)
    e.execute("SELECT 1")
    del e
    gc.collect()
    assert _writer_can_open(wh.catalog_path)  # a connection dropped without a close lets it go too
    wh.connect(read_only=False, manifest=False).execute("DELETE FROM meta WHERE key = 'test_shared'").close()
    assert _writer_can_open(wh.catalog_path)
    rel = wh.connect().sql("SELECT count(*) FROM meta WHERE key = 'test_shared'")  # the relation keeps it open
    gc.collect()
    assert rel.fetchall() == [(0,)] and not _writer_can_open(wh.catalog_path)
    del rel
    gc.collect()
    assert _writer_can_open(wh.catalog_path)
    pid = os.fork()
    if pid == 0:  # the child makes its own instance (the parent's kept ones are not used there)
        try:
            con = Warehouse(wh.root).connect()
            ok = con.execute("SELECT count(*) FROM meta WHERE key = 'schema_version'").fetchall() == [(1,)]
            con.close()
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def test_a_catalog_connection_whose_detach_is_interrupted_still_lets_the_file_go(tmp_path, cli_env, cases):
    """A signal can interrupt the DETACH that lets the catalog go after the last connection closes:
    the instance is then closed, so the file is not held by a process that lives on, and the next
    connection works."""
    from trajwh.ingest.raw_store import IngestOptions, ingest_paths

    wh = Warehouse(cli_env["TRAJWH_WAREHOUSE"])
    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="a"))
    con = wh.connect(read_only=False, manifest=False)
    slot = con._slot

    slot.db = _Interrupted(slot.db)
    with pytest.raises(RuntimeError, match="interrupted"):
        con.close()
    assert _writer_can_open(wh.catalog_path)
    with wh.connect() as again:
        assert again.execute("SELECT count(*) FROM table_files").fetchall()[0][0] > 0


def test_a_catalog_of_another_schema_version_is_refused_after_one_that_was_read(tmp_path, cases):
    """The schema version is asked once while the catalog's files stay as they were: a catalog
    changed since (here: a later major version) is refused at the next question, and a reader that
    was refused is refused again."""
    import duckdb
    from trajwh.ingest.raw_store import IngestOptions, ingest_paths
    from trajwh.schemas.errors import CatalogError

    wh = Warehouse(tmp_path / "wh")
    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="a"))
    assert _count(wh, "SELECT count(*) FROM raw_records") == 2  # (read: its version found readable)
    assert _count(wh, "SELECT count(*) FROM raw_records") == 2
    con = duckdb.connect(str(wh.catalog_path))
    con.execute("UPDATE meta SET value = '99.0' WHERE key = 'schema_version'")
    con.close()
    for _ in range(2):
        with pytest.raises(CatalogError, match="schema version 99.0"):
            wh.query("SELECT 1")
        with pytest.raises(CatalogError, match="schema version 99.0"):
            wh.connect(read_only=True)


def test_questions_inside_a_write_session_keep_the_catalog_attached_and_see_its_commits(tmp_path, cases, monkeypatch):
    """While this process holds the exclusive write lock, the catalog stays attached to its reader
    between questions (no other process can change it), is attached anew after this process's own
    writes (each question sees them), and is let go when the session ends; outside a session each
    question lets it go."""
    import trajwh.lineage.catalog as catalog
    from trajwh.ingest.raw_store import IngestOptions, ingest_paths

    wh = Warehouse(tmp_path / "wh")
    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="a"))
    attached = []
    real = catalog._attach_with_retry
    monkeypatch.setattr(catalog, "_attach_with_retry", lambda *a, **k: attached.append(1) or real(*a, **k))
    runs = "SELECT count(*) FROM runs WHERE job = 'kept-reader-test'"
    with wh.write_session("test") as session:
        attached.clear()  # (the session's start asked the manifest)
        for _ in range(3):
            assert _count(wh, runs) == 0
        assert len(attached) == 1  # once for the three questions
        assert not _writer_can_open(wh.catalog_path)  # (held: the session's lock keeps writers out anyway)
        for n in (1, 2):
            session.upsert_rows("runs", [{"run_id": f"r{n}", "job": "kept-reader-test", "status": "succeeded"}])
            assert _count(wh, runs) == n  # this process's write seen: attached anew
        assert len(attached) == 3
    assert _writer_can_open(wh.catalog_path)  # let go when the session ended
    for _ in range(2):
        assert _count(wh, runs) == 2
        assert _writer_can_open(wh.catalog_path)  # outside a session: let go after each question
    assert len(attached) == 5


def test_a_question_from_another_thread_waits_for_a_write_connection_and_the_other_way_round(tmp_path, cases):
    """The catalog file cannot be attached to the reader's instance and to a write connection's at
    once (within one process DuckDB refuses the second). A question from one thread waits while
    another thread has a write connection open, and a write connection waits for the questions
    other threads have open (a forget curates in a thread while it stores its request)."""
    import threading

    from trajwh.ingest.raw_store import IngestOptions, ingest_paths

    wh = Warehouse(tmp_path / "wh")
    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="a"))
    batches = _count(wh, "SELECT count(*) FROM batches")
    with wh.write_session("test"):
        answers: list[int] = []
        con = wh.connect(read_only=False)
        try:
            asker = threading.Thread(target=lambda: answers.append(_count(wh, "SELECT count(*) FROM batches")))
            asker.start()
            asker.join(0.5)
            assert asker.is_alive() and not answers  # waits for the write connection
        finally:
            con.close()
        asker.join(30)
        assert answers == [batches]
        # a question held open in one thread (a stream not read to its end): a write connection waits
        opened, release, wrote = threading.Event(), threading.Event(), []

        def hold() -> None:
            rows = wh.stream("SELECT * FROM range(100000)", batch_rows=10)
            next(rows)
            opened.set()
            release.wait(30)
            rows.close()

        def write() -> None:
            c = wh.connect(read_only=False)
            wrote.append(1)
            c.close()

        holder = threading.Thread(target=hold)
        holder.start()
        assert opened.wait(30)
        writer = threading.Thread(target=write)
        writer.start()
        writer.join(0.5)
        assert writer.is_alive() and not wrote
        release.set()
        for t in (holder, writer):
            t.join(30)
        assert wrote == [1]
