"""Canonical actions: every tool call or command becomes ``(kind, object)``.

Kinds: ``read | search | edit | run | test | submit | browse | other``. The classifier knows
shell commands (``cat``/``sed -n``/``head`` read, ``grep``/``rg``/``find`` search, ``sed -i``,
redirections and patches edit, ``pytest``/``tox``/``npm test`` test, ...) and the tool names of
the harnesses we ingest (SWE-agent's ``open``/``find_file``/``edit``, OpenHands' action types
and ``str_replace_editor``, Claude Code's ``Read``/``Grep``/``Edit``/``Bash``, Codex's ``shell``
and ``apply_patch``, ...). A compound shell command takes the most telling part:
submit > test > edit > search > read > browse > run.
"""

from __future__ import annotations

import re
import shlex
from functools import lru_cache
from typing import Any

import orjson

KINDS = ("read", "search", "edit", "run", "test", "submit", "browse", "other")
_PRIORITY = {"submit": 7, "test": 6, "edit": 5, "search": 4, "read": 3, "browse": 2, "run": 1, "other": 0}

_SUBMIT_MARKERS = ("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", "MINI_SWE_AGENT_FINAL_OUTPUT")
_TEST_RE = re.compile(r"(^|[\s/])(pytest|py\.test|tox|nox|runtests(\.py)?|jest|mocha|vitest|phpunit|rspec|ctest)\b"
                      r"|\bunittest\b|\bmanage\.py\s+test\b|\b(npm|yarn|pnpm)\s+(run\s+)?test\b"
                      r"|\b(go|cargo|mvn|gradle|make|dotnet|mix|swift)\s+test\b|\bbin/test\b")
_FIRST_WORD = {
    # shell
    "cat": "read", "head": "read", "tail": "read", "less": "read", "more": "read", "nl": "read", "bat": "read",
    "ls": "search", "tree": "search", "dir": "search", "wc": "read", "file": "read", "stat": "read", "pwd": "read",
    "diff": "read",
    "grep": "search", "egrep": "search", "fgrep": "search", "rg": "search", "ag": "search", "ack": "search",
    "find": "search", "fd": "search", "locate": "search",
    "patch": "edit", "apply_patch": "edit", "touch": "edit", "mkdir": "edit", "rm": "edit", "mv": "edit",
    "cp": "edit", "tee": "edit", "ed": "edit",
    "curl": "browse", "wget": "browse", "lynx": "browse",
    # SWE-agent commands
    "open": "read", "goto": "read", "scroll_up": "read", "scroll_down": "read",
    "find_file": "search", "search_dir": "search", "search_file": "search",
    "edit": "edit", "create": "edit", "insert": "edit", "append": "edit", "str_replace": "edit",
    "submit": "submit", "exit_forfeit": "submit",
}
_GIT = {"grep": "search", "show": "read", "diff": "read", "log": "read", "status": "read", "blame": "read",
        "apply": "edit", "checkout": "edit", "restore": "edit", "stash": "edit", "am": "edit", "commit": "run"}
_INSTALL = re.compile(r"^\s*(?:sudo\s+)?(?:pip3?|python3?\s+-m\s+pip|uv\s+pip|conda|mamba|apt(?:-get)?|brew|poetry|"
                      r"npm|yarn|pnpm|gem|cargo)\s+(?:install|add|i)\b")
_REDIRECT_WORD = re.compile(r"^\d*>{1,2}(?:&\d|/dev/null)?$|^\d*>&\d$|^&>/dev/null$")
_WRAPPERS = {"sudo", "timeout", "env", "nohup", "time", "xargs", "command", "exec"}


#: commands that, after a pipe and without a file of their own, only filter the output before them
_FILTERS = {"head", "tail", "grep", "egrep", "fgrep", "rg", "wc", "sort", "uniq", "cut", "awk", "sed", "tr", "less",
            "more", "cat", "nl", "column", "jq", "xargs", "tee"}
_PLACEHOLDER = re.compile(r"<[A-Z][A-Z0-9_]*:[0-9a-f]{4,}(?::[\w.-]+)?>")


_HEREDOC = re.compile(r"<<(-?)\s*(['\"]?)([A-Za-z_][\w]*)\2")


def _strip_heredocs(cmd: str) -> str:
    """The command without here-document bodies: ``cat <<'EOF' > t.py`` ... ``EOF`` writes a file;
    the ``import unittest`` inside it is content, not a command."""
    if "<<" not in cmd:
        return cmd
    lines, out, i = cmd.split("\n"), [], 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        for m in _HEREDOC.finditer(line):
            tab, end = m.group(1), m.group(3)
            while i < len(lines) and (lines[i].lstrip("\t") if tab else lines[i]).strip() != end:
                i += 1
            i += 1  # the terminator line
    return "\n".join(out)


def _split_segments(cmd: str) -> list[str]:
    """Commands of a compound line; in a pipeline, the stages after the first count only when
    they name a file of their own (``| tail -5`` filters output, it reads nothing; ``| tee f``
    writes ``f``)."""
    out = []
    for part in re.split(r"\s*(?:&&|\|\||;|\n)\s*", cmd):
        stages = [p.strip() for p in re.split(r"(?<![|>])\|(?!\|)", part) if p.strip()]
        for i, stage in enumerate(stages):
            words = _words(stage)
            head = words[0].rsplit("/", 1)[-1] if words else ""
            if i and head in _FILTERS and not (head == "tee" and len(words) > 1) and not _has_file_arg(words):
                continue
            out.append(stage)
    return out


def _has_file_arg(words: list[str]) -> bool:
    """A filter with a path-like operand (``grep foo src/a.py``) reads that file, not the pipe."""
    operands = [w for w in words[1:] if not w.startswith("-")]
    head = words[0].rsplit("/", 1)[-1]
    if head in ("grep", "egrep", "fgrep", "rg", "sed", "awk", "jq", "cut"):
        operands = operands[1:]  # the first operand is the pattern / script
    return any("/" in w or "." in w for w in operands if not re.fullmatch(r"[\d,:+p]+", w))


_SHELL_BLANKS = re.compile(r"[ \t\r\n]+")


@lru_cache(maxsize=1 << 16)  # agents repeat their commands (ls, git status, pytest ...)
def _words(segment: str) -> tuple[str, ...]:
    if '"' in segment or "'" in segment or "\\" in segment:
        try:
            words = shlex.split(segment, comments=False, posix=True)
        except ValueError:
            words = segment.split()
    else:  # no quoting: POSIX shlex splits exactly at these blanks (and is 30x slower)
        words = [w for w in _SHELL_BLANKS.split(segment) if w]
    words = [w for w in words if not _REDIRECT_WORD.match(w)]  # 2>/dev/null, 2>&1: not operands
    while words and ("=" in words[0] and not words[0].startswith("-") or words[0] in _WRAPPERS):
        words = words[1:]
        if words and words[0].isdigit():  # timeout 30 cmd
            words = words[1:]
    return tuple(words)


def _last_path(words: list[str]) -> str | None:
    for w in reversed(words[1:]):
        if not w.startswith("-") and not re.fullmatch(r"[\d,:+p]+", w):
            return w
    return None


def _classify_segment(segment: str) -> tuple[str, str | None]:
    if any(m in segment for m in _SUBMIT_MARKERS):
        return "submit", None
    if _INSTALL.match(segment):  # `pip install pytest` installs a test runner, it runs no test
        return "run", segment
    if _TEST_RE.search(segment):
        return "test", segment
    # a redacted value's closing ">" (<EMAIL:1a2b3c:ep>) is not a redirection
    redirect = re.search(r"(?<![0-9&])>{1,2}\s*([^\s&|;>]+)", _PLACEHOLDER.sub("PLACEHOLDER", segment))
    if redirect and redirect.group(1) not in ("/dev/null", "/dev/stderr", "/dev/stdout"):
        return "edit", redirect.group(1)
    words = _words(segment)
    if not words:
        return "other", None
    head = words[0].rsplit("/", 1)[-1]
    if head in ("python", "python3") and len(words) > 2 and words[1] == "-m":
        return ("test", segment) if words[2] in ("pytest", "unittest") else ("run", segment)
    if head == "git" and len(words) > 1:
        return _GIT.get(words[1], "run"), segment
    if head in ("sed", "perl"):
        inplace = any(w.startswith("-i") or w.startswith("-pi") for w in words[1:])
        return ("edit" if inplace else "read"), _last_path(words)
    kind = _FIRST_WORD.get(head)
    if kind == "browse":
        url = next((w for w in words if re.match(r"https?://", w)), None)
        return "browse", url or _last_path(words)
    if head in ("ls", "tree", "dir"):  # listing a directory: its object is the directory
        return "search", _last_path(words) or "."
    if kind == "search":
        return "search", " ".join(words[1:]) or None
    if kind in ("read", "edit"):
        return kind, _last_path(words) or (words[1] if len(words) > 1 else None)
    if kind == "submit":
        return "submit", None
    return "run", segment


#: a command run through a shell: ``bash -lc '...'`` (Codex writes its commands so), ``sh -c "..."``
_SHELL_WRAP = re.compile(r"""\A\s*(?:\S*/)?(?:ba|z|da|k)?sh\s+-l?c\s+(['"])(?P<inner>.*)\1\s*\Z""", re.S)


def classify_command(cmd: str | None) -> tuple[str, str | None]:
    """(kind, object) of a shell command or a harness command line (a command wrapped in
    ``bash -lc '...'`` is classified by what it runs)."""
    if not cmd or not cmd.strip():
        return "other", None
    wrapped = _SHELL_WRAP.match(cmd)
    if wrapped and wrapped.group("inner").strip():
        cmd = wrapped.group("inner")
    first_line = cmd.strip().splitlines()[0]
    words = _words(first_line)
    if words and words[0] in ("edit", "create", "insert", "append") and "\n" in cmd.strip():
        return "edit", words[1] if len(words) > 1 and words[0] != "edit" else None  # SWE-agent block edit
    best: tuple[str, str | None] = ("other", None)
    for seg in _split_segments(_strip_heredocs(cmd)):
        kind, obj = _classify_segment(seg)
        if _PRIORITY[kind] > _PRIORITY[best[0]]:
            best = (kind, obj)
    if best[0] in ("run", "test"):
        return best[0], first_line.strip()
    return best


def _args(arguments: Any) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            value = orjson.loads(arguments)
            return value if isinstance(value, dict) else {"input": value}
        except orjson.JSONDecodeError:
            return {"input": arguments}
    return {}


def _command_of(args: dict[str, Any]) -> str | None:
    cmd = args.get("command", args.get("cmd", args.get("code")))
    if isinstance(cmd, list):  # codex: ["bash", "-lc", "..."]
        if len(cmd) >= 3 and cmd[0] in ("bash", "sh", "zsh") and cmd[1] in ("-lc", "-c"):
            return str(cmd[2])
        return " ".join(str(c) for c in cmd)
    return cmd if isinstance(cmd, str) else None


def _path_of(args: dict[str, Any]) -> str | None:
    for key in ("path", "file_path", "filename", "file", "notebook_path", "file_name", "absolute_path", "filePath"):
        if isinstance(args.get(key), str):
            return args[key]
    return None


def _patch_files(text: str) -> str | None:
    files = re.findall(r"^\*\*\* (?:Update|Add|Delete) File: (.+)$|^\+\+\+ b/(.+)$", text, re.M)
    names = [a or b for a, b in files]
    return ", ".join(dict.fromkeys(names)) or None


_FINAL_ANSWER = re.compile(r"(?m)^\s*final_answer\(")
#: browser-use's controller actions (its ``search`` with an ``engine`` and ``send_keys`` with ``keys`` too):
#: an action on a page
_BROWSER_ACTIONS = frozenset({
    "go_to_url", "open_tab", "switch_tab", "close_tab", "go_back", "search_google", "click_element",
    "click_element_by_index", "click", "input_text", "input", "scroll", "scroll_down", "scroll_up", "scroll_to_text",
    "find_text", "extract_content", "extract_structured_data", "extract", "get_dropdown_options", "dropdown_options",
    "select_dropdown_option", "select_dropdown", "upload_file", "upload_file_to_element", "drag_drop", "wait",
    "screenshot", "evaluate", "find_elements", "get_ax_tree", "switch", "close"})


def _browser_action(low: str, args: dict[str, Any]) -> tuple[str, str | None]:
    """browser-use's actions: ``done`` is the answer; the rest act on a page (their object: the URL,
    the query, the element's index, the text typed)."""
    for key in ("url", "query", "input"):  # where it goes (a ReAct action's argument too): the object itself
        if isinstance(args.get(key), str) and args[key]:
            return "browse", args[key][:200]
    target = next((args[k] for k in ("text", "keys", "index", "goal") if args.get(k) not in (None, "")), None)
    return "browse", (f"{low} {target}" if target is not None else low)[:200]


def classify_tool(name: str, arguments: Any = None) -> tuple[str, str | None]:
    """(kind, object) of a tool call, by harness tool name and arguments."""
    args = _args(arguments)
    n = name.strip()
    low = n.lower()
    if "__" in low.strip("_"):  # an MCP tool named with its server (Goose's developer__shell, mcp__github__x)
        low = low.rsplit("__", 1)[1] or low
    if low in ("bash", "shell", "run", "execute_bash", "exec_command", "cmdrunaction", "terminal", "local_shell",
               "run_command", "execute_command", "container.exec", "cmd", "run_shell_command"):
        return classify_command(_command_of(args))
    if low in ("str_replace_editor", "text_editor", "str_replace_based_edit_tool"):
        sub = args.get("command")
        return ("read" if sub == "view" else "edit"), _path_of(args)
    if low == "file_change" and isinstance(args.get("changes"), list):  # codex exec's item: the paths it changed
        return "edit", ", ".join(str(c.get("path")) for c in args["changes"] if isinstance(c, dict)) or None
    if low in ("apply_patch",):
        return "edit", _patch_files(str(args.get("input", args.get("patch", ""))))
    if low in ("run_ipython", "ipython", "python", "jupyter", "python_interpreter"):
        code = _command_of(args) or (args["input"] if isinstance(args.get("input"), str) else None)  # code as the arguments
        if low == "python_interpreter" and code and _FINAL_ANSWER.search(code):  # smolagents' CodeAgent answers in code
            return "submit", None
        return "run", code
    if low in _BROWSER_ACTIONS or (low in ("search", "send_keys") and ("engine" in args or "keys" in args)):
        return _browser_action(low, args)
    if low in ("write_stdin", "send_input", "stdin", "send_keys"):  # input to a running process, not a file
        return "run", str(args.get("session_id") or args.get("chars") or "")[:200] or None
    if low in ("finish", "submit", "agentfinishaction", "task_complete", "attempt_completion", "answer", "final_answer",
               "task_done", "done"):
        return "submit", None
    if low in ("think", "todowrite", "update_plan", "task", "message", "recall", "agent_think", "write_todos",
               "sequentialthinking", "sequential_thinking",
               "save_memory", "todoread", "ask_followup_question", "plan_mode_respond", "new_task", "switch_mode",
               "fetch_instructions", "use_mcp_tool", "access_mcp_resource"):
        return "other", None
    if low in ("computer", "computer_use") or low.startswith("computer_20"):  # computer use: an action on a screen
        action = args.get("action") if isinstance(args.get("action"), str) else args.get("type")
        xy = args.get("coordinate") if isinstance(args.get("coordinate"), list) else (
            [args["x"], args["y"]] if "x" in args and "y" in args else None)  # Anthropic's / OpenAI's spelling
        where = ",".join(str(v) for v in xy) if xy else None
        typed = args.get("text") if isinstance(args.get("text"), str) else None
        return "browse", " ".join(str(x) for x in (action, where, typed) if x)[:200] or None
    if low in ("webfetch", "websearch", "browse", "browser", "browse_interactive", "web_search", "navigate",
               "web_fetch", "google_web_search"):
        return "browse", args.get("url") or args.get("query") or args.get("prompt")
    if low in ("read", "notebookread", "read_file", "view", "view_file", "open", "open_file", "cat"):
        return "read", _path_of(args)
    if low == "read_many_files" and isinstance(args.get("paths"), list):
        return "read", ", ".join(str(p) for p in args["paths"]) or None
    if low in ("grep", "glob", "ls", "search", "find", "find_file", "search_dir", "search_file", "list_dir",
               "file_search", "codebase_search", "search_file_content", "list_directory", "search_files", "list_files", "list",
               "list_code_definition_names"):
        target = (args.get("pattern") or args.get("query") or args.get("search_term") or args.get("file_name")
                  or args.get("regex") or args.get("input"))
        return "search", str(target) if target is not None else _path_of(args)
    if low in ("edit", "multiedit", "write", "notebookedit", "edit_file", "write_file", "create", "create_file",
               "insert", "replace", "str_replace", "patch", "write_to_file", "replace_in_file", "apply_diff",
               "insert_content", "search_and_replace"):
        return "edit", _path_of(args)
    # unknown tools: the name's words decide
    for words, kind in ((("test",), "test"), (("submit", "finish"), "submit"), (("edit", "write", "replace", "patch", "create"), "edit"),
                        (("search", "grep", "find", "glob"), "search"), (("read", "view", "open", "cat"), "read"),
                        (("browse", "url", "fetch", "navigate", "click", "web"), "browse"),
                        (("bash", "shell", "exec", "run", "command"), "run")):
        if any(w in low for w in words):
            cmd = _command_of(args)
            if kind == "run" and cmd:
                return classify_command(cmd)
            return kind, _path_of(args) or cmd or args.get("url") or args.get("input")
    return "other", None


_FENCE_LINE = re.compile(r"^[ \t]{0,3}(`{3,}|~{3,})[ \t]*([\w+-]*)[^\n]*$", re.M)
_SHELL_INFO = {"", "bash", "sh", "shell", "console", "zsh"}


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(info, body)`` of each fenced block, fences paired in order as CommonMark pairs them (a
    closing fence is never taken as the opening of the next block)."""
    blocks, open_fence = [], None
    for m in _FENCE_LINE.finditer(text):
        fence, info = m.group(1), m.group(2).lower()
        if open_fence is None:
            open_fence = (fence, info, m.end())
        elif fence[0] == open_fence[0][0] and len(fence) >= len(open_fence[0]) and not info:
            blocks.append((open_fence[1], text[open_fence[2]:m.start()].strip("\n")))
            open_fence = None
    return blocks


def command_in_text(text: str | None) -> str | None:
    """The last fenced shell command in a model message (text-based harnesses), if any."""
    if not text or "``" not in text and "~~~" not in text:
        return None
    shell = [body.strip() for info, body in fenced_blocks(text) if info in _SHELL_INFO and body.strip()]
    return shell[-1] if shell else None


def annotate_step(step: dict[str, Any]) -> None:
    """Set ``kind``/``object`` on each tool call and ``action_*`` on the step, in place."""
    calls = step.get("tool_calls")
    if calls:
        for call in calls:
            call["kind"], call["object"] = classify_tool(call["name"], call.get("arguments"))
        step["action_kind"], step["action_object"] = calls[0]["kind"], calls[0]["object"]
        return
    command = step.get("action_command")
    if command is None and step.get("author") == "model":
        command = command_in_text(step.get("text"))
        step["action_command"] = command
    if command:
        step["action_kind"], step["action_object"] = classify_command(command)
