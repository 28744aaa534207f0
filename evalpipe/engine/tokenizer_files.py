"""Hugging Face tokenizer files (`tokenizer.json`, `tokenizer_config.json`) for the byte tokenizer's layout
(engine/tokenizer.py), so that `AutoTokenizer.from_pretrained(model_dir)` and the tools built on it (lm-eval's
`tokenizer_backend=huggingface`, vLLM, SGLang) encode, decode and render chats exactly as the native server does.

The layout in `tokenizers` terms: a byte-level BPE without merges (every byte is one token; GPT-2's byte-to-unicode
alphabet names them) at ids 16..271, the 16 specials at ids 0..15 as added tokens (special, so skipped on decode,
except the visible reasoning markers), `<|bos|>` prepended when special tokens are added (a completion prompt), and
the byte tokenizer's own chat template. Built with the `tokenizers` library (installed with transformers), never by
hand; `training/write_tokenizer_files.py` rewrites the shipped model's copy and its sha256 pins.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from evalpipe.engine.tokenizer import BYTE_OFFSET, SPECIAL_TOKENS, VISIBLE_SPECIALS, byte_tokenizer_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte 0..255 (the names byte-level BPE gives its byte tokens)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    names, extra = {}, 0
    for b in range(256):
        if b in printable:
            names[b] = chr(b)
        else:
            names[b] = chr(256 + extra)
            extra += 1
    return [names[b] for b in range(256)]


def build_tokenizer():
    """The byte layout as a `tokenizers.Tokenizer`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({name: BYTE_OFFSET + b for b, name in enumerate(byte_level_alphabet())})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS if t not in VISIBLE_SPECIALS]
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in SPECIAL_TOKENS if t in VISIBLE_SPECIALS])
    bos = SPECIAL_TOKENS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B:1", special_tokens=[(bos, 0)]
    )
    return tok


def write_tokenizer_files(folder: str | Path) -> list[Path]:
    """Write tokenizer.json and tokenizer_config.json into `folder`, byte-identical on every run; each file is
    replaced whole (written beside, then renamed), so a reader never sees half of one."""
    folder = Path(folder)
    texts = [
        json.dumps(json.loads(build_tokenizer().to_str()), indent=2, ensure_ascii=False, sort_keys=True),
        json.dumps(byte_tokenizer_config(), indent=2, ensure_ascii=False),
    ]
    paths = []
    for name, text in zip(TOKENIZER_FILES, texts):
        path = folder / name
        tmp = path.with_name(f"{name}.tmp{os.getpid()}")
        tmp.write_text(text + "\n", encoding="utf-8")
        tmp.replace(path)
        paths.append(path)
    return paths


def ensure_tokenizer_files(folder: str | Path) -> None:
    """Write the files into `folder` unless both are there (a checkpoint created before they existed)."""
    if not all((Path(folder) / name).is_file() for name in TOKENIZER_FILES):
        write_tokenizer_files(folder)
