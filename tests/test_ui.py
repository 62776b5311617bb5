"""`trajwh ui` serves the Dagster UI on 127.0.0.1 and stops on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request

from conftest import trajwh_cmd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ui_serves_on_loopback(cli_env, tmp_path):
    port = free_port()
    log = open(tmp_path / "ui.log", "wb")
    proc = subprocess.Popen(["env", "--default-signal=INT,TERM", *trajwh_cmd(), "ui", "--port", str(port)],
                            env=cli_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        body = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=2) as r:
                    body = r.read().decode()
                    break
            except OSError:
                time.sleep(1)
        assert body is not None, (tmp_path / "ui.log").read_text()[-3000:]
        assert "dagster_webserver_version" in body
        time.sleep(2)
        text = (tmp_path / "ui.log").read_text()
        assert "DeprecationWarning" not in text and "SupersessionWarning" not in text, text[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
