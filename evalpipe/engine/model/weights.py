"""Checkpoint I/O: read `*.safetensors` in either naming scheme transformers uses for DeepSeek-V4 (the original
checkpoint names that `save_pretrained` writes, or the module names of `DeepseekV4ForCausalLM`), and create the
seeded default tiny checkpoint.

Built-in models, by name (`resolve_model`): `evalpipe-skills-dsv4`, the default, trained on evalpipe.skills and
shipped in the package (its files are checked against the sha256 pins in manifests/default_model.json), and
`evalpipe-tiny-dsv4`, random weights from seed 0 created on first use (for tests).

Every tensor is returned under its transformers *module* name (e.g. `model.layers.0.self_attn.q_a_proj.weight`,
fused `mlp.experts.gate_up_proj`), which is the one vocabulary the engine reads."""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from evalpipe.digest import file_sha256
from evalpipe.engine.model.config import TINY_CONFIG_PATH, cache_root, config_hash, load_engine_config, tiny_config
from evalpipe.engine.model.names import DEFAULT_MODEL_NAME, PACKAGED_MODEL_NAMES, TINY_MODEL_NAME

# Original-checkpoint leaf names -> module names (suffix of a per-layer key after "layers.N.").
_LAYER_RENAMES = [
    ("attn.indexer.compressor.wkv.", "self_attn.compressor.indexer.kv_proj."),
    ("attn.indexer.compressor.wgate.", "self_attn.compressor.indexer.gate_proj."),
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    ("attn.indexer.compressor.norm.", "self_attn.compressor.indexer.kv_norm."),
    ("attn.indexer.wq_b.", "self_attn.compressor.indexer.q_b_proj."),
    ("attn.indexer.weights_proj.", "self_attn.compressor.indexer.scorer.weights_proj."),
    ("attn.compressor.wkv.", "self_attn.compressor.kv_proj."),
    ("attn.compressor.wgate.", "self_attn.compressor.gate_proj."),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    ("attn.compressor.norm.", "self_attn.compressor.kv_norm."),
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn.wq_a.", "self_attn.q_a_proj."),
    ("attn.q_norm.", "self_attn.q_a_norm."),
    ("attn.wq_b.", "self_attn.q_b_proj."),
    ("attn.wkv.", "self_attn.kv_proj."),
    ("attn.norm.", "self_attn.kv_norm."),
    ("attn.wo_a.", "self_attn.o_a_proj."),
    ("attn.wo_b.", "self_attn.o_b_proj."),
    ("attn_norm.", "input_layernorm."),
    ("ffn_norm.", "post_attention_layernorm."),
    ("hc_attn_fn", "attn_hc.fn"),
    ("hc_attn_base", "attn_hc.base"),
    ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"),
    ("hc_ffn_base", "ffn_hc.base"),
    ("hc_ffn_scale", "ffn_hc.scale"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.", "mlp.gate."),
    ("ffn.shared_experts.w1.", "mlp.shared_experts.gate_proj."),
    ("ffn.shared_experts.w2.", "mlp.shared_experts.down_proj."),
    ("ffn.shared_experts.w3.", "mlp.shared_experts.up_proj."),
]
_TOP_RENAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "embed_tokens.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
    "hc_head.hc_fn": "model.hc_head.hc_fn",
    "hc_head.hc_base": "model.hc_head.hc_base",
    "hc_head.hc_scale": "model.hc_head.hc_scale",
}
_LAYER_KEY = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
_EXPERT_KEY = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")


def module_name(key: str) -> str | tuple[int, int, str]:
    """Module name for a checkpoint key; per-expert original keys return (layer, expert, w1|w2|w3) to be fused."""
    if key == "lm_head.weight":
        return key
    m = _LAYER_KEY.match(key)
    if m is None:
        bare = key[len("model.") :] if key.startswith("model.") else key
        return _TOP_RENAMES.get(bare, key)
    layer, rest = int(m.group(1)), m.group(2)
    expert = _EXPERT_KEY.match(rest)
    if expert:
        return layer, int(expert.group(1)), expert.group(2)
    for old, new in _LAYER_RENAMES:
        if rest.startswith(old):
            rest = new + rest[len(old) :]
            break
    return f"model.layers.{layer}.{rest}"


def load_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of `model_dir/*.safetensors` under module names; unfused experts are fused like transformers
    (gate_up_proj = cat(w1, w3) per expert, down_proj = w2). MTP layers (`mtp.*`) are skipped."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.startswith("mtp.") or ".mtp." in key:
                    continue
                name = module_name(key)
                if isinstance(name, tuple):
                    layer, idx, which = name
                    experts.setdefault((layer, which), {})[idx] = f.get_tensor(key)
                else:
                    state[name] = f.get_tensor(key)
    _refuse_quantized(state, experts)
    layers = sorted({layer for layer, _ in experts})
    for layer in layers:
        w1, w2, w3 = (experts[(layer, w)] for w in ("w1", "w2", "w3"))
        order = sorted(w1)
        prefix = f"model.layers.{layer}.mlp.experts."
        state[prefix + "gate_up_proj"] = torch.stack([torch.cat([w1[e], w3[e]], dim=0) for e in order])
        state[prefix + "down_proj"] = torch.stack([w2[e] for e in order])
    return state


_QUANTIZED_DTYPES = {torch.int8, torch.uint8} | {
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float4_e2m1fn_x2")
    if hasattr(torch, n)
}


def _refuse_quantized(state: dict, experts: dict) -> None:
    """FP8 block-scaled / FP4-packed checkpoints (the official DeepSeek-V4 release) would be silently wrong after a
    plain dtype cast; say so instead. Dequantize them to bf16/fp32 first."""
    tensors = list(state.items()) + [(f"experts.{k}", t) for k, d in experts.items() for t in d.values()]
    bad = [name for name, t in tensors if t.dtype in _QUANTIZED_DTYPES or "scale_inv" in name]
    if bad:
        raise ValueError(
            f"quantized checkpoint tensors are not supported ({len(bad)}, e.g. {bad[0]}): "
            "convert the checkpoint to bfloat16/float32 weights first"
        )


def init_tiny_weights(config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random weights for `config` from `seed`, independent of transformers' initialisers: each
    tensor is drawn from its own generator seeded by (seed, name), so adding a tensor never shifts the others.
    Scales are chosen so the random model is not degenerate (non-zero sinks, biases, hash tables)."""
    from transformers import DeepseekV4ForCausalLM

    with torch.device("meta"):
        shapes = {k: (v.shape, v.dtype) for k, v in DeepseekV4ForCausalLM(config).state_dict().items()}
    state = {}
    for name in sorted(shapes):
        shape, dtype = shapes[name]
        gen = torch.Generator().manual_seed(seed * 1_000_003 + _name_seed(name) % (1 << 31))
        if name.endswith("tid2eid"):
            state[name] = torch.randint(0, config.n_routed_experts, shape, generator=gen, dtype=torch.long)
            continue
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name:  # RMSNorm gains around 1
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif leaf in ("sinks", "position_bias", "base", "hc_base", "e_score_correction_bias"):
            t = 0.5 * torch.randn(shape, generator=gen)
        elif leaf in ("scale", "hc_scale"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif "embed_tokens" in name:
            t = torch.randn(shape, generator=gen)
        else:  # projections: fan-in scaled so activations keep unit size
            fan_in = shape[-1]
            t = torch.randn(shape, generator=gen) / fan_in**0.5
        state[name] = t.to(dtype)
    return state


def _name_seed(name: str) -> int:
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)


def save_checkpoint(config, state: dict[str, torch.Tensor], out_dir: str | Path) -> Path:
    """Write config.json + safetensors through transformers' own `save_pretrained`, so the installed transformers
    can always load what we wrote (its on-disk key names differ between versions)."""
    from transformers import DeepseekV4ForCausalLM

    out_dir = Path(out_dir)
    with torch.device("meta"):  # no random init: every persistent tensor is assigned from `state`
        model = DeepseekV4ForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected or [k for k in missing if "rotary" not in k]:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    try:
        tmp.replace(out_dir)
    except OSError:
        if not (out_dir / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race; its copy is identical
    return out_dir


def default_checkpoint() -> Path:
    """Path of the random tiny checkpoint, created on first use under the cache dir (hash of the config in the
    path, so editing tiny_config.json never reuses stale weights), with the byte tokenizer's Hugging Face files."""
    from evalpipe.engine.tokenizer_files import ensure_tokenizer_files

    out = cache_root() / f"{TINY_MODEL_NAME}-{config_hash(load_engine_config(TINY_CONFIG_PATH))}-seed0"
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        config = tiny_config()
        save_checkpoint(config, init_tiny_weights(config, seed=0), out)
    try:
        ensure_tokenizer_files(out)  # Hugging Face tools read the folder offline (engine/tokenizer_files.py)
    except OSError:  # a read-only cache still serves: the engine's own tokenizer needs no files
        pass
    return out


PACKAGED_MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
MODEL_PINS = Path(__file__).resolve().parents[3] / "manifests" / "default_model.json"


def packaged_checkpoint(name: str = DEFAULT_MODEL_NAME) -> Path:
    """The shipped checkpoint folder, after checking every pinned file's sha256 (a corrupted or edited copy would
    silently change every number measured with it)."""
    import json

    folder = PACKAGED_MODELS_DIR / name
    pins = json.loads(MODEL_PINS.read_text())[name]["files"] if MODEL_PINS.is_file() else None
    if pins is None:
        raise FileNotFoundError(f"no sha256 pins for {name} at {MODEL_PINS}")
    for fname, want in pins.items():
        got = file_sha256(folder / fname) if (folder / fname).is_file() else "missing"
        if got != want:
            raise ValueError(
                f"{folder / fname}: sha256 {got} differs from the pin {want} in {MODEL_PINS}; "
                "reinstall evalpipe (a git checkout may need `git lfs`-free plain files)"
            )
    return folder


# name -> a function giving its checkpoint folder
BUILTIN_MODELS = {name: functools.partial(packaged_checkpoint, name) for name in PACKAGED_MODEL_NAMES}
BUILTIN_MODELS[TINY_MODEL_NAME] = default_checkpoint


def resolve_model(model: str | os.PathLike | None) -> tuple[Path, str]:
    """(checkpoint folder, served model name) for a built-in name (None: the default model) or a path."""
    name = DEFAULT_MODEL_NAME if model is None else str(model)
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name](), name
    path = Path(model)
    return path, path.resolve().name
