"""A tiny Llama checkpoint folder (config + byte-level BPE tokenizer, no weights) that vLLM serves with
`--load-format dummy`: made offline in a second, so a real vLLM can be tested without downloading a model.

The tokenizer is trained with `tokenizers` on GSM8K's train questions (so GSM8K prompts tokenize to a few hundred
ids) and saved through transformers' PreTrainedTokenizerFast, which is what vLLM loads.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]


def training_text(data_dir: Path, limit: int = 3000) -> list[str]:
    lines = (Path(data_dir) / "gsm8k" / "train.jsonl").read_text().splitlines()[:limit]
    rows = [json.loads(line) for line in lines if line.strip()]
    return [f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in rows]


def make_tiny_llama(out: Path, data_dir: Path, max_len: int = 4096) -> Path:
    """Write config.json and the tokenizer files into `out`; returns `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(training_text(data_dir), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=max_len
    )
    tokenizer.save_pretrained(out)
    # head_dim 32: the smallest head size vLLM's CPU attention kernels support (16 fails at the first request)
    config = LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=max_len,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    config.save_pretrained(out)
    return out


if __name__ == "__main__":
    import sys

    print(make_tiny_llama(Path(sys.argv[1]), Path(sys.argv[2])))
