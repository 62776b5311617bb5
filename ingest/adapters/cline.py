"""Cline's task folder (``tasks/<task id>/``, also written by its forks Roo Code and Kilo Code).

The conversation is ``api_conversation_history.json``, read by the ``chat-messages`` adapter (its
results come back as ``[tool for 'x'] Result:`` text; see docs/adapters.md), with the task's id and
start time from the folder's name (the task id is the time it began, in milliseconds). The other
files of the folder are kept in ``raw`` as companions that give no facts: they are recognized, so
they are neither quarantined as an unknown format nor read as episodes.

- ``ui_messages.json``: what the extension showed (``ts``, ``type`` ``say`` / ``ask`` and their
  text): it repeats the conversation for the screen.
- ``task_metadata.json``: files in context, models used, environment history.
"""

from __future__ import annotations

import re
from pathlib import PurePath
from typing import Any

from trajwh.ingest.adapters.base import KeptFile

_UI_ROW = re.compile(rb'\{\s*"ts"\s*:\s*\d{10,}\s*,\s*"type"\s*:\s*"(?:say|ask)"')


class ClineUiMessagesAdapter(KeptFile):
    name = "cline-ui-messages"
    description = "Cline / Roo Code ui_messages.json beside a task's api_conversation_history.json (kept, not read)"

    def sniff(self, path: str, head: bytes) -> bool:
        return head.lstrip()[:1] == b"[" and bool(_UI_ROW.search(head))

    def check_record(self, obj: Any) -> str | None:
        ok = isinstance(obj, list) and all(isinstance(m, dict) and "ts" in m and "type" in m for m in obj)
        return None if ok else "expected an array of UI messages (ts, type say / ask)"


class ClineTaskMetadataAdapter(KeptFile):
    name = "cline-task-metadata"
    description = "Cline / Roo Code task_metadata.json (files in context, models used; kept, not read)"

    def sniff(self, path: str, head: bytes) -> bool:
        return head.lstrip()[:1] == b"{" and b'"files_in_context"' in head

    def check_record(self, obj: Any) -> str | None:
        return None if isinstance(obj, dict) and "files_in_context" in obj else "expected a task metadata object"


HISTORY_NAME = "api_conversation_history.json"


def task_of(file_path: str) -> tuple[str | None, int | None]:
    """A Cline history's task id (its folder's name) and, when that name is a time in milliseconds
    (as Cline names its tasks), that time; (None, None) for any other file."""
    path = PurePath(file_path)
    if path.name != HISTORY_NAME or not path.parent.name:
        return None, None
    name = path.parent.name
    return name, int(name) if name.isdigit() and 12 <= len(name) <= 14 else None
