"""A tiny random-weight vision-language checkpoint that vLLM serves as a real VLM, built offline in seconds.

The architecture is Idefics3 (SmolVLM's): a SigLIP-style vision tower, a pixel-shuffle projector and a Llama
decoder, at toy sizes, with weights drawn from a fixed seed and saved. Its processor is an Idefics3Processor made of
the PIL image processor (vLLM's environment has no torchvision) and SmolLM2's tokenizer, with SmolLM2's ChatML
template. Random weights still carry the image into the logits, which is all the vision gate needs to see. The
test builds it with vLLM's interpreter (`build_with`), so the saved config is one that vLLM's transformers reads.

Why not LLaVA itself: vLLM 0.32 imports its Pixtral module from llava.py, and that imports transformers' Pixtral
image processor, which needs torchvision; the only torchvision on the package registry that matches the vLLM
environment's torch (0.28.0 for torch 2.13.0) is a CUDA build whose ops library needs libtorch_cuda.so.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Where `make real-model` puts SmolLM2-135M-Instruct (its tokenizer is what the tiny VLM uses)
SMOLLM2_DIR = Path(os.environ.get("EVALPIPE_REAL_MODEL_DIR") or REPO / ".evalpipe-cache/models/SmolLM2-135M-Instruct")
IMAGE_SIZE = 32  # pixels a side the vision tower sees (the processor resizes every image to this)
PATCH_SIZE = 8
SCALE_FACTOR = 2  # the projector's pixel shuffle: (32 / 8) ** 2 / 2 ** 2 = 4 image tokens per image


def require_smollm2() -> Path:
    """SmolLM2's folder; skips (or, under CI, fails) when `make real-model` has not built it."""
    import pytest

    if (SMOLLM2_DIR / "tokenizer.json").exists():
        return SMOLLM2_DIR
    reason = f"no SmolLM2-135M-Instruct tokenizer at {SMOLLM2_DIR} (`make real-model` builds it)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the real-vLLM tests: {reason}")
    pytest.skip(reason)


def build_with(python: str, out: Path, tokenizer_dir: Path) -> Path:
    """make_tiny_vlm run by `python` (vLLM's, so that the transformers which reads the folder also wrote it)."""
    subprocess.run([python, "-m", "tests.support.tiny_vlm", str(out), str(tokenizer_dir)], cwd=REPO, check=True)
    return Path(out)


def make_tiny_vlm(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write the checkpoint (config, safetensors, tokenizer, processor) into `out`; returns `out`."""
    import torch
    from transformers import AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.llama import LlamaConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<global-img>"]})
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
        do_image_splitting=False,
    )
    image_seq_len = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
    # the processor adds its image tokens (<fake_token_around_image>, <image>, <end_of_utterance>) to the tokenizer
    processor = Idefics3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_len=image_seq_len, chat_template=tokenizer.chat_template
    )
    # head_dim 32 throughout: the smallest head size vLLM's CPU attention kernels support
    vision = Idefics3VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    config = Idefics3Config(
        vision_config=vision,
        text_config=text,
        scale_factor=SCALE_FACTOR,
        image_token_id=processor.image_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32).eval()
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


if __name__ == "__main__":
    import sys

    print(make_tiny_vlm(Path(sys.argv[1]), Path(sys.argv[2])))
