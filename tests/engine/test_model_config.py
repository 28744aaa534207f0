"""The config loader's cache of what transformers resolved (engine/model/config.py): a later engine start reads the
cached record instead of importing transformers, and gets the same fields, weight-cache hash and RoPE tables,
bit for bit; a damaged record or an unwritable cache only costs the import."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from evalpipe.engine.model.config import TINY_CONFIG_PATH, config_hash, load_config, load_engine_config, rope_tables
from evalpipe.engine.model.weights import resolve_model

PROBE = """
import hashlib, json, sys
from evalpipe.engine.model.config import config_hash, load_engine_config, rope_tables
config = load_engine_config(sys.argv[1])
tables = rope_tables(config, 4096)
digest = hashlib.sha256(b"".join(t.cos.numpy().tobytes() + t.sin.numpy().tobytes() for t in tables.values()))
print(json.dumps({"type": type(config).__name__, "hash": config_hash(config), "tables": digest.hexdigest(),
                  "transformers_imported": "transformers" in sys.modules}))
"""


def probe(path, cache_dir) -> dict:
    env = {**os.environ, "EVALPIPE_CACHE_DIR": str(cache_dir)}
    proc = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def transformers_view(path) -> dict:
    """The same numbers from transformers' DeepseekV4Config, built here without the cache."""
    from transformers import DeepseekV4Config

    data = json.loads((path if path.suffix == ".json" else path / "config.json").read_text())
    for key in ("model_type", "architectures", "transformers_version"):
        data.pop(key, None)
    config = DeepseekV4Config(**data)
    tables = rope_tables(config, 4096)
    digest = hashlib.sha256(b"".join(t.cos.numpy().tobytes() + t.sin.numpy().tobytes() for t in tables.values()))
    return {"hash": config_hash(config), "tables": digest.hexdigest()}


@pytest.mark.parametrize("model", ["tiny config", "evalpipe-skills-dsv4"])
def test_a_second_start_reads_the_record_and_gets_the_same_config_without_transformers(model, tmp_path):
    path = TINY_CONFIG_PATH if model == "tiny config" else resolve_model(model)[0]
    want = transformers_view(path)
    first, second = probe(path, tmp_path), probe(path, tmp_path)
    assert first == {**want, "type": "DeepseekV4Config", "transformers_imported": True}
    assert second == {**want, "type": "ResolvedConfig", "transformers_imported": False}
    assert len(list((tmp_path / "resolved-configs").glob("*.json"))) == 1


def test_load_config_is_always_transformers_config_for_tools_that_hand_it_on(tmp_path, monkeypatch):
    monkeypatch.setenv("EVALPIPE_CACHE_DIR", str(tmp_path))
    load_engine_config(TINY_CONFIG_PATH)  # the record exists now
    assert type(load_config(TINY_CONFIG_PATH)).__name__ == "DeepseekV4Config"


def test_the_record_keeps_every_field_transformers_resolved(tmp_path, monkeypatch):
    monkeypatch.setenv("EVALPIPE_CACHE_DIR", str(tmp_path))
    cold, warm = load_engine_config(TINY_CONFIG_PATH), load_engine_config(TINY_CONFIG_PATH)
    assert type(warm).__name__ == "ResolvedConfig"
    assert warm.to_dict() == json.loads(json.dumps(cold.to_dict()))
    for field in ("layer_types", "compress_rates", "rope_parameters", "hc_mult", "index_topk", "hidden_act"):
        assert getattr(warm, field) == getattr(cold, field)


def test_a_damaged_record_is_resolved_again_and_rewritten(tmp_path, monkeypatch):
    monkeypatch.setenv("EVALPIPE_CACHE_DIR", str(tmp_path))
    load_engine_config(TINY_CONFIG_PATH)
    (record,) = (tmp_path / "resolved-configs").glob("*.json")
    record.write_text(record.read_text()[:100])  # an interrupted write of another tool
    assert type(load_engine_config(TINY_CONFIG_PATH)).__name__ == "DeepseekV4Config"  # resolved by transformers again
    assert json.loads(record.read_text())["hidden_size"] == 256  # whole again


def test_another_file_gets_its_own_record(tmp_path, monkeypatch):
    monkeypatch.setenv("EVALPIPE_CACHE_DIR", str(tmp_path / "cache"))
    edited = json.loads(TINY_CONFIG_PATH.read_text())
    edited["sliding_window"] = 16
    other = tmp_path / "config.json"
    other.write_text(json.dumps(edited))
    load_engine_config(TINY_CONFIG_PATH), load_engine_config(other)
    assert load_engine_config(other).sliding_window == 16 and load_engine_config(TINY_CONFIG_PATH).sliding_window == 24
    assert len(list((tmp_path / "cache" / "resolved-configs").glob("*.json"))) == 2


def test_an_unwritable_cache_only_costs_the_import(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # the cache folder would have to be made inside a file: mkdir fails, even as root
    monkeypatch.setenv("EVALPIPE_CACHE_DIR", str(blocker / "cache"))
    assert type(load_engine_config(TINY_CONFIG_PATH)).__name__ == "DeepseekV4Config"
    assert not (blocker / "cache").exists()


def test_a_file_that_is_not_a_file_or_not_deepseek_v4_is_refused(tmp_path):
    for load in (load_config, load_engine_config):
        with pytest.raises(FileNotFoundError):
            load(tmp_path / "none")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for load in (load_config, load_engine_config):
        with pytest.raises(ValueError, match="not deepseek_v4"):
            load(tmp_path)


def test_rope_tables_of_the_record_are_float32_like_the_tables_of_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("EVALPIPE_CACHE_DIR", str(tmp_path))
    load_engine_config(TINY_CONFIG_PATH)
    tables = rope_tables(load_engine_config(TINY_CONFIG_PATH), 8)
    assert all(t.cos.dtype == torch.float32 and t.cos.shape == (8, 16) for t in tables.values())
