"""The adapter registry: which formats exist and in which order files are sniffed.

Adding a format is one module beside this one and one line in ``BUILTIN`` below. The modules
import ``base`` (the contract); only this module imports them, so there is no import circle.
"""

from __future__ import annotations

from trajwh.ingest.adapters import (
    agentbench,
    aider,
    atif,
    browser_use,
    chat_messages,
    claude_code,
    cline,
    codex,
    codex_exec,
    gemini_cli,
    goose,
    inspect_ai,
    mini_swe_agent,
    native,
    openhands,
    osworld,
    qwen_code,
    swe_agent,
    swebench,
    tau_bench,
    trae_agent,
)
from trajwh.ingest.adapters.base import Adapter
from trajwh.schemas.errors import ConfigError

#: detection order: specific before generic, companions last. ATIF declares itself
#: (schema_version), so it comes before the formats whose names its exports quote.
BUILTIN: tuple[Adapter, ...] = (
    native.NativeAdapter(),
    atif.AtifAdapter(),
    atif.HarborAgentLogAdapter(),  # an agent's own logs beside Harbor's trajectory.json: before the formats that read them
    inspect_ai.InspectAdapter(),  # declares itself (an 'eval' header with run and task ids)
    swe_agent.SweAgentAdapter(),
    mini_swe_agent.MiniSweAgentAdapter(),
    openhands.OpenHandsOutputAdapter(),
    openhands.OpenHandsFileStoreAdapter(),  # before the event stream: its cache pages are arrays too
    openhands.OpenHandsEventStreamAdapter(),
    qwen_code.QwenCodeAdapter(),  # before Gemini CLI (its fork) and Claude Code (whose line keys it shares)
    gemini_cli.GeminiCliAdapter(),  # before Claude Code: both write "sessionId" and "type": "user"
    claude_code.ClaudeCodeAdapter(),
    codex.CodexAdapter(),
    codex_exec.CodexExecAdapter(),
    aider.AiderAdapter(),
    trae_agent.TraeAgentAdapter(),
    browser_use.BrowserUseAdapter(),
    osworld.OsworldAdapter(),
    agentbench.AgentBenchAdapter(),
    goose.GooseAdapter(),
    tau_bench.Tau2RunAdapter(),  # a results.json beside simulations/: before the results documents it looks like
    tau_bench.Tau2SimulationAdapter(),
    tau_bench.TauBenchAdapter(),
    # a Cline task folder's other files: kept, read by no one (the conversation is its history, a chat-messages file)
    cline.ClineUiMessagesAdapter(),
    cline.ClineTaskMetadataAdapter(),
    atif.HarborTrialFileAdapter(),  # by its place in a trial folder, before any format reads its text
    atif.LiteLLMCallLogAdapter(),  # a model call's log holds "messages": kept before the message rows read it
    # generic message rows after every harness's own format, before the companions (a row may
    # carry an instance id and a patch, as SWE-bench predictions do)
    chat_messages.ChatMessagesAdapter(),
    atif.AtifMetricsAdapter(),
    atif.HarborTrialResultAdapter(),
    swebench.SwebenchReportAdapter(),
    swebench.SwebenchSummaryAdapter(),
    swebench.SwebenchPredictionsAdapter(),
    osworld.OsworldResultAdapter(),
    osworld.OsworldInstructionAdapter(),
    osworld.OsworldRuntimeLogAdapter(),
)
_REGISTRY: dict[str, Adapter] = {a.name: a for a in BUILTIN}


def register(adapter: Adapter) -> Adapter:
    """Add an adapter from elsewhere; it is sniffed after the built-in ones."""
    _REGISTRY[adapter.name] = adapter
    return adapter


def adapters() -> list[Adapter]:
    return list(_REGISTRY.values())


def get_adapter(name: str) -> Adapter:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown format {name!r}", valid=", ".join(sorted(_REGISTRY))) from None


def known_formats() -> str:
    return ", ".join(f"{a.name} ({a.description})" if a.description else a.name for a in adapters())


def framing_for(adapter: Adapter, head: bytes) -> str:
    """``jsonl`` adapters also take a whole JSON document: a pretty-printed object or an array.

    JSONL lines start with ``{"``; a document starts with a line that is only ``{`` or that
    opens an array. Such a file is one raw record (exactly as received).
    """
    if (own := adapter.framing_of(head)) is not None:
        return own
    if adapter.framing != "jsonl":
        return adapter.framing
    first = head.lstrip().split(b"\n", 1)[0].strip()
    return "document" if first in (b"{", b"[") or first.startswith(b"[") else "jsonl"


def detect(path: str, head: bytes) -> Adapter | None:
    """The first registered adapter that recognizes the file, or None."""
    for adapter in adapters():
        if adapter.sniff(path, head):
            return adapter
    return None
