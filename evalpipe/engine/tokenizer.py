"""Tokenizers for the native server: an offline byte-level one for the tiny model, or a Hugging Face one.

Both expose the same small surface the server needs: `encode`, `apply_chat_template`, `token_text` (for
logprobs), and `detokenizer()` for streaming text that never splits a multi-byte UTF-8 character.

Byte-level layout (vocab 272, fits any model with vocab_size >= 272): id 0 `<|bos|>`, 1 `<|eos|>`, 2..15 the
specials below, byte b at id 16 + b. Ids at or above 272 (the tiny model's vocab is 512) are reserved: they
decode to nothing, like skipped special tokens in vLLM and SGLang.
"""

from __future__ import annotations

import codecs
import json
import re
from itertools import repeat
from pathlib import Path
from typing import Any

import jinja2

SPECIAL_TOKENS = [
    "<|bos|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<think>",
    "</think>",
    "<|pad|>",
    "<|end|>",
    "<|tool|>",
    "<|tool_call|>",
    "<|reserved_11|>",
    "<|reserved_12|>",
    "<|reserved_13|>",
    "<|reserved_14|>",
    "<|reserved_15|>",
]
BYTE_OFFSET = len(SPECIAL_TOKENS)
BYTE_VOCAB_SIZE = BYTE_OFFSET + 256
# Specials that are part of the visible text (the reasoning markers); every other special is skipped on decode.
VISIBLE_SPECIALS = {"<think>", "</think>"}
# A key of the tokenizer_config.json that engine/tokenizer_files.py writes: that folder holds this byte layout.
BYTE_LAYOUT_MARKER = "evalpipe_byte_layout"

# The byte tokenizer's chat template (same Jinja mechanism as Hugging Face's `apply_chat_template`).
# `tools` are listed in a system turn, one JSON object per line; an assistant tool call is `<|tool_call|>` followed by
# `{"name": ..., "arguments": {...}}`; a tool result is a `<|tool|>` turn.
# `thinking` (or its alias `enable_thinking`) opens a `<think>` block after the assistant tag; default off.
BYTE_CHAT_TEMPLATE = (
    "<|bos|>"
    "{%- if tools -%}<|system|>Tools:"
    "{%- for t in tools -%}{{ '\\n' }}{{ (t.function if t.function is defined else t) | tojson }}{%- endfor -%}<|end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role in ('system', 'developer') -%}<|system|>"
    "{%- elif m.role == 'user' -%}<|user|>"
    "{%- elif m.role == 'tool' -%}<|tool|>"
    "{%- else -%}<|assistant|>{%- endif -%}"
    "{{ m.content or '' }}"
    "{%- for c in (m.tool_calls or []) -%}"
    '<|tool_call|>{"name": {{ c.function.name | tojson }}, "arguments": {{ c.function.arguments }}}'
    "{%- endfor -%}<|end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>"
    "{%- if thinking or enable_thinking -%}<think>{%- endif -%}{%- endif -%}"
)


def byte_tokenizer_config() -> dict:
    """The byte layout's tokenizer_config.json (engine/tokenizer_files.py writes it): the class transformers loads,
    the named specials and the chat template; also the server's /tokenizer_info for the byte tokenizer."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": "<|pad|>",
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "chat_template": BYTE_CHAT_TEMPLATE,
        BYTE_LAYOUT_MARKER: True,  # `serve` reads such a folder with the byte tokenizer itself (load_tokenizer)
    }


class ByteTokenizer:
    """Offline byte-level tokenizer: every string round-trips, no files needed."""

    name = "evalpipe-byte"
    bos_token_id = 0
    eos_token_id = 1
    vocab_size = BYTE_VOCAB_SIZE
    special_token_ids = range(BYTE_OFFSET)
    tool_call_token_id = SPECIAL_TOKENS.index("<|tool_call|>")  # the template's tool-call marker (see above)

    def __init__(self):
        self._special_ids = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
        self._special_re = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
        env = jinja2.Environment(undefined=jinja2.ChainableUndefined)
        # Hugging Face's tojson: plain JSON, no HTML escaping, non-ASCII kept (ensure_ascii=False)
        env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
        self._template = env.from_string(BYTE_CHAT_TEMPLATE)
        # token_bytes of every id of the layout (ids past it have none): the detokenizers' lookup, every step
        self.bytes_table = {i: self.token_bytes(i) for i in range(BYTE_VOCAB_SIZE)}

    def encode(self, text: str) -> list[int]:
        """Bytes of `text`, with special-token strings mapped to their ids (as Hugging Face tokenizers do)."""
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            ids.extend(BYTE_OFFSET + b for b in text[pos : m.start()].encode("utf-8"))
            ids.append(self._special_ids[m.group()])
            pos = m.end()
        ids.extend(BYTE_OFFSET + b for b in text[pos:].encode("utf-8"))
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """A raw completion prompt: `<|bos|>` then the text (as Hugging Face tokenizers add their BOS)."""
        return [self.bos_token_id] + self.encode(text)

    def token_bytes(self, token_id: int) -> bytes:
        if BYTE_OFFSET <= token_id < BYTE_VOCAB_SIZE:
            return bytes([token_id - BYTE_OFFSET])
        if 0 <= token_id < BYTE_OFFSET and SPECIAL_TOKENS[token_id] in VISIBLE_SPECIALS:
            return SPECIAL_TOKENS[token_id].encode()
        return b""

    def token_text(self, token_id: int) -> str:
        """One token as logprobs show it: its text, `bytes:\\xNN` for a byte that is not UTF-8 on its own
        (OpenAI's convention, which keeps top-logprob keys distinct), or its special name (`<|reserved_300|>`)."""
        if BYTE_OFFSET <= token_id < BYTE_VOCAB_SIZE:
            b = token_id - BYTE_OFFSET
            return chr(b) if b < 0x80 else f"bytes:\\x{b:02x}"
        if 0 <= token_id < BYTE_OFFSET:
            return SPECIAL_TOKENS[token_id]
        return f"<|reserved_{token_id}|>"

    def decode(self, token_ids: list[int]) -> str:
        return b"".join(self.token_bytes(t) for t in token_ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text)

    def detokenizer(self) -> "ByteDetokenizer":
        return ByteDetokenizer(self)

    def describe(self) -> dict:
        return {"kind": "byte", "name": self.name, "vocab_size": self.vocab_size, "chat_template": BYTE_CHAT_TEMPLATE}

    def config(self) -> dict:
        return byte_tokenizer_config()


class ByteDetokenizer:
    """Streams text from byte tokens; an incomplete UTF-8 character is held back until its last byte arrives."""

    def __init__(self, tokenizer: ByteTokenizer):
        self._tok = tokenizer
        self._bytes_of = tokenizer.bytes_table.get
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: list[int]) -> str:
        # every sequence pushes every step: a table lookup per token, not a token_bytes call
        return self._utf8.decode(b"".join(map(self._bytes_of, token_ids, repeat(b""))))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class HFTokenizer:
    """A Hugging Face tokenizer directory (local files only) with its own chat template."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.name = str(path)
        self.bos_token_id = self._tok.bos_token_id
        self.eos_token_id = self._tok.eos_token_id
        self.vocab_size = len(self._tok)

    @property
    def hf_tokenizer(self) -> Any:
        """The wrapped transformers tokenizer (xgrammar reads its vocabulary from it)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def encode_prompt(self, text: str) -> list[int]:
        """A raw completion prompt with the tokenizer's own special tokens (BOS), as vLLM and SGLang encode it."""
        return self._tok.encode(text, add_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        if "thinking" in kwargs and "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = kwargs["thinking"]
        out = self._tok.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False, **kwargs
        )
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def detokenizer(self) -> "HFDetokenizer":
        return HFDetokenizer(self)

    def describe(self) -> dict:
        return {"kind": "huggingface", "name": self.name, "vocab_size": self.vocab_size}

    def config(self) -> dict:
        """What its tokenizer_config.json said (vLLM's /tokenizer_info): file paths left out, tokens as strings."""

        def plain(value: Any) -> Any:
            if hasattr(value, "content"):  # an AddedToken
                return value.content
            if isinstance(value, dict):
                return {str(k): plain(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [plain(v) for v in value]
            return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)

        out = {
            k: plain(v)
            for k, v in (getattr(self._tok, "init_kwargs", None) or {}).items()
            if k not in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")
        }
        out["tokenizer_class"] = type(self._tok).__name__
        template = getattr(self._tok, "chat_template", None)
        if isinstance(template, str):
            out["chat_template"] = template
        for name in ("bos_token", "eos_token", "pad_token"):
            out.setdefault(name, plain(getattr(self._tok, name, None)))
        return out


class HFDetokenizer:
    """Prefix/read-offset incremental decoding (as vLLM does): text ending in U+FFFD waits for more tokens."""

    def __init__(self, tokenizer: HFTokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        new_text = self._tok.decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        new_text = self._tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]


Tokenizer = ByteTokenizer | HFTokenizer
Detokenizer = ByteDetokenizer | HFDetokenizer


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """The byte tokenizer when `path` is None or holds the byte layout's Hugging Face files (so a shipped model's
    folder serves exactly as its name does), else the Hugging Face tokenizer stored at `path`."""
    if path is None or is_byte_layout(path):
        return ByteTokenizer()
    if not Path(path).exists():
        raise FileNotFoundError(f"tokenizer path {path} does not exist")
    return HFTokenizer(path)


def is_byte_layout(path: str | Path) -> bool:
    """Whether `path` is a folder whose tokenizer_config.json was written for the byte layout."""
    config = Path(path) / "tokenizer_config.json"
    try:
        return bool(json.loads(config.read_text(encoding="utf-8")).get(BYTE_LAYOUT_MARKER))
    except (OSError, ValueError, AttributeError):
        return False


def has_hf_tokenizer(path: str | Path) -> bool:
    """True when a model directory also carries tokenizer files (then `serve --model` uses them)."""
    p = Path(path)
    return p.is_dir() and any((p / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
