"""The vault: placeholder -> original value, encrypted, owner-only, apart from the layers.

The key is a Fernet key (AES-128-CBC + HMAC-SHA256, from the ``cryptography`` package) taken
from ``$TRAJWH_VAULT_KEY`` or the file named by ``$TRAJWH_VAULT_KEY_FILE``; ``trajwh vault
init-key`` makes one. Without a key nothing is written to the vault (the redacted layer is built
all the same, and the command says so). Vault files live under ``<warehouse>/vault/<batch>/``
(folder 0700, files 0600), are not in the catalog, and are read only by ``trajwh vault reveal``.
The placeholder salt (``vault/salt``) makes placeholder ids unguessable and stable across builds.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from trajwh.lineage.catalog import Warehouse, now_utc
from trajwh.lineage.storage import ensure_dir, write_bytes_atomic, write_parquet
from trajwh.schemas.arrow import arrow_schema
from trajwh.schemas.errors import ConfigError
from trajwh.schemas.tables import VaultRow

ENV_KEY = "TRAJWH_VAULT_KEY"
ENV_KEY_FILE = "TRAJWH_VAULT_KEY_FILE"


def load_key() -> bytes | None:
    """The vault key from the environment, or None when none is configured."""
    if os.environ.get(ENV_KEY):
        return os.environ[ENV_KEY].strip().encode()
    path = os.environ.get(ENV_KEY_FILE)
    if path:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ConfigError(f"vault key file {path!r} does not exist", valid=f"a file made by `trajwh vault init-key` ({ENV_KEY_FILE})")
        return p.read_bytes().strip()
    return None


def new_key_file(path: str | os.PathLike[str]) -> Path:
    from cryptography.fernet import Fernet

    p = Path(path).expanduser()
    if p.exists():
        raise ConfigError(f"{p} exists; refusing to overwrite a vault key", valid="a new path")
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(Fernet.generate_key() + b"\n")
    return p


class Vault:
    def __init__(self, wh: Warehouse, key: bytes | None):
        self.root = wh.root / "vault"
        self.key = key
        self._fernet = None
        if key is not None:
            from cryptography.fernet import Fernet

            try:
                self._fernet = Fernet(key)
            except (ValueError, TypeError) as exc:
                raise ConfigError("the vault key is not a valid Fernet key", where=ENV_KEY,
                                  valid="32 url-safe base64-encoded bytes, as `trajwh vault init-key` writes") from exc

    @property
    def enabled(self) -> bool:
        return self._fernet is not None

    def salt(self) -> bytes:
        """The warehouse's placeholder salt (made on first use, owner-only). Made without replacing
        one made meanwhile: two per-batch runs redacting at once must use the same salt."""
        ensure_dir(self.root, restricted=True)
        path = self.root / "salt"
        if not path.exists():
            tmp = self.root / f".salt-{os.getpid()}-{secrets.token_hex(4)}"
            write_bytes_atomic(secrets.token_bytes(32), tmp, restricted=True)
            try:
                os.link(tmp, path)  # fails when another process made it first: that one is kept
            except FileExistsError:
                pass
            finally:
                tmp.unlink(missing_ok=True)
        return path.read_bytes()

    CHECK = b"trajwh-vault-key-check"

    def check_key(self) -> None:
        """Fail clearly when the configured key is not the one this vault was written with (a
        build would otherwise split the vault between two keys). The first write records a
        check value encrypted with the key; a vault from before that is checked on an entry."""
        if not self.enabled:
            return
        from cryptography.fernet import InvalidToken

        check = self.root / "key-check"
        token = check.read_bytes() if check.exists() else None
        if token is None:
            sample = next(iter(sorted(self.root.glob("*/part-*.parquet"))), None)
            if sample is None:
                ensure_dir(self.root, restricted=True)
                write_bytes_atomic(self._fernet.encrypt(self.CHECK), check, restricted=True)
                return
            token = pq.read_table(sample, columns=["ciphertext"]).column(0)[0].as_py()
        try:
            self._fernet.decrypt(token)
        except InvalidToken:
            raise ConfigError(
                f"the vault key does not open the vault of {self.root.parent}: it was written with another key",
                where=ENV_KEY_FILE if os.environ.get(ENV_KEY_FILE) else ENV_KEY,
                valid="the key this vault was written with; to change keys run `trajwh vault rotate --new-key-file F`"
                      " with the old key configured") from None
        if not check.exists():
            write_bytes_atomic(self._fernet.encrypt(self.CHECK), check, restricted=True)

    def rotate(self, new_key: bytes) -> int:
        """Re-encrypt every entry with ``new_key`` (batch by batch, each folder swapped whole);
        returns the number of entries. The old key must be the configured one."""
        from cryptography.fernet import Fernet

        self.check_key()
        new = Fernet(new_key)
        n = 0
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            rows = [r for path in sorted(folder.glob("part-*.parquet")) for r in pq.read_table(path).to_pylist()]
            for r in rows:
                r["ciphertext"] = new.encrypt(self._fernet.decrypt(r["ciphertext"]))
            self._swap(folder.name, rows)
            n += len(rows)
        write_bytes_atomic(new.encrypt(self.CHECK), self.root / "key-check", restricted=True)
        self._fernet, self.key = new, new_key
        return n

    def _swap(self, batch_id: str, rows: list[dict]) -> Path:
        folder = self.root / batch_id
        staging = self.root / f".{batch_id}.new"
        shutil.rmtree(staging, ignore_errors=True)
        ensure_dir(staging, restricted=True)
        if rows:
            write_parquet("vault", pa.Table.from_pylist(rows, schema=arrow_schema(VaultRow)), staging, restricted=True)
        old = self.root / f".{batch_id}.old"
        shutil.rmtree(old, ignore_errors=True)
        if folder.exists():
            folder.rename(old)
        staging.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
        return folder

    def write_batch(self, batch_id: str, entries: list[dict]) -> Path | None:
        """Replace the vault entries of one batch; values are encrypted here."""
        if not self.enabled:
            return None
        rows = [{"placeholder": e["placeholder"], "scope_kind": e["scope_kind"], "scope_id": e["scope_id"],
                 "entity_type": e["entity_type"], "ciphertext": self._fernet.encrypt(e["value"].encode()),
                 "policy_version": e["policy_version"], "created_at": now_utc()} for e in entries]
        return self._swap(batch_id, rows)

    def reveal(self, placeholder: str, scope_id: str | None = None) -> list[dict]:
        if not self.enabled:
            raise ConfigError("no vault key: cannot reveal", valid=f"set {ENV_KEY} or {ENV_KEY_FILE}")
        out = []
        for path in sorted(self.root.glob("*/part-*.parquet")):
            table = pq.read_table(path, filters=[("placeholder", "=", placeholder)])
            for row in table.to_pylist():
                if scope_id and not row["scope_id"].startswith(scope_id):
                    continue
                from cryptography.fernet import InvalidToken

                try:
                    value = self._fernet.decrypt(row["ciphertext"]).decode()
                except InvalidToken:
                    raise ConfigError("the vault key does not decrypt this vault", valid="the key the vault was written with") from None
                out.append({"placeholder": placeholder, "scope_kind": row["scope_kind"], "scope_id": row["scope_id"],
                            "entity_type": row["entity_type"], "value": value})
        return out
