"""Tokenizers of the native server: byte-level round trips, the chat template, streaming detokenization."""

import pytest

from evalpipe.engine.tokenizer import BYTE_OFFSET, ByteTokenizer, HFTokenizer, has_hf_tokenizer, load_tokenizer


def test_byte_round_trip_and_layout():
    tok = ByteTokenizer()
    text = "Héllo, 世界! 🙂"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert all(BYTE_OFFSET <= i < BYTE_OFFSET + 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode("A") == [BYTE_OFFSET + 65]
    assert tok.encode_prompt("A") == [tok.bos_token_id, BYTE_OFFSET + 65]  # raw completion prompts start at BOS


def test_special_strings_map_to_ids_and_hidden_specials_decode_to_nothing():
    tok = ByteTokenizer()
    ids = tok.encode("<|user|>hi<|end|>")
    assert ids == [3, BYTE_OFFSET + ord("h"), BYTE_OFFSET + ord("i"), 8]
    assert tok.decode(ids + [tok.eos_token_id, 300]) == "hi"
    assert tok.decode(tok.encode("<think>x</think>")) == "<think>x</think>"
    assert tok.token_text(300) == "<|reserved_300|>"


def test_chat_template_and_thinking_switch():
    tok = ByteTokenizer()
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    plain = tok.apply_chat_template(msgs)
    assert plain == tok.encode("<|bos|><|system|>S<|end|><|user|>U<|end|><|assistant|>")
    thinking = tok.apply_chat_template(msgs, thinking=True)
    assert thinking == plain + [tok.encode("<think>")[0]]
    assert tok.apply_chat_template(msgs, enable_thinking=True) == thinking
    assert tok.apply_chat_template(msgs, add_generation_prompt=False)[-1] == tok.encode("<|end|>")[0]


def test_detokenizer_holds_back_partial_utf8():
    tok = ByteTokenizer()
    ids = tok.encode("a€b")  # € is three bytes
    d = tok.detokenizer()
    pieces = [d.push([i]) for i in ids]
    assert pieces == ["a", "", "", "€", "b"]
    d = tok.detokenizer()
    assert d.push(ids[:2]) == "a" and d.flush() == "\ufffd"  # a cut character is flushed as U+FFFD at the end


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A small Hugging Face tokenizer saved to disk (built offline with the `tokenizers` library)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2}
    for w in ["hello", "world", "user", "assistant", ":", "!", "think"]:
        vocab[w] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.decoder = decoders.WordPiece(prefix="##")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")
    tok.chat_template = (
        "{% for m in messages %}{{ m.role }} : {{ m.content }} {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% if enable_thinking %} think{% endif %}{% endif %}"
    )
    path = tmp_path_factory.mktemp("hf_tok")
    tok.save_pretrained(path)
    return path


def test_hf_tokenizer_dir_loads_with_its_chat_template(hf_dir):
    assert has_hf_tokenizer(hf_dir)
    tok = load_tokenizer(str(hf_dir))
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_token_id == 1 and tok.vocab_size == 10
    ids = tok.apply_chat_template([{"role": "user", "content": "hello world"}])
    assert ids == tok.encode("user : hello world assistant :")
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}], thinking=True)[-1] == tok.encode("think")[0]
    d = tok.detokenizer()
    streamed = "".join(d.push([i]) for i in tok.encode("hello world !")) + d.flush()
    assert streamed == tok.decode(tok.encode("hello world !"))
    assert tok.encode_prompt("hello") == tok._tok("hello")["input_ids"]  # the tokenizer's own special-token rule


def test_missing_tokenizer_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "nope"))


def test_hf_tokenizer_gives_xgrammar_its_vocabulary(hf_dir):
    """response_format works with Hugging Face tokenizers: xgrammar reads the vocabulary through the wrapper; a JSON
    object cannot start with a word, so every word is masked at the first row."""
    import torch

    from evalpipe.engine.grammar import Grammars
    from evalpipe.engine.grammar_constraint import GrammarConstraint

    tok = load_tokenizer(str(hf_dir))
    constraint = Grammars(tok, 16).matcher(GrammarConstraint.json(None), 1)
    masked = constraint.mask(torch.zeros(1, 16))
    assert torch.isinf(masked[0, tok.encode("hello")[0]]) and torch.isinf(masked[0, tok.encode("world")[0]])


def test_hf_tokenizer_config_is_what_tokenizer_info_serves(hf_dir):
    """/tokenizer_info for a Hugging Face tokenizer: its tokenizer_config.json as JSON (vLLM's shape), with the
    named specials and the chat template lm-eval's remote tokenizer reads."""
    import json

    config = load_tokenizer(str(hf_dir)).config()
    assert json.loads(json.dumps(config)) == config  # plain JSON: no AddedToken objects
    assert (config["bos_token"], config["eos_token"]) == ("<s>", "</s>")
    assert "assistant :" in config["chat_template"] and config["tokenizer_class"]
    assert not {"vocab_file", "tokenizer_file", "name_or_path"} & set(config)
