"""The byte tokenizer's Hugging Face files (engine/tokenizer_files.py): `AutoTokenizer.from_pretrained` on a shipped
model's folder encodes, decodes and renders chats exactly as the native server's byte tokenizer does."""

import json
import random

import pytest

from evalpipe.digest import file_sha256
from evalpipe.engine.model.names import DEFAULT_MODEL_NAME
from evalpipe.engine.model.weights import MODEL_PINS, PACKAGED_MODELS_DIR, default_checkpoint
from evalpipe.engine.tokenizer import SPECIAL_TOKENS, ByteTokenizer, load_tokenizer
from evalpipe.engine.tokenizer_files import TOKENIZER_FILES, write_tokenizer_files

PACKAGED = PACKAGED_MODELS_DIR / DEFAULT_MODEL_NAME
# characters the random strings are drawn from: ASCII with controls, accents, CJK, emoji (4-byte UTF-8), a lone
# combining mark, and pieces of special-token spellings (so that near-misses like "<|bos" appear too)
ALPHABET = [chr(c) for c in range(0, 128)] + list("éüßñ世界日本語🙂🚀\u0301\u200b") + ["<|", "|>", "<think", "</"]


def random_text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(0, 40)):
        parts.append(rng.choice(SPECIAL_TOKENS) if rng.random() < 0.1 else rng.choice(ALPHABET))
    return "".join(parts)


@pytest.fixture(scope="module", params=["packaged", "tiny"])
def hf(request):
    from transformers import AutoTokenizer

    folder = PACKAGED if request.param == "packaged" else default_checkpoint()
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def test_encode_decode_and_bos_match_the_byte_tokenizer(hf):
    byte = ByteTokenizer()
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    assert (hf.bos_token_id, hf.eos_token_id, len(hf)) == (byte.bos_token_id, byte.eos_token_id, byte.vocab_size)
    for _ in range(300):
        text = random_text(rng)
        ids = byte.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids, (seed, text)
        assert hf.encode(text) == byte.encode_prompt(text), (seed, text)  # a completion prompt: BOS first
        assert hf.decode(ids, skip_special_tokens=True) == byte.decode(ids), (seed, text)
        # any id sequence, including byte runs that are not UTF-8 and ids past the layout (reserved: no text)
        noise = [rng.randrange(0, 300) for _ in range(rng.randint(0, 30))]
        assert hf.decode(noise, skip_special_tokens=True) == byte.decode(noise), (seed, noise)


def test_chat_template_renders_the_engine_prompt(hf):
    byte = ByteTokenizer()
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "déjà vu 世界",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            },
        }
    ]
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [
            {"role": "system", "content": "Be brief. ünïcode"},
            {"role": "user", "content": "hi <think>"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again 🙂"},
        ],
        [
            {"role": "user", "content": "find x"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "é"}'}}
                ],
            },
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ],
    ]
    for messages in conversations:
        for kwargs in ({}, {"tools": tools}, {"enable_thinking": True}):
            for gen in (True, False):
                want = byte.apply_chat_template(messages, add_generation_prompt=gen, **kwargs)
                got = hf.apply_chat_template(
                    messages, add_generation_prompt=gen, tokenize=True, return_dict=False, **kwargs
                )
                assert list(got) == want, (messages, kwargs, gen)


def test_shipped_files_are_what_the_builder_writes_and_are_pinned(tmp_path):
    pins = json.loads(MODEL_PINS.read_text())[DEFAULT_MODEL_NAME]["files"]
    written = write_tokenizer_files(tmp_path)
    for path in written:
        assert (PACKAGED / path.name).read_bytes() == path.read_bytes(), path.name
        assert pins[path.name] == file_sha256(PACKAGED / path.name)
    assert {p.name for p in written} == set(TOKENIZER_FILES)


def test_a_folder_with_the_byte_layout_serves_with_the_byte_tokenizer(tmp_path):
    """`serve --model <folder>` and `--tokenizer <folder>` on a shipped model's folder give the byte tokenizer itself
    (identical logprob token names and streaming), not a Hugging Face wrapper of it."""
    assert isinstance(load_tokenizer(str(PACKAGED)), ByteTokenizer)
    (tmp_path / "tokenizer_config.json").write_text("not json")
    with pytest.raises(Exception):
        load_tokenizer(str(tmp_path))  # not the byte layout: read as a Hugging Face folder, which this is not
