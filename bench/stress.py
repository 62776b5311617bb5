"""`make stress`: hostile inputs, kills and SQL attacks against the CLI, with one summary.

Not part of `make test` (it takes several minutes). Three parts:

1. bad inputs: every case is a folder made here (record-level damage to the native format and
   to real-format files, file-system oddities); each runs `trajwh ingest` then `trajwh build`
   in a fresh warehouse, in a subprocess watched for tracebacks, hangs (timeout) and peak RSS;
2. kills: `trajwh ingest` and `trajwh build --full` SIGKILLed at random moments, then run to
   the end; the tables must equal a never-killed run's (lost, duplicated or diverged rows = 0);
3. SQL attacks through `trajwh sql`: every one must be refused.

    python bench/stress.py [--kills 20] [--out bench/out/stress.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from trajwh.lineage.catalog import Warehouse  # noqa: E402
from trajwh.synth.generator import SynthConfig, generate_corpus  # noqa: E402

TRAJWH = [sys.executable, "-m", "trajwh.pipelines.cli"] if not shutil.which("trajwh") else [shutil.which("trajwh")]
CORPUS = ROOT.parent / "shared" / "corpus"
EP = {"format": "trajwh.native", "episode_id": "e", "task": {"task_id": "t", "text": "fix"}, "policy": {"name": "p"},
      "harness": {"name": "h"}, "attempt": 1, "steps": [{"index": 0, "role": "user", "author": "harness", "text": "go"}]}


def _ep(**kv) -> bytes:
    e = json.loads(json.dumps(EP))
    for k, v in kv.items():
        node = e
        *parents, leaf = k.split(".")
        for p in parents:
            node = node[int(p)] if p.isdigit() else node.setdefault(p, {})
        node[int(leaf) if leaf.isdigit() else leaf] = v
    return json.dumps(e).encode()


def record_cases() -> dict[str, bytes]:
    """Native JSONL files, one kind of damage each (a good episode beside it must still land)."""
    good = _ep(episode_id="good") + b"\n"
    deep = b'{"format": "trajwh.native", "metadata": ' + b"[" * 20000 + b"]" * 20000 + b"}"
    c = {
        "int_over_64_bits": _ep(**{"usage.tokens_in": 2**70}),
        "int_over_64_bits_in_step": _ep(**{"steps.0.exit_code": -(2**65)}),
        "time_year_0_after_offset": _ep(started_at="0001-01-01T00:00:00+14:00"),
        "time_year_10000": _ep(ended_at="9999-12-31T23:59:59-14:00"),
        "time_not_a_time": _ep(started_at="yesterday"),
        "time_feb_30": _ep(started_at="2025-02-30T00:00:00Z"),
        "lone_surrogate_text": json.dumps(json.loads(_ep())).replace('"go"', '"\\ud800"').encode(),
        "lone_surrogate_key": _ep().replace(b'"text"', b'"\\udfff"', 1),
        "nan_literal": _ep().replace(b'"attempt": 1', b'"attempt": NaN'),
        "infinity_literal": _ep().replace(b'"attempt": 1', b'"attempt": Infinity'),
        "deeply_nested": deep,
        "truncated_json": _ep()[:40],
        "steps_is_object": _ep(steps={"0": {}}),
        "text_is_list": _ep(**{"steps.0.text": ["a", "b"]}),
        "tool_calls_is_string": _ep(**{"steps.0.tool_calls": "bash"}),
        "negative_index": _ep(**{"steps.0.index": -1}),
        "index_gap": _ep(**{"steps.0.index": 5}),
        "empty_object": b"{}",
        "null_record": b"null",
        "array_record": b"[1, 2, 3]",
        "string_record": b'"just a string"',
        "duplicate_keys": _ep()[:-1] + b', "attempt": 2}',
        "unknown_format_field": _ep(format="trajwh.native.v9"),
        "no_steps": _ep(steps=[]),
        "many_steps": _ep(steps=[{"index": i, "role": "user", "author": "harness", "text": "x"} for i in range(50_000)]),
        "invalid_utf8": _ep().replace(b"fix", b"f\xff\xfex"),
        "nul_bytes": _ep().replace(b"fix", b"f\\u0000x"),
        "raw_nul_byte": _ep().replace(b"fix", b"f\x00x"),
        "control_and_bidi_chars": _ep(**{"steps.0.text": "\x1b[31m\u202eevil\x07"}),
        "comments": b"// a comment\n" + _ep(),
        "trailing_comma": _ep()[:-1] + b",}",
        "single_quotes": _ep().replace(b'"', b"'"),
        "bom_mid_file": b"\xef\xbb\xbf" + _ep(),
        "cr_only_line_ends": _ep(episode_id="a") + b"\r" + _ep(episode_id="b"),
        "whitespace_megaline": b" " * 5_000_000,
        "blank_lines_million": b"\n" * 1_000_000,
        "oversize_record": _ep(**{"steps.0.text": "x" * 40_000_000}),
        "huge_float": _ep(**{"outcome.reward": 1e308}),
        "emoji_and_rtl": _ep(**{"steps.0.text": "🙂 שלום مرحبا \U0001F600" * 1000}),
        "key_with_dots_and_quotes": _ep(**{"metadata": {"a.b\"c": 1, "": 2}}),
    }
    return {k: good + v + b"\n" for k, v in c.items()}


def format_cases() -> dict[str, bytes | tuple[str, bytes]]:
    """Real-format files damaged: structure broken in ways an adapter could trip on."""
    out: dict[str, bytes | tuple[str, bytes]] = {}
    out["claude_garbage_lines"] = ("s.jsonl", b'{"type": "user", "sessionId": "s", "message": {"role": "user", "content": 5}}\n'
                                   b"not json\n" + b'{"type": "assistant", "message": null}\n')
    out["codex_non_objects"] = ("rollout-2025-01-01T00-00-00-x.jsonl", b'{"type": "session_meta", "payload": 3}\n[1,2]\n"s"\n')
    out["openhands_history_string"] = ("output.jsonl", b'{"instance_id": "x", "history": "oops", "instruction": "y"}\n')
    out["openhands_events_mixed"] = ("events.json", b'[{"source": "agent", "timestamp": "x", "action": 5}, 7, null]')
    out["swe_agent_no_history"] = ("a.traj", b'{"trajectory": [], "history": null, "info": 5}')
    out["swe_agent_bad_replay"] = ("b.traj", b'{"trajectory": [], "history": [], "replay_config": "[1, 2"}')
    out["mini_messages_null"] = ("x.traj.json", b'{"info": {"mini_version": "1.0"}, "messages": null, "trajectory_format": "mini-swe-agent-1"}')
    out["atif_steps_dict"] = ("trajectory.json", b'{"schema_version": "1.4", "steps": {"source": "user"}, "session_id": 1}')
    out["aider_binary"] = (".aider.chat.history.md", b"# aider chat started at 2025-01-01 00:00:00\n\x00\xff\xfe" * 100)
    out["gzip_truncated"] = ("t.jsonl.gz", gzip.compress(_ep() * 200)[:300])
    out["gzip_of_garbage"] = ("g.jsonl.gz", gzip.compress(os.urandom(50_000)))
    out["gzip_bomb_spaces"] = ("bomb.jsonl.gz", gzip.compress(b" " * 300_000_000, compresslevel=9))
    out["empty_file"] = ("empty.jsonl", b"")
    out["empty_gzip"] = ("empty.jsonl.gz", gzip.compress(b""))
    out["random_bytes"] = ("r.jsonl", os.urandom(100_000))
    out.update(container_cases())
    if CORPUS.is_dir():
        rng = random.Random(5)
        for p in sorted(CORPUS.rglob("*.json*"))[:6]:
            data = p.read_bytes()
            cut = data[: rng.randrange(1, len(data))]
            out[f"corpus_cut_{p.stem[:20]}"] = (p.name, cut)
    return out


def container_cases() -> dict[str, tuple[str, bytes]]:
    """Containers and the newer formats damaged: Parquet, zip (Inspect .eval), zstd / xz / bzip2 cut
    short, and odd shapes of the Inspect, Trae Agent, headless Claude Code / Codex and message-per-line
    formats."""
    import bz2
    import io
    import lzma
    import zipfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": "fix it"},
                                        {"role": "assistant", "content": "done " * 50}]} for i in range(200)]
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf, row_group_size=20)
    parquet = buf.getvalue()
    foreign = io.BytesIO()
    pq.write_table(pa.table({"x": list(range(100)), "y": ["a"] * 100}), foreign)
    jsonl = b"\n".join(json.dumps(r).encode() for r in rows) + b"\n"
    sample = {"id": 1, "epoch": 1, "input": "q", "messages": [{"role": "user", "content": "q"},
                                                            {"role": "assistant", "content": "a"}],
              "scores": {"s": {"value": float("nan")}}}
    header = {"version": 2, "status": "success", "eval": {"run_id": "r", "task_id": "t", "task": "x", "model": "m"}}

    def archive(members: dict[str, bytes], method: int = zipfile.ZIP_DEFLATED) -> bytes:
        z = io.BytesIO()
        with zipfile.ZipFile(z, "w", method) as f:
            for name, data in members.items():
                f.writestr(name, data)
        return z.getvalue()

    good_eval = archive({"header.json": json.dumps(header).encode(),
                         **{f"samples/{i}_epoch_1.json": json.dumps({**sample, "id": i}).encode() for i in range(5)}})
    crc = bytearray(archive({"header.json": json.dumps(header).encode(),
                             "samples/1_epoch_1.json": json.dumps(sample).encode(),
                             "samples/2_epoch_1.json": json.dumps({**sample, "id": 2}).encode()}, zipfile.ZIP_STORED))
    at = crc.rindex(b'"id": 2')
    crc[at:at + 2] = b"XX"
    zstd = pa.compress(jsonl, codec="zstd", asbytes=True)  # (pyarrow's codec, as ingest reads it)
    return {
        "parquet_cut": ("train.parquet", parquet[: len(parquet) // 2]),
        "parquet_no_footer_magic": ("train.parquet", parquet[:-8]),
        "parquet_foreign_columns": ("data.parquet", foreign.getvalue()),
        "zip_eval_cut": ("run.eval", good_eval[: len(good_eval) // 2]),
        "zip_eval_crc_damaged": ("run.eval", bytes(crc)),
        "zip_not_an_eval": ("data.zip", archive({"notes.txt": b"hello", "a/b.bin": os.urandom(2000)})),
        "zstd_cut": ("rows.jsonl.zst", zstd[: len(zstd) // 2]),
        "xz_cut": ("rows.jsonl.xz", lzma.compress(jsonl)[:-40]),
        "bz2_cut": ("rows.jsonl.bz2", bz2.compress(jsonl)[:-40]),
        "row_array_cut": ("rows.json", json.dumps(rows).encode()[:9000]),
        "inspect_nan_score": ("log.json", json.dumps({**header, "samples": [sample]}).encode()),  # NaN as Python writes it
        "inspect_header_only": ("log0.json", json.dumps(header, indent=2).encode()),
        "inspect_samples_garbage": ("log2.json", json.dumps({**header, "samples": [5, {"epoch": "x", "messages": [1, {}]}]})
                                    .encode()),
        "trae_agent_garbage": ("trajectory_x.json", b'{"task": "t", "llm_interactions": [5, {"input_messages": "x", '
                               b'"response": [1]}], "agent_steps": {"a": 1}, "success": "yes"}'),
        "codex_exec_garbage": ("run.jsonl", b'{"type":"thread.started","thread_id":5}\n{"type":"item.completed","item":'
                               b'{"id":1,"type":"command_execution","command":["ls"],"exit_code":"x"}}\nnot json\n'
                               b'{"type":"turn.completed","usage":{"input_tokens":"many"}}\n'),
        "claude_stream_odd": ("stream.jsonl", b'{"type":"system","subtype":"init","session_id":"s","model":5}\n'
                              b'{"type":"assistant","message":{"id":"m","content":"text","usage":{"output_tokens":"x"}},'
                              b'"parent_tool_use_id":null,"session_id":"s"}\n{"type":"result","subtype":7,"total_cost_usd":"1"}\n'),
        "message_lines_garbage": ("conversation.jsonl", b'{"role": "user", "content": "hi"}\nnot json\n[1]\n'
                                  b'{"role": "assistant", "content": {"weird": true}}\n'),
    }


def fs_cases(base: Path) -> dict[str, Path]:
    """File-system oddities, each in its own folder beside one good file."""
    out = {}
    for name in ("fifo", "symlink_loop", "dangling_symlink", "dir_named_jsonl", "non_utf8_name", "socket",
                 "unreadable", "vanishing_file"):
        d = base / name
        d.mkdir()
        (d / "good.jsonl").write_bytes(_ep(episode_id="good") + b"\n")
        if name == "fifo":
            os.mkfifo(d / "p.jsonl")
        elif name == "symlink_loop":
            (d / "a").symlink_to(d / "b")
            (d / "b").symlink_to(d / "a")
        elif name == "dangling_symlink":
            (d / "x.jsonl").symlink_to(d / "missing")
        elif name == "dir_named_jsonl":
            (d / "d.jsonl").mkdir()
        elif name == "non_utf8_name":
            (d / os.fsdecode(b"n\xff.jsonl")).write_bytes(_ep(episode_id="n") + b"\n")
        elif name == "socket":
            s = socket.socket(socket.AF_UNIX)
            s.bind(str(d / "s.jsonl"))
        elif name == "unreadable":
            f = d / "u.jsonl"
            f.write_bytes(_ep(episode_id="u") + b"\n")
            f.chmod(0)
        elif name == "vanishing_file":
            f = d / "v.jsonl"
            f.write_bytes(_ep(episode_id="v") + b"\n")
            (d / "z.jsonl").symlink_to(f)
            f.unlink()
        out[name] = d
    return out


def run_watched(args: list[str], env: dict[str, str], timeout: float) -> dict:
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ps = psutil.Process(proc.pid)
    peak, t0, hung = 0, time.monotonic(), False
    while proc.poll() is None:
        try:
            peak = max(peak, sum(p.memory_info().rss for p in [ps, *ps.children(recursive=True)]))
        except psutil.Error:
            pass
        if time.monotonic() - t0 > timeout:
            proc.kill()
            hung = True
            break
        time.sleep(0.05)
    out, err = proc.communicate()
    return {"rc": proc.returncode, "hung": hung, "traceback": "Traceback (most recent call last)" in err,
            "peak_mb": round(peak / 2**20), "err": err[-600:]}


def bad_inputs(tmp: Path) -> list[dict]:
    cases: dict[str, Path] = {}
    for name, data in record_cases().items():
        d = tmp / "rec" / name
        d.mkdir(parents=True)
        (d / "in.jsonl").write_bytes(data)
        cases[name] = d
    for name, spec in format_cases().items():
        d = tmp / "fmt" / name
        d.mkdir(parents=True)
        fname, data = spec if isinstance(spec, tuple) else ("in.jsonl", spec)
        (d / fname).write_bytes(data)
        cases[name] = d
    (tmp / "fs").mkdir()
    cases.update(fs_cases(tmp / "fs"))
    results = []
    for i, (name, folder) in enumerate(sorted(cases.items())):
        env = {**os.environ, "TRAJWH_WAREHOUSE": str(tmp / "wh" / name)}
        env.pop("TRAJWH_VAULT_KEY", None)
        env.pop("TRAJWH_VAULT_KEY_FILE", None)
        ing = run_watched([*TRAJWH, "ingest", str(folder), "--source", "stress"], env, 120)
        bld = run_watched([*TRAJWH, "build"], env, 300) if not ing["hung"] else {"rc": None, "hung": False,
                                                                                   "traceback": False, "peak_mb": 0}
        row = {"case": name, "ingest_rc": ing["rc"], "build_rc": bld["rc"], "hung": ing["hung"] or bld["hung"],
               "traceback": ing["traceback"] or bld["traceback"], "peak_mb": max(ing["peak_mb"], bld["peak_mb"])}
        if row["traceback"] or row["hung"] or (bld["rc"] not in (0, None)):
            row["err"] = (ing.get("err") or "") + (bld.get("err") or "")
        results.append(row)
        print(f"[{i + 1}/{len(cases)}] {name}: ingest {ing['rc']} build {bld['rc']} peak {row['peak_mb']} MB"
              f"{' TRACEBACK' if row['traceback'] else ''}{' HUNG' if row['hung'] else ''}", flush=True)
    return results


def _fingerprint(wh: Warehouse) -> dict[str, str]:
    from test_crash_and_concurrency import _fingerprint as fp

    return fp(wh)


def kills(tmp: Path, n: int) -> dict:
    corpus = tmp / "corpus"
    generate_corpus(SynthConfig(episodes=300, seed=9), corpus)
    env = {**os.environ, "TRAJWH_WAREHOUSE": str(tmp / "killed")}
    env.pop("TRAJWH_VAULT_KEY", None)
    env.pop("TRAJWH_VAULT_KEY_FILE", None)
    rng = random.Random(11)
    ingest_cmd = [*TRAJWH, "ingest", str(corpus), "--source", "s", "--flush-mb", "0.5"]
    for _ in range(n // 2):
        p = subprocess.Popen(ingest_cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, 2.0))
        p.send_signal(signal.SIGKILL)
        p.wait()
    subprocess.run(ingest_cmd, env=env, check=True, capture_output=True)
    from trajwh.redaction.vault import Vault

    Vault(Warehouse(env["TRAJWH_WAREHOUSE"]), None).salt()
    ref = tmp / "reference"
    shutil.copytree(env["TRAJWH_WAREHOUSE"], ref)
    ref_env = {**env, "TRAJWH_WAREHOUSE": str(ref)}
    t0 = time.monotonic()
    subprocess.run([*TRAJWH, "build"], env=ref_env, check=True, capture_output=True)
    full = time.monotonic() - t0
    for i in range(n):
        p = subprocess.Popen([*TRAJWH, "build", *(["--full"] if i % 2 else [])], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, full * 1.3))
        p.send_signal(signal.SIGKILL)
        p.wait()
    subprocess.run([*TRAJWH, "build"], env=env, check=True, capture_output=True)
    a, b = _fingerprint(Warehouse(env["TRAJWH_WAREHOUSE"])), _fingerprint(Warehouse(ref))
    raw = Warehouse(env["TRAJWH_WAREHOUSE"]).query(
        "SELECT count(*) AS n, count(DISTINCT record_id) AS d FROM raw_records").to_pylist()[0]
    return {"ingest_kills": n // 2, "build_kills": n, "raw_records": raw["n"], "raw_duplicates": raw["n"] - raw["d"],
            "raw_lost": 300 - raw["d"] if raw["d"] <= 300 else 0,
            "diverged_tables": sorted(t for t in a if a[t] != b[t])}


SQL_ATTACKS = [
    "COPY (SELECT * FROM steps) TO 'redacted/redacted_steps/evil.parquet' (FORMAT parquet)",
    "COPY redacted_steps TO '/tmp/evil.csv'", "EXPORT DATABASE '/tmp/evil-db'",
    "SELECT * FROM read_blob('vault/salt')", "SELECT * FROM read_blob('{root}/vault/salt')",
    "SELECT * FROM read_blob('normalized/../vault/salt')", "SELECT * FROM read_text('/etc/passwd')",
    "SELECT * FROM glob('/*')", "SELECT * FROM read_blob('catalog.duckdb')",
    "SELECT 1; COPY (SELECT 1) TO '/tmp/evil2.csv'", "ATTACH '/tmp/evil.db' AS x", "SET enable_external_access = true",
    "INSTALL httpfs", "LOAD httpfs", "PRAGMA database_list", "CREATE TABLE t AS SELECT 1", "DELETE FROM batches",
    "DROP VIEW steps", "CALL pragma_version()", "SELECT * FROM read_csv('/etc/hosts')",
    "SELECT * FROM read_parquet('https://example.com/x.parquet')", "UPDATE runs SET status = 'x'",
]


def sql_attacks(tmp: Path) -> dict:
    env = {**os.environ, "TRAJWH_WAREHOUSE": str(tmp / "reference")}
    blocked, leaked = 0, []
    for q in SQL_ATTACKS:
        r = subprocess.run([*TRAJWH, "sql", q.format(root=env["TRAJWH_WAREHOUSE"])], env=env, capture_output=True, text=True)
        if r.returncode != 0 and "Traceback" not in r.stderr:
            blocked += 1
        else:
            leaked.append(q)
    return {"tried": len(SQL_ATTACKS), "blocked": blocked, "not_blocked": leaked}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "stress.json"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="trajwh-stress-"))
    t0 = time.monotonic()
    try:
        bad = bad_inputs(tmp)
        k = kills(tmp, args.kills)
        sq = sql_attacks(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = {
        "bad_inputs": {"kinds": len(bad), "handled": sum(1 for r in bad if not r["traceback"] and not r["hung"]
                                                        and r["build_rc"] in (0, None)),
                       "tracebacks": sum(r["traceback"] for r in bad), "hangs": sum(r["hung"] for r in bad),
                       "max_peak_mb": max(r["peak_mb"] for r in bad),
                       "worst": sorted(bad, key=lambda r: -r["peak_mb"])[:3]},
        "kills": k, "sql": sq, "seconds": round(time.monotonic() - t0)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "cases": bad}, indent=2, default=str))
    b = summary["bad_inputs"]
    print(f"\nbad inputs: {b['kinds']} kinds, {b['handled']} handled cleanly, {b['tracebacks']} tracebacks, "
          f"{b['hangs']} hangs, peak {b['max_peak_mb']} MB (worst: "
          + ", ".join(f"{w['case']} {w['peak_mb']} MB" for w in b["worst"]) + ")")
    print(f"kills: ingest {k['ingest_kills']}, build {k['build_kills']}; raw duplicated {k['raw_duplicates']}, "
          f"lost {k['raw_lost']}; tables diverged from a clean build: {k['diverged_tables'] or 'none'}")
    print(f"sql attacks: {sq['blocked']}/{sq['tried']} blocked{'; NOT blocked: ' + str(sq['not_blocked']) if sq['not_blocked'] else ''}")
    print(f"{summary['seconds']} s; details in {args.out}")
    for r in bad:
        if r.get("err"):
            print(f"--- {r['case']}:\n{r['err']}")


if __name__ == "__main__":
    main()
