"""`trajwh redact-text` and `trajwh vault`: the redaction layer from the command line."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from trajwh.lineage.catalog import Warehouse
from trajwh.pipelines import render
from trajwh.pipelines.cli import handle_errors, main, warehouse_option
from trajwh.schemas.errors import ConfigError

# --- redaction -----------------------------------------------------------------------------------


@main.command("redact-text")
@click.argument("src", type=click.Path(exists=True, dir_okay=False))
@click.argument("dst", type=click.Path(dir_okay=False))
@click.option("--salt", envvar="TRAJWH_REDACT_SALT", default=None,
              help="Placeholder salt (default: the warehouse's salt when --warehouse names an existing warehouse, "
                   "so ids match its redacted layer; else a random one per run).")
@warehouse_option
@handle_errors
def redact_text(src: str, dst: str, salt: str | None, warehouse: str | None) -> None:
    """Redact free text: each input line {"id", "text"} becomes {"id", "redacted_text"}; one line = one scope."""
    import secrets as _secrets

    import orjson
    from trajwh.redaction.engine import Redactor
    from trajwh.schemas.errors import InputFormatError

    wh = Warehouse(warehouse)
    if salt:
        key = salt.encode()
    elif warehouse and wh.exists():
        from trajwh.redaction.vault import Vault

        key = Vault(wh, None).salt()
    else:
        key = _secrets.token_bytes(32)
    red = Redactor(key)
    n = replaced = 0
    lines = Path(src).read_bytes().splitlines()
    with open(dst, "wb") as out, render.count_progress("redacting", len(lines)) as advance:
        for line_no, line in enumerate(lines, start=1):
            advance(1)
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
                ident, text = obj["id"], obj["text"]
                if not isinstance(text, str):
                    raise TypeError("text is not a string")
            except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
                raise InputFormatError(f"line is not a {{\"id\", \"text\"}} object ({exc})", where=f"{src}:{line_no}",
                                       valid='one JSON object per line with "id" and a string "text"') from None
            events: list = []
            out.write(orjson.dumps({"id": ident, "redacted_text": red.text(text, red.scope(str(ident)), "text", events)}) + b"\n")
            n += 1
            replaced += len(events)
    render.console.print(f"redacted {n} texts ({replaced} replacements) into {dst}")


@main.group()
def vault() -> None:
    """The encrypted placeholder vault (needs $TRAJWH_VAULT_KEY or $TRAJWH_VAULT_KEY_FILE)."""


@vault.command("init-key")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Where to write the new key (0600).")
@handle_errors
def vault_init_key(out: str) -> None:
    """Create a new vault key file; point $TRAJWH_VAULT_KEY_FILE at it before building."""
    from trajwh.redaction.vault import new_key_file

    path = new_key_file(out)
    render.console.print(f"wrote a new vault key to {path}\nexport TRAJWH_VAULT_KEY_FILE={path}")


@vault.command("reveal")
@click.argument("placeholder")
@click.option("--scope", default=None, help="Only this scope id (e.g. a trajectory key or its prefix).")
@warehouse_option
@handle_errors
def vault_reveal(placeholder: str, scope: str | None, warehouse: str | None) -> None:
    """Print the original value behind a placeholder (needs the vault key)."""
    from trajwh.redaction.vault import Vault, load_key

    wh = Warehouse(warehouse)
    wh.require()
    found = Vault(wh, load_key()).reveal(placeholder, scope)
    if not found:
        render.err_console.print(f"no vault entry for {placeholder}")
        sys.exit(1)
    for f in found:
        click.echo(f"{f['placeholder']}\t{f['scope_kind']}:{f['scope_id']}\t{f['entity_type']}\t{f['value']}")


@vault.command("rotate")
@click.option("--new-key-file", required=True, type=click.Path(dir_okay=False, exists=True),
              help="The new key (make it with `trajwh vault init-key`); the old key stays configured for this run.")
@warehouse_option
@handle_errors
def vault_rotate(new_key_file: str, warehouse: str | None) -> None:
    """Re-encrypt every vault entry with a new key; then point TRAJWH_VAULT_KEY_FILE at it."""
    from trajwh.redaction.vault import Vault, load_key

    wh = Warehouse(warehouse)
    wh.require()
    old = load_key()
    if old is None:
        raise ConfigError("no current vault key configured", valid="set TRAJWH_VAULT_KEY or TRAJWH_VAULT_KEY_FILE to the old key")
    with wh.write_session("vault-rotate"):
        n = Vault(wh, old).rotate(Path(new_key_file).expanduser().read_bytes().strip())
    render.console.print(f"re-encrypted {n} vault entries with the key in {new_key_file}; "
                         f"now set TRAJWH_VAULT_KEY_FILE={new_key_file}")

