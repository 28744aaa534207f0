"""Model configuration: transformers' `DeepseekV4Config` is the schema and resolves every field (defaults, the
standardised RoPE parameters); this module loads it and derives the few serving-side numbers (rope tables,
compression ratios) the engine needs.

Importing transformers costs about a second of every engine start. So what transformers resolved for a config file
(every field, and each RoPE table's inverse frequencies and attention scaling) is kept in the evalpipe cache, keyed
by the file's bytes and transformers' version; a later start with the same file and version reads that record
(`ResolvedConfig`, `load_engine_config`) and does not import transformers. Tools that hand the configuration to
transformers (checkpoint writing, the oracle, training) take `load_config`, which is always transformers'."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from evalpipe.engine.model.primitives import rotate_half_matrix

TINY_CONFIG_PATH = Path(__file__).with_name("tiny_config.json")

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
ROPE_LABELS = ("main", "compress")


class ResolvedConfig(SimpleNamespace):
    """The fields transformers' `DeepseekV4Config` resolved for a config file, read back from the cache, plus
    `rope_inits`: {label: (inverse frequencies, attention scaling)} as transformers computed them."""

    def to_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "rope_inits"}


def load_config(source: str | Path | dict):
    """transformers' `DeepseekV4Config` from a checkpoint directory, a config.json path, or a plain dict."""
    return _transformers_config(source if isinstance(source, dict) else _read_config(source)[1])


def load_engine_config(source: str | Path):
    """The configuration an engine start reads: the `ResolvedConfig` cached for this file (see the module
    docstring), or on the first start transformers' `DeepseekV4Config`, whose resolution is then cached."""
    raw, data = _read_config(source)
    record = _resolved_path(raw)
    try:
        fields = json.loads(record.read_text())
        if all(label in fields["rope_inits"] for label in ROPE_LABELS):
            return ResolvedConfig(**fields)
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not resolved yet (or a record from an interrupted write): transformers resolves it
    config = _transformers_config(data)
    _save_resolved(record, config)
    return config


def _read_config(source: str | Path) -> tuple[bytes, dict]:
    """(the bytes, the parsed fields) of a checkpoint folder's or path's config.json, checked to be DeepSeek-V4."""
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    raw = path.read_bytes()
    data = json.loads(raw)
    if data.get("model_type", "deepseek_v4") != "deepseek_v4":
        raise ValueError(f"{path}: model_type {data.get('model_type')!r} is not deepseek_v4")
    return raw, data


def _transformers_config(data: dict):
    from transformers import DeepseekV4Config

    data = {k: v for k, v in data.items() if k not in ("model_type", "architectures", "transformers_version")}
    return DeepseekV4Config(**data)


def cache_root() -> Path:
    """Where evalpipe keeps what it builds once: the random tiny checkpoint (model/weights.py), resolved configs."""
    return Path(os.environ.get("EVALPIPE_CACHE_DIR") or Path.home() / ".cache" / "evalpipe")


def _resolved_path(raw: bytes) -> Path:
    version = importlib.metadata.version("transformers")
    key = hashlib.sha256(raw + b"\0transformers " + version.encode()).hexdigest()[:24]
    return cache_root() / "resolved-configs" / f"{key}.json"


def _save_resolved(record: Path, config) -> None:
    """Write the record atomically (a concurrent start reads a whole record or none); an unwritable cache only
    costs later starts the import."""
    fields = config.to_dict()
    inits = {label: _rope_init(config, label) for label in ROPE_LABELS}
    fields["rope_inits"] = {label: (inv.tolist(), scaling) for label, (inv, scaling) in inits.items()}
    tmp = record.with_name(f"{record.name}.tmp{os.getpid()}")
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(fields))
        tmp.replace(record)
    except (OSError, TypeError, ValueError):
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def _rope_init(config, label: str) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rope_dim / 2] float32, attention scaling) of one rope table."""
    inits = getattr(config, "rope_inits", None)
    if inits is not None:
        inv, scaling = inits[label]
        return torch.tensor(inv, dtype=torch.float32), float(scaling)
    params = config.rope_parameters[label]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = int(config.head_dim * params.get("partial_rotary_factor", 1.0))
        return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", layer_type=label)
    return inv_freq.float(), float(scaling)


def tiny_config():
    return load_config(TINY_CONFIG_PATH)


def config_hash(config) -> str:
    """Short stable hash of the config's content (keys sorted, version stamp dropped): names weight caches."""
    data = config.to_dict()
    for key in ("transformers_version", "_name_or_path", "dtype", "torch_dtype", "architectures"):
        data.pop(key, None)
    blob = json.dumps(data, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def compress_ratio(config, layer_type: str) -> int:
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


def rope_tables(config, max_pos: int, device: str | torch.device = "cpu") -> dict[str, RopeTable]:
    """{"main": ..., "compress": ...}: sliding layers use main, compressed layers and their compressors compress."""
    tables = {}
    for label in ROPE_LABELS:
        inv_freq, scaling = _rope_init(config, label)
        positions = torch.arange(max_pos, dtype=torch.long)
        freqs = positions[:, None].float() * inv_freq.float()
        cos = (freqs.cos() * scaling).repeat_interleave(2, dim=-1)
        sin = (freqs.sin() * scaling).repeat_interleave(2, dim=-1)
        tables[label] = RopeTable(cos.to(device), sin.to(device), rotate_half_matrix(cos.shape[-1], device))
    return tables
