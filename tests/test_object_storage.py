"""The warehouse's data files in object storage (issue 19): a real S3 server on loopback
(SeaweedFS, ``s3_server`` in conftest.py), credentials enforced; the same build on S3 and on a
local folder gives the same tables, row for row."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import trajwh_cmd
from test_incremental import rows
from trajwh.ingest import raw_store
from trajwh.ingest.raw_store import IngestOptions, ingest_paths
from trajwh.lineage.catalog import STORAGE_FILE, Warehouse
from trajwh.lineage.storage import ObjectPath, location_files, write_parquet
from trajwh.pipelines.definitions import PER_BATCH_KEYS, build
from trajwh.redaction.vault import Vault
from trajwh.schemas.arrow import PARQUET_TABLES
from trajwh.schemas.errors import ConfigError


def _bucket(name: str) -> str:
    return f"s3://trajwh-{name}-{uuid.uuid4().hex[:8]}"


def test_object_paths_on_a_real_server(s3_env, s3_server):
    root = ObjectPath(_bucket("paths")) / "wh"
    f = write_parquet("t", pa.table({"a": [1, 2, 3]}), root / "layer" / "t", restricted=True)
    assert isinstance(f.path, ObjectPath) and str(f.path).startswith("s3://trajwh-paths-")
    assert f.path.name.startswith("part-") and f.path.suffix == ".parquet"
    assert f.path.exists() and f.path.stat().st_size == f.size
    assert f.path.relative_to(root) == f"layer/t/{f.path.name}"
    assert list((root / "layer" / "t").iterdir()) == [f.path]
    assert pq.read_table(f.path).column("a").to_pylist() == [1, 2, 3]  # pyarrow opens it by its URI
    assert f.path.read_bytes()[:4] == b"PAR1"
    # the server enforces its credentials: another secret is refused
    with pytest.raises(OSError, match="(?i)denied|forbidden|signature"):
        s3_server.filesystem(secret="not-the-secret").get_file_info(f.path.key)
    assert pickle.loads(pickle.dumps(f)) == f  # a worker process hands its written files back
    f.path.unlink()
    assert not f.path.exists()
    f.path.unlink(missing_ok=True)
    with pytest.raises(FileNotFoundError):
        f.path.stat()


def test_a_warehouse_on_s3_needs_credentials_and_keeps_its_place(tmp_path: Path, s3_env, monkeypatch, small_corpus):
    uri = _bucket("place")
    wh = Warehouse(tmp_path / "wh", data=uri)
    ingest_paths(wh, [small_corpus], IngestOptions(source="synthetic"))
    assert (wh.root / STORAGE_FILE).exists()
    assert not (wh.root / "raw").exists(), "a data file was written to the folder"
    # a later handle finds the data's place without being told; naming another is refused
    assert str(Warehouse(wh.root).data) == uri
    with pytest.raises(ConfigError, match="keeps its data in"):
        _ = Warehouse(wh.root, data=_bucket("other")).data
    with pytest.raises(ConfigError, match="cannot be moved"):
        local = Warehouse(tmp_path / "local")
        ingest_paths(local, [small_corpus], IngestOptions(source="synthetic"))
        _ = Warehouse(local.root, data=uri).data
    with pytest.raises(ConfigError, match="the warehouse is a folder or an s3:// URI"):
        Warehouse("gs://bucket/x")  # an error, not a local folder named "gs:"
    assert Warehouse(uri).replica_of == uri  # read from the catalog the writer publishes (below)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(ConfigError, match="AWS_SECRET_ACCESS_KEY"):
        Warehouse(wh.root).query("SELECT count(*) FROM raw_records")


def test_an_unlisted_object_is_collected_by_the_next_writer(tmp_path: Path, s3_env, small_corpus):
    wh = Warehouse(tmp_path / "wh", data=_bucket("gc"))
    ingest_paths(wh, [small_corpus], IngestOptions(source="synthetic"))
    stray = write_parquet("episodes", pa.table({"x": [1]}), wh.table_dir("episodes"), restricted=True)
    assert stray.path.exists()
    with wh.write_session("test") as session:
        assert stray.path in session.collect_garbage() or not stray.path.exists()
    assert not stray.path.exists()
    assert wh.query("SELECT count(*) FROM raw_records").column(0)[0].as_py() == 150


def ingest_twice(warehouses: list[Warehouse], corpus: Path) -> None:
    """The same files ingested into each warehouse with the same batch id (random per ingest
    otherwise); nothing else is made the same (run ids stay random)."""
    fixed = datetime(2026, 1, 1, tzinfo=UTC)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(raw_store, "now_utc", lambda: fixed)
        mp.setattr(raw_store.uuid, "uuid4", lambda: uuid.UUID(int=7))
        for wh in warehouses:
            ingest_paths(wh, [corpus], IngestOptions(source="synthetic"))


def same_rows(wh: Warehouse, table: str) -> list[str]:
    """``rows`` without the run that made a lineage edge either."""
    return rows(wh, table, extra=("run_id",))


def test_the_build_on_s3_equals_the_build_on_a_local_folder(tmp_path: Path, s3_env, monkeypatch, small_corpus):
    local, remote = Warehouse(tmp_path / "local"), Warehouse(tmp_path / "remote", data=_bucket("build"))
    ingest_twice([local, remote], small_corpus)
    Vault(local, None).salt()  # one placeholder salt for both
    shutil.copytree(local.root / "vault", remote.root / "vault")
    build(str(local.root))
    # on S3 with the per-batch stages in worker processes (written files come back by pickle)
    import trajwh.dedup.layer as curate_layer
    import trajwh.ingest.normalize as normalize_layer
    import trajwh.redaction.layer as redact_layer

    monkeypatch.setenv("TRAJWH_WORKERS", "2")
    monkeypatch.setenv("TRAJWH_MEMORY_MB", "65536")
    monkeypatch.setattr(redact_layer, "PARALLEL_MIN_EPISODES", 1)
    monkeypatch.setattr(curate_layer, "PARALLEL_MIN_ITEMS", 1)
    monkeypatch.setattr(normalize_layer, "PARALLEL_MIN_ITEMS", 1)
    # and the packs' tokens staged per batch first (pack_tokens partitions alone), then taken by the build
    before_packs = [k for k in PER_BATCH_KEYS if k != "pack_tokens"] + [
        "near_dup_clusters", "task_groups", "splits", "leak_flags", "license_facts", "eligibility", "outcomes",
        "task_stats", "fragments"]
    build(str(remote.root), only=before_packs)
    build(str(remote.root), only=["pack_tokens"])
    staged = remote.files("pack_tokens_staged")
    assert staged and all(isinstance(p, ObjectPath) and p.exists() for p in staged)
    last = build(str(remote.root))
    taken = {k: v.value for m in last.get_asset_materialization_events() if m.asset_key.to_user_string() == "pack_tokens"
             for k, v in m.materialization.metadata.items()}
    assert taken["chunks:staged_taken"] == len(staged) and taken["units_rendered"] == 0
    assert remote.files("pack_tokens_staged") == [] and {str(p) for p in staged} <= {str(p) for p in remote.files("pack_tokens")}
    assert remote.remote and not local.remote
    for table in PARQUET_TABLES:
        assert same_rows(local, table) == same_rows(remote, table), f"{table}: the build on S3 differs from the local one"
    assert same_rows(remote, "packs"), "nothing was packed: the comparison proved little"
    # every data file is in the bucket, none in the folder
    for table in PARQUET_TABLES:
        for path in remote.files(table):
            assert isinstance(path, ObjectPath) and path.exists()
    for layer in ("raw", "normalized", "redacted", "curated", "fragments", "packed", "lineage"):
        assert not (remote.root / layer).exists()


def test_the_cli_makes_a_warehouse_on_s3(tmp_path: Path, s3_env, cases):
    env = {**os.environ, **s3_env}
    uri = _bucket("cli")
    out = subprocess.run([*trajwh_cmd(), "ingest", str(cases / "two_episodes.jsonl"), "--warehouse",
                          str(tmp_path / "wh"), "--data", uri], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    out = subprocess.run([*trajwh_cmd(), "sql", "SELECT count(*) AS n FROM raw_records", "--warehouse",
                          str(tmp_path / "wh")], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert Warehouse(tmp_path / "wh").query("SELECT count(*) FROM raw_records").column(0)[0].as_py() > 0
    out = subprocess.run([*trajwh_cmd(), "status", "--warehouse", str(tmp_path / "wh")], env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0 and f"data {uri}" in out.stdout, out.stdout + out.stderr
    # a store that does not answer, or refuses the credentials: a clear error, no traceback
    for broken in ({"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, {"AWS_SECRET_ACCESS_KEY": "not-the-secret"}):
        for command in (["status"], ["sql", "SELECT count(*) FROM episodes"]):
            out = subprocess.run([*trajwh_cmd(), *command, "--warehouse", str(tmp_path / "wh")], env={**env, **broken},
                                 capture_output=True, text=True)
            assert out.returncode == 2 and "object store did not serve" in out.stderr, out.stderr[-2000:]
            assert "Traceback" not in out.stderr
    # the query guard holds on the bucket: the raw layer's objects are not readable without --restricted
    out = subprocess.run([*trajwh_cmd(), "sql", f"SELECT count(*) FROM read_parquet('{uri}/raw/raw_records/*.parquet')",
                          "--warehouse", str(tmp_path / "wh")], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "disabled by configuration" in out.stderr + out.stdout


def test_forget_on_s3_rewrites_objects_and_the_proof_reads_the_bucket(tmp_path: Path, s3_env, small_corpus):
    from trajwh.lineage.exports import run_export
    from trajwh.lineage.forget import _strings, forget, verify_forget
    from trajwh.lineage.impact import Selector, impact

    wh = Warehouse(tmp_path / "wh", data=_bucket("forget"))
    ingest_paths(wh, [small_corpus], IngestOptions(source="synthetic", license="MIT"))
    assert build(str(wh.root)).success
    before = {str(p) for t in PARQUET_TABLES for p in wh.files(t)}
    rec = wh.query("""SELECT r.payload, e.child_id AS key FROM raw_records r JOIN lineage_edges e
                      ON e.parent_id = r.record_id AND e.child_table = 'episodes' WHERE r.source = 'synthetic'
                      ORDER BY r.byte_length DESC LIMIT 1""").to_pylist()[0]
    payload = rec["payload"]
    # exports the tool writes to the bucket: a JSONL file and a Hugging Face folder (manifest last)
    exports = {"episodes": f"{wh.data}-exports/all.jsonl", "hf": f"{wh.data}-exports/hf"}
    run_export(wh, "episodes", {"fmt": "native", "out": exports["episodes"], "layer": "normalized"})
    run_export(wh, "hf", {"out": exports["hf"], "unit": "episodes", "splits": ["train", "valid", "test"]})
    assert rec["key"] in ObjectPath(exports["episodes"]).read_bytes().decode()
    hf = ObjectPath(exports["hf"])
    assert (hf / "manifest.json").exists() and any(o.name.endswith(".parquet") for o, _ in hf.walk())
    with pytest.raises(ConfigError, match="holds objects already"):
        run_export(wh, "hf", {"out": exports["hf"], "unit": "episodes"})
    assert sorted(impact(wh, Selector.parse(f"episode:{rec['key']}")).layers["exports"]["ids"]) == sorted(exports.values())
    result = forget(wh, f"episode:{rec['key']}", "a person asked to be forgotten")
    assert result.status == "verified", result.verify
    assert {e["path"]: e["status"] for e in result.exports} == {**dict.fromkeys(exports.values(), "regenerated"),
                                                                str(wh.root / "card"): "withdrawn"}
    assert rec["key"] not in ObjectPath(exports["episodes"]).read_bytes().decode()
    assert wh.query("SELECT count(*) FROM episodes WHERE trajectory_key = ?", [rec["key"]]).column(0)[0].as_py() == 0
    after = {str(p) for t in PARQUET_TABLES for p in wh.files(t)}
    gone = before - after
    assert gone and not any(ObjectPath(p).exists() for p in gone), "a replaced object is still in the bucket"
    # the proof names a manifest file as the bucket's listing does (a file older than the forgotten data
    # is then read for its digest alone: lineage.forget._scan)
    listed = location_files(str(wh.data))
    assert f"{wh.data}/_catalog/catalog.duckdb" in listed  # the published catalog was read by the proof too
    assert all(str(wh.data_path(p)) in listed for p in wh.query("SELECT path FROM table_files").column(0).to_pylist())
    # a copy of the forgotten text left in the bucket (outside the manifest) is found, by its URI
    request = wh.query("SELECT request_id FROM deletions").column(0)[0].as_py()
    stray = wh.data / "stray" / "copy.txt"
    stray.write_bytes("\n".join(_strings(payload)).encode())
    found = verify_forget(wh, request)
    assert found["probes"] > found["probes_shared"], found
    assert not found["ok"] and list(found["files_with_probes"]) == [str(stray)], found


def test_a_reader_elsewhere_needs_only_the_catalog_file(tmp_path: Path, s3_env, small_corpus, cli_env):
    """Another host's reader: a copy of ``catalog.duckdb`` and ``storage.json``, nothing else of the
    folder (no vault, no lock, no caches), and read credentials for the bucket."""
    wh = Warehouse(tmp_path / "wh", data=_bucket("reader"))
    ingest_paths(wh, [small_corpus], IngestOptions(source="synthetic"))
    reader = tmp_path / "elsewhere"
    reader.mkdir()
    for name in ("catalog.duckdb", STORAGE_FILE):
        shutil.copy(wh.root / name, reader / name)
    assert Warehouse(reader).query("SELECT count(*) FROM raw_records").column(0)[0].as_py() == 150
    assert Warehouse(reader).query("SELECT count(*) FROM splits").column(0)[0].as_py() == 0  # an empty table's view
    env = {**cli_env, **s3_env, "TRAJWH_WAREHOUSE": str(reader)}
    out = subprocess.run([*trajwh_cmd(), "sql", "SELECT count(*) AS n FROM episodes"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in reader.iterdir()) == ["catalog.duckdb", STORAGE_FILE]  # it wrote nothing


def test_a_warehouse_named_by_its_uri_is_read_from_the_catalog_its_writer_publishes(
        tmp_path: Path, s3_env, small_corpus, cases, cli_env, monkeypatch):
    """The writer host keeps the folder (catalog, lock, vault); each of its writes publishes the
    catalog under the data's URI. Another host names the warehouse by that URI alone: it reads the
    published catalog (fetched again when it changed) and the data objects, and writes nothing."""
    from trajwh.lineage.catalog import CATALOG_FILE, ENV_REPLICAS, REPLICA_DIR

    uri = _bucket("byuri")
    writer = Warehouse(tmp_path / "wh", data=uri)
    ingest_paths(writer, [small_corpus], IngestOptions(source="synthetic"))
    assert ObjectPath(uri) / REPLICA_DIR / CATALOG_FILE in [p for p, _ in ObjectPath(uri).walk()]
    monkeypatch.setenv(ENV_REPLICAS, str(tmp_path / "replicas"))
    reader = Warehouse(uri)
    assert reader.query("SELECT count(*) FROM raw_records").column(0)[0].as_py() == 150
    assert str(reader.root).startswith(str(tmp_path / "replicas"))
    import trajwh

    handle = trajwh.open(uri)  # the Python API the same way
    assert repr(handle) == f"trajwh.open({uri!r})"
    assert handle.sql("SELECT count(*) AS n FROM episodes").column(0)[0].as_py() == \
        writer.query("SELECT count(*) FROM episodes").column(0)[0].as_py()
    # a write through the URI is refused, naming the way; nothing is written to the bucket or the copy
    before = sorted(str(p) for p, _ in ObjectPath(uri).walk())
    with pytest.raises(ConfigError, match="named by its URI") as err:
        ingest_paths(Warehouse(uri), [cases / "two_episodes.jsonl"], IngestOptions(source="cases"))
    assert "--warehouse DIR" in err.value.valid
    with pytest.raises(ConfigError, match="named by its URI"):  # nor through the copy's folder
        ingest_paths(Warehouse(reader.root), [cases / "two_episodes.jsonl"], IngestOptions(source="cases"))
    assert sorted(str(p) for p, _ in ObjectPath(uri).walk()) == before
    # the writer writes again: a new reader sees it
    ingest_paths(writer, [cases / "two_episodes.jsonl"], IngestOptions(source="cases"))
    assert build(str(writer.root), only=list(PER_BATCH_KEYS)).success
    fresh = Warehouse(uri)
    assert fresh.query("SELECT count(*) FROM batches").column(0)[0].as_py() == 2
    assert fresh.query("SELECT count(*) FROM episodes").column(0)[0].as_py() == \
        writer.query("SELECT count(*) FROM episodes").column(0)[0].as_py() > 150
    # the command line takes the URI as --warehouse: reads work, a write exits 2 with the reason
    env = {**cli_env, **s3_env, ENV_REPLICAS: str(tmp_path / "replicas-cli")}
    out = subprocess.run([*trajwh_cmd(), "sql", "SELECT count(*) AS n FROM episodes", "--warehouse", uri],
                         env=env, capture_output=True, text=True)
    assert out.returncode == 0 and str(fresh.query("SELECT count(*) FROM episodes").column(0)[0].as_py()) in out.stdout, \
        out.stdout + out.stderr
    out = subprocess.run([*trajwh_cmd(), "build", "--warehouse", uri], env=env, capture_output=True, text=True)
    assert out.returncode == 2 and "named by its URI" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    # a URI with no published catalog: a clear error
    out = subprocess.run([*trajwh_cmd(), "status", "--warehouse", _bucket("nothing")], env=env, capture_output=True,
                         text=True)
    assert out.returncode == 2 and "no published catalog" in out.stderr, out.stderr[-2000:]
