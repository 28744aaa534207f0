"""Model configuration: transformers' `DeepseekV4Config` is the schema; this module only loads it and derives
the few serving-side numbers (rope tables, compression ratios) the engine needs."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DeepseekV4Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from evalpipe.engine.model.primitives import rotate_half_matrix

TINY_CONFIG_PATH = Path(__file__).with_name("tiny_config.json")

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def load_config(source: str | Path | dict) -> DeepseekV4Config:
    """A `DeepseekV4Config` from a checkpoint directory, a config.json path, or a plain dict."""
    if isinstance(source, dict):
        return DeepseekV4Config(**source)
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    data = json.loads(path.read_text())
    if data.get("model_type", "deepseek_v4") != "deepseek_v4":
        raise ValueError(f"{path}: model_type {data.get('model_type')!r} is not deepseek_v4")
    data.pop("transformers_version", None)
    return DeepseekV4Config(**{k: v for k, v in data.items() if k not in ("model_type", "architectures")})


def tiny_config() -> DeepseekV4Config:
    return load_config(TINY_CONFIG_PATH)


def config_hash(config: DeepseekV4Config) -> str:
    """Short stable hash of the config's content (keys sorted, version stamp dropped): names weight caches."""
    data = config.to_dict()
    for key in ("transformers_version", "_name_or_path", "dtype", "torch_dtype", "architectures"):
        data.pop(key, None)
    blob = json.dumps(data, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def compress_ratio(config: DeepseekV4Config, layer_type: str) -> int:
    return 0 if layer_type == SLIDING else int(config.compress_rates[layer_type])


@dataclass(frozen=True)
class RopeTable:
    """cos/sin per absolute position, already repeated per interleaved pair ([max_pos, rope_dim]); built with
    the same float ops as transformers (position * inv_freq, then cos/sin times attention scaling)."""

    cos: torch.Tensor
    sin: torch.Tensor
    rot: torch.Tensor  # [rope_dim, rope_dim] interleaved rotate-half (see primitives.apply_rope)

    @property
    def rope_dim(self) -> int:
        return self.cos.shape[-1]


def rope_tables(config: DeepseekV4Config, max_pos: int, device: str | torch.device = "cpu") -> dict[str, RopeTable]:
    """{"main": ..., "compress": ...}: sliding layers use main, compressed layers and their compressors compress."""
    tables = {}
    for label in ("main", "compress"):
        params = config.rope_parameters[label]
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            dim = int(config.head_dim * params.get("partial_rotary_factor", 1.0))
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", layer_type=label)
        positions = torch.arange(max_pos, dtype=torch.long)
        freqs = positions[:, None].float() * inv_freq.float()
        cos = (freqs.cos() * scaling).repeat_interleave(2, dim=-1)
        sin = (freqs.sin() * scaling).repeat_interleave(2, dim=-1)
        tables[label] = RopeTable(cos.to(device), sin.to(device), rotate_half_matrix(cos.shape[-1], device))
    return tables
