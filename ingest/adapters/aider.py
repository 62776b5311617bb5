"""Aider ``.aider.chat.history.md``: a Markdown log that holds many sessions.

Each session opens with ``# aider chat started at <local time>`` and is one episode. Inside:
``#### `` lines are what the person typed (``human``); ``> `` lines are Aider's own output —
start-up banner, token and cost lines, confirmations, "Applied edit", errors — (``harness``),
except the output of a shell command Aider ran (the ``> `` block after ``Running <cmd>``), which
is ``environment``; everything else is the model's reply (``model``), including SEARCH/REPLACE
edit blocks and whole-file edits (``<file name>`` then the content in a ``` or ``<source>`` fence:
an ``edit`` action on that file) and suggested shell commands. Prose between fences is never a
command (fences are paired in order). Aider's SEARCH/REPLACE failure feedback, which continues
unquoted after its quoted first line, is ``harness``; in architect mode the architect's plan
relayed to the editor model as a ``####`` message is ``model`` (``architect_plan_relayed``).

The session header's time has no zone, so it is kept as text in the metadata, not guessed.
"""

from __future__ import annotations

import re
from typing import Any

from trajwh.ingest.adapters.base import Adapter, ParsedEpisode, RecordContext
from trajwh.ingest.adapters.common import episode, number_steps, step

_SESSION = re.compile(r"^# aider chat started at (.+)$", re.M)
_TOKENS = re.compile(r"Tokens: ([\d.]+)(k?) sent, ([\d.]+)(k?) received\.(?: Cost: \$([\d.]+) message, \$([\d.]+) session)?")
#: Aider's own messages, which end a command's output inside a "> " block
_AIDER_OWN = re.compile(r"^(Add command output|You can use /undo|Tokens: |Applied edit|Commit [0-9a-f]{7}|"
                        r"Run shell command|Added .+ to the chat|Dropping |Warning|Only \d+ reflections|Running |"
                        r"Repo-map|Git repo|Main model|Weak model|Aider v|Skipping |Use /help|Unable to )")
#: SEARCH/REPLACE edits: the file name above the fence ("diff" format) or inside it ("diff-fenced")
_EDIT = re.compile(r"^(\S[^\n]*)\n(?:```[^\n]*|<source>)\n<<<<<<< SEARCH\n|"
                   r"^(?:```[^\n]*|<source>)\n([^\n<`]\S*)[ \t]*\n<<<<<<< SEARCH\n", re.M)
#: whole-file edits: a file name alone on a line, then the file's new content in a fence (``` or
#: the <source> fence Aider uses when the content itself holds backticks)
_WHOLE = re.compile(r"^([\w.\\/-]+\.[A-Za-z0-9]+)[ \t]*\n(?:```[^\n]*|<source>)\n(?!<<<<<<< SEARCH)", re.M)
_EDIT_FAILED = re.compile(r"SEARCH/REPLACE blocks? failed to match")
_FEEDBACK_LAST = re.compile(r"^(?:The SEARCH section must exactly match|# The other \d+ SEARCH/REPLACE blocks? w|"
                            r"Don't re-send them|Just reply with fixed versions?)")


def _num(value: str, k: str) -> int:
    return int(round(float(value) * (1000 if k else 1)))


def _blocks(lines: list[str]) -> list[tuple[str, list[str]]]:
    """Consecutive lines of one kind: ('human', ...), ('harness', ...), ('model', ...), then the
    two places where the quoting lies about the author (``_reattribute``)."""
    out: list[tuple[str, list[str]]] = []
    for line in lines:
        if line.startswith("#### "):
            kind, text = "human", line[5:]
        elif line.startswith("> ") or line == ">":
            kind, text = "harness", line[2:]
        else:
            kind, text = "model", line
        if out and out[-1][0] == kind:
            out[-1][1].append(text)
        else:
            out.append((kind, [text]))
    return _reattribute(out)


def _reattribute(blocks: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """Aider's SEARCH/REPLACE failure feedback continues unquoted after its quoted first line:
    it is the harness's (up to "Just reply with fixed versions ..."). In architect mode the
    architect's plan, once confirmed ("Edit the files?"), is relayed to the editor model as a
    ``####`` message: the architect model wrote it, not the person."""
    out: list[tuple[str, list[str]]] = []
    for kind, lines in blocks:
        said = [b for b in out if any(x.strip() for x in b[1])]  # blank lines separate, they say nothing
        prev = "\n".join(said[-1][1]) if said and said[-1][0] == "harness" else ""
        if kind == "model" and _EDIT_FAILED.search(prev):
            # the feedback's last lines are Aider's fixed sentences; the model's reply follows them
            ends = [i for i, line in enumerate(lines) if _FEEDBACK_LAST.match(line)]
            if ends:
                out.append(("harness", lines[:ends[-1] + 1]))
                if any(x.strip() for x in lines[ends[-1] + 1:]):
                    out.append(("model", lines[ends[-1] + 1:]))
                continue
        if kind == "human" and "Edit the files?" in prev:
            out.append(("architect", lines))
            continue
        out.append((kind, lines))
    return out


def _harness_block(text: str) -> list[dict[str, Any]]:
    """Aider's own lines; each ``Running <cmd>`` is a harness auto-action of its own, and lines
    after it up to Aider's next message are the command's output (``environment``). Aider logs
    only "Added N lines of output" in most versions, so usually there is none."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []
    in_output = False

    def flush(author: str) -> None:
        body = "\n".join(pending).strip()
        if body:
            out.append(step("user", "environment", observation=body) if author == "environment"
                       else step("user", "harness", text=body))
        pending.clear()

    for line in text.split("\n"):
        if line.startswith("Running "):
            flush("environment" if in_output else "harness")
            out.append(step("user", "harness", text=line, action_command=line[len("Running "):]))
            in_output = True
        elif in_output and _AIDER_OWN.match(line):
            flush("environment")
            in_output = False
            pending.append(line)
        else:
            pending.append(line)
    flush("environment" if in_output else "harness")
    return out


def _session_steps(body: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    steps: list[dict[str, Any]] = []
    info: dict[str, Any] = {"tokens_in": 0, "tokens_out": 0, "cost": None, "model": None, "version": None}
    for kind, lines in _blocks(body.split("\n")):
        text = "\n".join(x.rstrip() for x in lines).strip()
        if not text:
            continue
        if kind == "human":
            command = text[1:] if text.startswith("!") else text[5:] if text.startswith("/run ") else None
            steps.append(step("user", "human", text=text, action_command=command))
        elif kind == "architect":  # the architect's plan, relayed as the editor model's input
            steps.append(step("user", "model", text=text, metadata={"architect_plan_relayed": True}))
        elif kind == "model":
            searched = [a or b for a, b in _EDIT.findall(text)]
            edits = list(dict.fromkeys(searched + _WHOLE.findall(text)))
            steps.append(step("assistant", "model", text=text,
                              action_command=f"apply_patch {' '.join(edits)}" if edits else None,
                              metadata={"edited_files": edits} if edits else None))
        else:
            for m in _TOKENS.finditer(text):
                info["tokens_in"] += _num(m.group(1), m.group(2))
                info["tokens_out"] += _num(m.group(3), m.group(4))
                if m.group(6):
                    info["cost"] = float(m.group(6))
            mm = re.search(r"^(?:Main )?[Mm]odel: (\S+)", text, re.M)
            info["model"] = info["model"] or (mm.group(1) if mm else None)
            mv = re.search(r"^Aider v(\S+)", text, re.M)
            info["version"] = info["version"] or (mv.group(1) if mv else None)
            steps.extend(_harness_block(text))
    return steps, info


#: an error of the model's API as Aider prints it (through litellm, or a provider's SDK)
_API_ERROR = re.compile(r"^(?:litellm|openai|anthropic)\.(?P<kind>\w+)(?::[^\n]*)?$|^(?P<bare>\w*(?:APIConnectionError|"
                        r"RateLimitError|ServiceUnavailableError|InternalServerError|APIError|Timeout))\b[^\n]*$", re.M)


def _ending(steps: list[dict[str, Any]], body: str) -> tuple[str | None, str | None]:
    """How a session ended, when it says: the last error of the model's API after the model's last
    answer (in the words the outcome rules read: a rate limit is a provider's quota, a context window
    a budget, any other an infrastructure failure), and whether the person interrupted it (^C)."""
    last_model = max((n for n, s in enumerate(steps) if s["author"] == "model"), default=-1)
    errors = [m for s in steps[last_model + 1:] if s["author"] == "harness"
              for m in _API_ERROR.finditer(s.get("text") or "")]
    interrupted = "KeyboardInterrupt" in body[-2000:]
    if not errors:
        return ("interrupted", "interrupted by the person (KeyboardInterrupt)") if interrupted else (None, None)
    line = errors[-1].group(0).strip()[:300]
    kind = (errors[-1].group("kind") or errors[-1].group("bare") or "").lower()
    if "ratelimit" in kind:
        reason = f"rate limit of the model provider API: {line}"
    elif "contextwindow" in kind:
        reason = f"context window exceeded: {line}"
    else:
        reason = f"model provider API unreachable or failing (infrastructure): {line}"
    return ("interrupted" if interrupted else "error"), reason


class AiderAdapter(Adapter):
    name = "aider"
    version = "1.2.0"  # 1.2: how a session ended (API errors after the last answer, an interrupt)
    framing = "document"
    description = "Aider .aider.chat.history.md (one episode per session)"
    grows = True

    def decode(self, data: bytes) -> Any:
        return data.decode("utf-8").replace("\r\n", "\n")

    def sniff(self, path: str, head: bytes) -> bool:
        return b"# aider chat started at" in head[:4096]

    def check_record(self, obj: Any) -> str | None:
        return None if _SESSION.search(obj) else "no '# aider chat started at' session header"

    def parse(self, obj: str, ctx: RecordContext) -> list[ParsedEpisode]:
        heads = list(_SESSION.finditer(obj))
        episodes = []
        for i, m in enumerate(heads):
            body = obj[m.end(): heads[i + 1].start() if i + 1 < len(heads) else len(obj)]
            steps, info = _session_steps(body)
            first_human = next((s["text"] for s in steps if s["author"] == "human"), None)
            exit_status, termination = _ending(steps, body)
            ep = episode(
                task_text=first_human, harness_name="aider", harness_version=info["version"],
                policy_name=info["model"], tokens_in=info["tokens_in"] or None, tokens_out=info["tokens_out"] or None,
                cost_usd=info["cost"], exit_status=exit_status, termination_reason=termination,
                metadata={"session": i, "started_at_local": m.group(1).strip(),
                          "interrupted": "KeyboardInterrupt" in body or None},
            )
            episodes.append(ParsedEpisode(ep, number_steps(steps)))
        return episodes


