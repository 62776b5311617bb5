"""The adapter contract: one adapter per harness format (the registry is ``registry.py``).

An adapter answers three questions, at three costs:

- ``sniff(path, head)``: is this file mine? Called once per file on its first bytes.
- ``check_record(obj)``: is this parsed JSON record plausibly mine? Called at ingest on every
  record; cheap. A record that fails is quarantined with the reason, before it reaches ``raw``.
- ``parse(obj, ctx)``: the full conversion to canonical episodes and steps. Called by the
  normalizer; may raise ``InputFormatError`` (the record is then quarantined at the
  ``normalize`` stage, and the rest of the batch goes on).

``framing`` says how records are cut from a file: ``jsonl`` (one record per line) or
``document`` (the whole file is one record). Bumping ``version`` makes ``trajwh build``
regenerate the normalized rows of every batch that holds this format (the replay property).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import orjson


def _no_facts(kind: str, key: str) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class RecordContext:
    """Where a record came from, for messages and key fallbacks; and the companion facts.

    ``facts(kind, key)`` returns what companion files of the same source say about an episode,
    e.g. ``facts("instance_id", "django__django-16255")`` gives the verdict of a SWE-bench
    ``report.json``; ``facts("dir", folder)`` what a file beside the record says.
    """

    record_id: str
    source: str
    file_path: str
    line_no: int | None
    facts: Callable[[str, str], dict[str, Any]] = _no_facts

    def where(self) -> str:
        return f"{self.file_path}:{self.line_no}" if self.line_no is not None else self.file_path


@dataclass
class ParsedEpisode:
    """One episode as an adapter produced it: episode columns and step rows, no ids yet.

    ``episode`` holds the canonical episode columns (see ``schemas.tables.EpisodeRow``) that the
    format has, including the trajectory-key inputs; ``steps`` hold step columns without
    ``step_id`` and lineage, in order. The normalizer adds ids and lineage.
    """

    episode: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)
    #: the tool definitions shown to the model (``common.tool_schema_info``), when the format has
    #: them: stored once per digest in ``tool_schemas``; their digest is the episode's
    #: ``tool_schema_digest`` unless the source named one
    tool_schemas: dict[str, Any] | None = None


class Adapter(ABC):
    name: ClassVar[str]
    version: ClassVar[str]
    framing: ClassVar[Literal["jsonl", "document"]]
    description: ClassVar[str] = ""
    #: a companion file (verdicts, metrics, predictions) gives facts about episodes, not episodes
    companion: ClassVar[bool] = False
    #: a companion whose ``facts`` give nothing (kept in ``raw`` beside the episodes, read by no one):
    #: the fact index leaves it out, so its arrival rebuilds nothing
    gives_facts: ClassVar[bool] = True
    #: episodes of this format read companion facts (so new companions rebuild them)
    consumes_facts: ClassVar[bool] = False
    #: a file of this format is appended to while the agent works: a longer copy of the same file
    #: supersedes a shorter one (ingest/sessions.py)
    grows: ClassVar[bool] = False
    #: a document that is a JSON array of rows (an episode each) and too large to be one record is read
    #: as one record per element instead of being refused (ingest/reader.py ``iter_array_elements``)
    row_arrays: ClassVar[bool] = False
    #: the format is validated against a schema of its own (native): every field is read or refused,
    #: so an empty model turn is the data's, never content the adapter missed (normalize's no_content guard)
    exact_schema: ClassVar[bool] = False
    #: one session is many files (one per event, or cache pages): their records are assembled into
    #: one episode (``session_of`` names the session, ``combine`` joins the parts; ingest/sessions.py)
    assembled: ClassVar[bool] = False

    def session_of(self, path: str) -> str | None:
        """For ``assembled`` formats: the session a file belongs to."""
        return None

    def combine(self, parts: list[Any]) -> Any:
        """For ``assembled`` formats: one record object from the decoded parts of a session."""
        raise NotImplementedError

    def decode(self, data: bytes) -> Any:
        """Bytes of one record -> the object ``check_record`` and ``parse`` take."""
        return orjson.loads(data)

    def framing_of(self, head: bytes) -> str | None:
        """The framing of this file when it is not the format's usual one (``registry.framing_for``),
        e.g. a file of JSON lines that together make one record; None: the usual."""
        return None

    def facts(self, obj: Any, ctx: RecordContext) -> list[tuple[str, str, dict[str, Any]]]:
        """For companions: ``(kind, key, facts)`` triples (see ``RecordContext.facts``)."""
        return []

    @abstractmethod
    def sniff(self, path: str, head: bytes) -> bool: ...

    @abstractmethod
    def check_record(self, obj: Any) -> str | None:
        """None if ``obj`` is plausibly a record of this format, else why not."""

    @abstractmethod
    def parse(self, obj: Any, ctx: RecordContext) -> list[ParsedEpisode]: ...

    @property
    def tag(self) -> str:
        return f"{self.name}@{self.version}"


class KeptFile(Adapter, ABC):
    """A file that lives beside trajectories and is none (a UI log, a model call's log): kept in
    ``raw`` and read by no one, a companion with no facts, so it is neither quarantined as an
    unknown format nor read as an episode, and its arrival rebuilds nothing."""

    version: ClassVar[str] = "1.0.0"
    framing: ClassVar[Literal["jsonl", "document"]] = "document"
    companion: ClassVar[bool] = True
    gives_facts: ClassVar[bool] = False

    def parse(self, obj: Any, ctx: RecordContext) -> list[ParsedEpisode]:
        return []


class KeptTextFile(KeptFile, ABC):
    """A kept file of text (a log, a prompt), known by its name or place: any text is one."""

    def decode(self, data: bytes) -> Any:
        return data.decode("utf-8", "replace")

    def check_record(self, obj: Any) -> str | None:
        return None


class JsonlSessionAdapter(Adapter, ABC):
    """A format where one file of JSON lines is one session (one record, one episode)."""

    framing: ClassVar[Literal["jsonl", "document"]] = "document"

    def decode(self, data: bytes) -> Any:
        from trajwh.ingest.adapters.common import decode_jsonl_document

        return decode_jsonl_document(data)
