"""Launchers: exact dry-run argv per engine and profile, refusals, environment hygiene in a real child process,
receipts, and a server that never becomes ready (log tail shown, whole process group gone).

Here argv is checked through --dry-run and process handling through a scripted stand-in server
(tests/support/fake_engine_server.py) started via --engine-command; a real vLLM runs in tests/interop/test_vllm_peer.py.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from evalpipe.commands.serve import command as launch_command
from evalpipe.launchers import LaunchOptions, make_launcher
from evalpipe.launchers.base import free_port, group_members
from evalpipe.launchers.env import build_child_env, redact_argv, redact_env
from evalpipe.launchers.flags import given, needs_launcher
from evalpipe.launchers.receipts import effective_problems, receipt_differences
from tests.support.cli_fork_server import alive

PY = sys.executable
FAKE = str(Path(__file__).resolve().parents[1] / "support" / "fake_engine_server.py")
SGL = [PY, "-m", "sglang.launch_server"]
VLLM_PY = "/opt/vllm-env/bin/python"  # --engine-python: the argv names it as given (made absolute)
VLLM = [VLLM_PY, "-m", "vllm.entrypoints.openai.api_server"]
EP = ["--engine-python", VLLM_PY]
NATIVE = [PY, "-m", "evalpipe.cli", "serve"]
T1 = ["--speculative-accept-threshold-single", "1.0", "--speculative-accept-threshold-acc", "1.0"]


def dry_run(args: list[str], env: dict | None = None) -> dict:
    result = CliRunner().invoke(launch_command, ["--dry-run", "--json", *args], env=env, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def refused(args: list[str]) -> str:
    result = CliRunner().invoke(launch_command, ["--dry-run", *args])
    assert result.exit_code == 2, result.output
    return result.output


DRY_RUN_CASES = {
    "sglang-off": (
        ["--engine", "sglang", "--model", "M", "--tp", "8", "--port", "31000"],
        [*SGL, "--model-path", "M", "--host", "127.0.0.1", "--port", "31000", "--tp-size", "8"],
    ),
    "sglang-dspark-multinode": (
        [
            "--engine",
            "sglang",
            "--model",
            "deepseek-ai/DeepSeek-V4-Flash",
            "--tp",
            "16",
            "--ep",
            "16",
            "--dp",
            "2",
            "--speculative",
            "dspark",
            "--draft-model",
            "deepseek-ai/DeepSeek-V4-Flash-DSpark",
            "--block-size",
            "7",
            "--deterministic",
            "--host",
            "0.0.0.0",
            "--",
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--dist-init-addr",
            "10.0.0.1:5000",
            "--mem-fraction-static",
            "0.8",
        ],
        [
            *SGL,
            "--model-path",
            "deepseek-ai/DeepSeek-V4-Flash",
            "--host",
            "0.0.0.0",
            "--port",
            "30000",
            "--tp-size",
            "16",
            "--ep-size",
            "16",
            "--dp-size",
            "2",
            "--speculative-algorithm",
            "DSPARK",
            "--speculative-draft-model-path",
            "deepseek-ai/DeepSeek-V4-Flash-DSpark",
            "--speculative-dspark-block-size",
            "7",
            *T1,
            "--enable-deterministic-inference",
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--dist-init-addr",
            "10.0.0.1:5000",
            "--mem-fraction-static",
            "0.8",
        ],
    ),
    "sglang-dspark-checkpoint-block": (
        ["--engine", "sglang", "--model", "M", "--speculative", "dspark", "--draft-model", "D"],
        [
            *SGL,
            "--model-path",
            "M",
            "--host",
            "127.0.0.1",
            "--port",
            "30000",
            "--speculative-algorithm",
            "DSPARK",
            "--speculative-draft-model-path",
            "D",
            *T1,
        ],
    ),
    "sglang-eagle-tree": (
        [
            "--engine",
            "sglang",
            "--model",
            "M",
            "--speculative",
            "eagle",
            "--draft-model",
            "D",
            "--spec-steps",
            "5",
            "--spec-topk",
            "4",
            "--spec-draft-tokens",
            "8",
        ],
        [
            *SGL,
            "--model-path",
            "M",
            "--host",
            "127.0.0.1",
            "--port",
            "30000",
            "--speculative-algorithm",
            "EAGLE",
            "--speculative-draft-model-path",
            "D",
            "--speculative-num-steps",
            "5",
            "--speculative-eagle-topk",
            "4",
            "--speculative-num-draft-tokens",
            "8",
            *T1,
        ],
    ),
    "sglang-eagle3-auto": (
        ["--engine", "sglang", "--model", "M", "--speculative", "eagle3", "--draft-model", "D"],
        [
            *SGL,
            "--model-path",
            "M",
            "--host",
            "127.0.0.1",
            "--port",
            "30000",
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-draft-model-path",
            "D",
            *T1,
        ],
    ),
    "sglang-nextn-mtp": (
        [
            "--engine",
            "sglang",
            "--model",
            "M",
            "--speculative",
            "nextn",
            "--spec-steps",
            "3",
            "--spec-topk",
            "1",
            "--spec-draft-tokens",
            "4",
            "--api-key",
            "sk-secret",
        ],
        [
            *SGL,
            "--model-path",
            "M",
            "--host",
            "127.0.0.1",
            "--port",
            "30000",
            "--api-key",
            "<redacted>",
            "--speculative-algorithm",
            "NEXTN",
            "--speculative-num-steps",
            "3",
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            "4",
            *T1,
        ],
    ),
    "vllm-off-parallel": (
        ["--engine", "vllm", "--model", "M", "--tp", "8", "--dp", "2", "--ep", "16", *EP],
        [
            *VLLM,
            "--model",
            "M",
            "--host",
            "127.0.0.1",
            "--port",
            "30000",
            "--tensor-parallel-size",
            "8",
            "--data-parallel-size",
            "2",
            "--enable-expert-parallel",
            "--enable-prompt-tokens-details",
        ],
    ),
    "vllm-dspark": (
        ["--engine", "vllm", "--model", "M", "--speculative", "dspark", "--draft-model", "D", "--block-size", "7", *EP],
        [
            *VLLM,
            "--model",
            "M",
            "--host",
            "127.0.0.1",
            "--port",
            "30000",
            "--speculative-config",
            '{"method":"dspark","model":"D","num_speculative_tokens":7}',
            "--enable-prompt-tokens-details",
        ],
    ),
    "vllm-eagle3": (
        [
            "--engine",
            "vllm",
            "--model",
            "M",
            "--speculative",
            "eagle3",
            "--draft-model",
            "D",
            "--spec-steps",
            "3",
            "--spec-topk",
            "1",
            "--spec-draft-tokens",
            "4",
            *EP,
            "--max-num-seqs",
            "64",
        ],
        [
            *VLLM,
            "--model",
            "M",
            "--host",
            "127.0.0.1",
            "--port",
            "30000",
            "--speculative-config",
            '{"method":"eagle3","model":"D","num_speculative_tokens":3}',
            "--enable-prompt-tokens-details",
            "--max-num-seqs",
            "64",
        ],
    ),
    "vllm-nextn-mtp": (
        ["--engine", "vllm", "--model", "M", "--speculative", "nextn", "--spec-steps", "1", *EP],
        [
            *VLLM,
            "--model",
            "M",
            "--host",
            "127.0.0.1",
            "--port",
            "30000",
            "--speculative-config",
            '{"method":"mtp","num_speculative_tokens":1}',
            "--enable-prompt-tokens-details",
        ],
    ),
    "vllm-ngram": (
        [
            "--engine",
            "vllm",
            "--model",
            "M",
            "--speculative",
            "ngram",
            "--spec-steps",
            "3",
            "--ngram-min",
            "2",
            "--ngram-max",
            "4",
            *EP,
            "--",
            "--load-format",
            "dummy",
        ],
        [
            *VLLM,
            "--model",
            "M",
            "--host",
            "127.0.0.1",
            "--port",
            "30000",
            "--speculative-config",
            '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":4,"prompt_lookup_min":2}',
            "--enable-prompt-tokens-details",
            "--load-format",
            "dummy",
        ],
    ),
    "sglang-other-env": (
        ["--engine", "sglang", "--model", "M", "--engine-python", "/opt/sgl/bin/python"],
        [
            "/opt/sgl/bin/python",
            "-m",
            "sglang.launch_server",
            "--model-path",
            "M",
            "--host",
            "127.0.0.1",
            "--port",
            "30000",
        ],
    ),
    "native-default": ([], [*NATIVE, "--host", "127.0.0.1", "--port", "30000"]),
    "native-off": (
        ["--speculative", "off", "--port", "0"],
        [*NATIVE, "--host", "127.0.0.1", "--port", "0", "--speculative", "off"],
    ),
    "native-block": (
        [
            "--engine",
            "native",
            "--speculative",
            "block",
            "--block-size",
            "5",
            "--drafter",
            "layerskip:2",
            "--dtype",
            "float32",
            "--max-batch",
            "16",
            "--some-future-flag",
            "x",
        ],
        [
            *NATIVE,
            "--host",
            "127.0.0.1",
            "--port",
            "30000",
            "--dtype",
            "float32",
            "--max-batch",
            "16",
            "--speculative",
            "block",
            "--block-size",
            "5",
            "--drafter",
            "layerskip:2",
            "--some-future-flag",
            "x",
        ],
    ),
}


@pytest.mark.parametrize("case", sorted(DRY_RUN_CASES))
def test_dry_run_argv_is_exact(case):
    args, expected = DRY_RUN_CASES[case]
    plan = dry_run(args)
    assert plan["argv"] == expected
    assert plan["performance_only"] is False
    assert plan["lossy_acceptance"] is None


def test_dry_run_simulation_only_through_its_flag():
    sgl = dry_run(
        [
            "--engine",
            "sglang",
            "--model",
            "M",
            "--speculative",
            "dspark",
            "--draft-model",
            "D",
            "--simulate-acc-len",
            "3.5",
        ]
    )
    assert sgl["env_set"] == {"SGLANG_SIMULATE_ACC_LEN": "3.5"} and sgl["performance_only"] is True
    vllm = dry_run(
        [
            "--engine",
            "vllm",
            "--model",
            "M",
            "--speculative",
            "eagle",
            "--draft-model",
            "D",
            "--spec-steps",
            "3",
            "--simulate-acc-len",
            "2.5",
            *EP,
        ]
    )
    config = json.loads(vllm["argv"][vllm["argv"].index("--speculative-config") + 1])
    assert config["rejection_sample_method"] == "synthetic" and config["synthetic_acceptance_length"] == 2.5
    native = dry_run(["--speculative", "block", "--simulate-acc-len", "5.5"])
    assert native["argv"][-2:] == ["--simulate-acc-len", "5.5"]
    deterministic = dry_run(["--engine", "vllm", "--model", "M", "--deterministic", *EP])
    assert deterministic["env_set"] == {"VLLM_BATCH_INVARIANT": "1"}


@pytest.mark.parametrize(
    "args, message",
    [
        (
            [
                "--engine",
                "sglang",
                "--model",
                "M",
                "--speculative",
                "eagle",
                "--draft-model",
                "D",
                "--",
                "--speculative-accept-threshold-single",
                "0.9",
            ],
            "lossy",
        ),
        (
            [
                "--engine",
                "sglang",
                "--model",
                "M",
                "--speculative",
                "eagle",
                "--draft-model",
                "D",
                "--speculative-accept-threshold-acc=0.5",
            ],
            "lossy",
        ),
        (
            ["--engine", "sglang", "--model", "M", "--speculative", "eagle", "--draft-model", "D", "--spec-steps", "3"],
            "together",
        ),
        (
            [
                "--engine",
                "sglang",
                "--model",
                "M",
                "--speculative",
                "eagle",
                "--draft-model",
                "D",
                "--spec-steps",
                "3",
                "--spec-topk",
                "1",
                "--spec-draft-tokens",
                "8",
            ],
            "steps + 1",
        ),
        (["--engine", "sglang", "--model", "M", "--speculative", "dspark"], "--draft-model"),
        (
            [
                "--engine",
                "sglang",
                "--model",
                "M",
                "--speculative",
                "dspark",
                "--draft-model",
                "D",
                "--spec-steps",
                "2",
                "--spec-topk",
                "1",
                "--spec-draft-tokens",
                "3",
            ],
            "dspark fixes the tree",
        ),
        (["--engine", "sglang", "--model", "M", "--block-size", "4"], "--speculative off"),
        (["--engine", "sglang", "--model", "M", "--", "--port", "1"], "--port is set by evalpipe"),
        (["--engine", "sglang", "--model", "M", "--speculative", "block"], "one of"),
        (["--engine", "sglang"], "needs --model"),
        (
            [
                "--engine",
                "vllm",
                "--model",
                "M",
                "--speculative",
                "eagle",
                "--draft-model",
                "D",
                "--spec-steps",
                "3",
                "--spec-topk",
                "2",
                "--spec-draft-tokens",
                "4",
            ],
            "linear chain",
        ),
        (["--engine", "vllm", "--model", "M", "--tp", "8", "--ep", "4"], "TP x DP"),
        (["--engine", "vllm", "--model", "M", "--speculative", "dspark", "--draft-model", "D"], "--block-size"),
        (
            ["--engine", "vllm", "--model", "M", "--speculative", "ngram", "--spec-steps", "3", "--draft-model", "D"],
            "drafts from the prompt itself",
        ),
        (
            [
                "--engine",
                "vllm",
                "--model",
                "M",
                "--speculative",
                "ngram",
                "--spec-steps",
                "3",
                "--ngram-min",
                "5",
                "--ngram-max",
                "2",
            ],
            "above --ngram-max",
        ),
        (["--engine", "vllm", "--model", "M", "--ngram-max", "2"], "need --speculative ngram"),
        (["--engine", "vllm", "--model", "M", "--device", "cpu"], "takes its device from its build"),
        (["--engine", "vllm", "--model", "M", "--engine-python", "/x/python", "--engine-command", "wrap"], "not both"),
        (["--engine", "sglang", "--model", "M", "--speculative", "ngram"], "one of"),
        (["--engine-python", "/x/python"], "runs in this interpreter"),
        (["--tp", "2"], "one device"),
        (["--speculative", "dspark"], "off or block"),
        (["--simulate-acc-len", "3"], "needs --speculative block"),
        (["--engine", "sglang", "--model", "M", "--simulate-acc-len", "3"], "needs a speculation profile"),
        (["--engine", "sglang", "--model", "M", "--keep-env", "SGLANG_SIMULATE_*"], "--simulate-acc-len"),
        (["--engine", "sglang", "--model", "M", "--set-env", "SGLANG_SIMULATE_ACC_LEN=4"], "--simulate-acc-len"),
        (["--engine", "sglang", "--model", "M", "--set-env", "NOEQUALS"], "NAME=VALUE"),
        (["--spec-accept-topk", "3"], "need a speculation profile"),
        (["--speculative", "block", "--spec-accept-topk", "1"], "K >= 2"),
        (["--speculative", "block", "--spec-accept-topk", "3", "--spec-accept-threshold-acc", "0.5"], "choose one"),
        (["--speculative", "block", "--spec-accept-threshold-single", "1.5"], "[0, 1]"),
        (["--speculative", "block", "--spec-accept-topk", "3", "--simulate-acc-len", "3"], "nothing to decide"),
        (
            [
                "--engine",
                "sglang",
                "--model",
                "M",
                "--speculative",
                "eagle",
                "--draft-model",
                "D",
                "--spec-accept-topk",
                "3",
            ],
            "no top-k acceptance",
        ),
        (
            [
                "--engine",
                "sglang",
                "--model",
                "M",
                "--speculative",
                "eagle",
                "--draft-model",
                "D",
                "--spec-accept-threshold-acc",
                "0.5",
                "--",
                "--speculative-accept-threshold-acc",
                "1.0",
            ],
            "given twice",
        ),
        (
            [
                "--engine",
                "vllm",
                "--model",
                "M",
                "--speculative",
                "eagle",
                "--draft-model",
                "D",
                "--spec-steps",
                "3",
                "--spec-accept-threshold-single",
                "0.5",
            ],
            "no acceptance thresholds",
        ),
    ],
)
def test_refusals_are_usage_errors(args, message):
    assert message in refused(args)


def test_lossy_acceptance_only_on_purpose_and_recorded():
    """`--spec-accept-*` are the only way to ask for lossy acceptance; the plan (and the receipt) record it."""
    native = dry_run(["--speculative", "block", "--spec-accept-topk", "3"])
    assert native["argv"][-2:] == ["--spec-accept-topk", "3"] and native["lossy_acceptance"] == {"topk": 3}
    native_thr = dry_run(["--speculative", "block", "--spec-accept-threshold-single", "0.4"])
    assert native_thr["argv"][-2:] == ["--spec-accept-threshold-single", "0.4"]
    assert native_thr["lossy_acceptance"] == {"threshold_single": 0.4}
    args = [
        "--engine",
        "sglang",
        "--model",
        "M",
        "--speculative",
        "eagle",
        "--draft-model",
        "D",
        "--spec-accept-threshold-single",
        "0.5",
    ]
    sgl = dry_run(args)
    i = sgl["argv"].index("--speculative-accept-threshold-single")
    assert sgl["argv"][i : i + 4] == [
        "--speculative-accept-threshold-single",
        "0.5",
        "--speculative-accept-threshold-acc",
        "1.0",
    ]
    assert sgl["lossy_acceptance"] == {"threshold_single": 0.5}
    text = CliRunner().invoke(launch_command, ["--dry-run", *args]).output
    assert "# LOSSY ACCEPTANCE" in text
    lossless = dry_run(
        [
            "--engine",
            "sglang",
            "--model",
            "M",
            "--speculative",
            "eagle",
            "--draft-model",
            "D",
            "--spec-accept-threshold-single",
            "1.0",
        ]
    )
    assert lossless["lossy_acceptance"] is None  # 1.0 is SGLang's lossless default


def test_server_reported_acceptance_must_match_the_request():
    exact = make_launcher(LaunchOptions(engine="sglang", model="M", speculative="eagle", draft_model="D"))
    asked = make_launcher(
        LaunchOptions(engine="sglang", model="M", speculative="eagle", draft_model="D", spec_accept_threshold_acc=0.7)
    )
    lossy_info = {"speculative_accept_threshold_single": 1.0, "speculative_accept_threshold_acc": 0.7}
    exact_info = {"speculative_accept_threshold_single": 1.0, "speculative_accept_threshold_acc": 1.0}
    assert any("lossy acceptance" in p for p in effective_problems(exact, lossy_info))
    assert effective_problems(asked, lossy_info) == []
    assert any("does not report it" in p for p in effective_problems(asked, exact_info))
    native = make_launcher(LaunchOptions(engine="native", speculative="block"))
    native_lossy = {"speculative": {"mode": "block", "accept": {"rule": "topk", "k": 3, "lossy": True}}}
    assert any("speculative.accept.lossy" in p for p in effective_problems(native, native_lossy))
    topk = make_launcher(LaunchOptions(engine="native", speculative="block", spec_accept_topk=3))
    assert effective_problems(topk, native_lossy) == []


def test_env_hygiene_rules():
    parent = {
        "PATH": "/bin",
        "SGLANG_FOO": "1",
        "VLLM_BAR": "2",
        "SGLANG_SIMULATE_ACC_LEN": "3",
        "VLLM_KEEP": "k",
        "SGLANG_ENABLE_SPEC_V2": "True",
    }
    child = build_child_env(parent, keep=["VLLM_KEEP"], set_vars={"SGLANG_ENABLE_SPEC_V2": "False"})
    assert child.env == {"PATH": "/bin", "VLLM_KEEP": "k", "SGLANG_ENABLE_SPEC_V2": "False"}
    assert child.removed == ["SGLANG_ENABLE_SPEC_V2", "SGLANG_FOO", "SGLANG_SIMULATE_ACC_LEN", "VLLM_BAR"]
    assert child.kept == ["VLLM_KEEP"]
    env = {"HF_TOKEN": "t", "OPENAI_API_KEY": "k", "DB_PASSWORD": "p", "AWS_SECRET": "s", "HOME": "/h"}
    assert redact_env(env) == {
        "AWS_SECRET": "<redacted>",
        "DB_PASSWORD": "<redacted>",
        "HF_TOKEN": "<redacted>",
        "HOME": "/h",
        "OPENAI_API_KEY": "<redacted>",
    }
    assert redact_argv(["x", "--api-key", "k", "--hf-token=t", "--tokenizer-path", "tok", "--max-num-tokens", "5"]) == [
        "x",
        "--api-key",
        "<redacted>",
        "--hf-token=<redacted>",
        "--tokenizer-path",
        "tok",
        "--max-num-tokens",
        "5",
    ]


def wants_launcher(args: list[str]) -> bool:
    ctx = launch_command.make_context("serve", list(args))
    return needs_launcher(ctx.params, given(ctx))


def test_dispatch_rule_for_serve_hook():
    assert wants_launcher(["--engine", "sglang", "--model", "M"])
    assert wants_launcher(["--engine=vllm"])
    assert wants_launcher(["--dry-run"])
    assert not wants_launcher(["--engine", "native", "--port", "1"])
    assert not wants_launcher(["--port", "1", "--", "--dry-run"])


def test_receipt_differences_explained_only_by_declared_flags():
    base = {
        "engine": "sglang",
        "engine_version": "0.5.23",
        "gpus": ["GPU 0"],
        "env": {"PATH": "/bin"},
        "models": {"data": [{"id": "m", "created": 1}]},
        "server_info": {
            "port": 1,
            "tp_size": 8,
            "speculative_algorithm": None,
            "speculative_num_steps": None,
            "internal_states": [{"avg_spec_accept_length": 1.0}],
            "mem_fraction_static": 0.8,
        },
    }
    other = json.loads(json.dumps(base))
    other["models"]["data"][0]["created"] = 2
    other["server_info"].update(
        port=2,
        speculative_algorithm="DSPARK",
        speculative_num_steps=1,
        internal_states=[{"avg_spec_accept_length": 3.2}],
    )
    assert receipt_differences(base, base) == []
    assert receipt_differences(base, other, declared=["speculative", "draft_model"]) == []
    problems = receipt_differences(base, other, declared=[])
    assert problems == [
        "server setting speculative_algorithm: A=None B='DSPARK'",
        "server setting speculative_num_steps: A=None B=1",
    ]
    other["server_info"]["mem_fraction_static"] = 0.7
    other["engine_version"] = "0.5.24"
    problems = receipt_differences(base, other, declared=["speculative"])
    assert problems == ["engine_version: A='0.5.23' B='0.5.24'", "server setting mem_fraction_static: A=0.8 B=0.7"]
    assert receipt_differences(base, other, declared=["speculative"], allow=["mem_fraction*", "engine_version"]) == [
        "engine_version: A='0.5.23' B='0.5.24'"
    ]
    # another engine build (--engine-command pointing at another venv) is a declared difference
    assert receipt_differences(base, other, declared=["engine_command"], allow=["mem_fraction*"]) == [
        "server setting speculative_algorithm: A=None B='DSPARK'",
        "server setting speculative_num_steps: A=None B=1",
    ]


# ----- real processes -------------------------------------------------------------------------------------


def _launch(args: list[str], env_extra: dict, tmp_path: Path) -> subprocess.Popen:
    env = {**os.environ, **env_extra}
    return subprocess.Popen(
        [PY, "-m", "evalpipe.cli", "serve", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )


def test_polluted_environment_never_reaches_a_real_server_and_receipt_is_complete(tmp_path):
    port = free_port()
    receipt = tmp_path / "receipt.json"
    polluted = {
        "SGLANG_FOO": "1",
        "VLLM_BAR": "2",
        "SGLANG_SIMULATE_ACC_LEN": "3",
        "VLLM_KEEP": "kept",
        "MY_API_KEY": "s3cret",
        "HF_TOKEN": "hf_s3cret",
    }
    proc = _launch(
        [
            "--engine",
            "sglang",
            "--model",
            "some/model",
            "--port",
            str(port),
            "--api-key",
            "sk-s3cret",
            "--keep-env",
            "VLLM_KEEP",
            "--set-env",
            "SGLANG_ENABLE_SPEC_V2=True",
            "--receipt",
            str(receipt),
            "--engine-command",
            f"{shlex.quote(PY)} {shlex.quote(FAKE)} --fake-mode ready",
            "--ready-timeout",
            "60",
        ],
        polluted,
        tmp_path,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"ready: http://127.0.0.1:{port}/v1"), (line, proc.stderr.read() if proc.poll() else "")
        data = json.loads(receipt.read_text())
        # the child's real environment, read from the process table and from its own report
        environ = dict(
            item.split("=", 1)
            for item in Path(f"/proc/{data['pid']}/environ").read_bytes().decode().split("\0")
            if "=" in item
        )
        for name in ("SGLANG_FOO", "VLLM_BAR", "SGLANG_SIMULATE_ACC_LEN"):
            assert name not in environ and name not in data["server_info"]["environ"]
        assert environ["VLLM_KEEP"] == "kept" and environ["SGLANG_ENABLE_SPEC_V2"] == "True"
        assert data["server_info"]["environ"] == {"VLLM_KEEP": "kept", "SGLANG_ENABLE_SPEC_V2": "True"}
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    data = json.loads(receipt.read_text())
    text = receipt.read_text()
    assert "s3cret" not in text  # api key in argv, MY_API_KEY and HF_TOKEN in env: all redacted
    log = receipt.with_suffix(".log").read_text()  # the engine printed its argv, key included
    assert "fake engine starting" in log and "--api-key" in log and "s3cret" not in log
    assert data["env"]["MY_API_KEY"] == "<redacted>" and data["env"]["HF_TOKEN"] == "<redacted>"
    assert data["argv"][data["argv"].index("--api-key") + 1] == "<redacted>"
    assert data["env_removed"] == ["SGLANG_FOO", "SGLANG_SIMULATE_ACC_LEN", "VLLM_BAR"]
    assert data["env_kept"] == ["VLLM_KEEP"]
    assert data["engine"] == "sglang" and data["engine_version"] == "0.0-fake"
    assert data["server_info_path"] == "/get_server_info"
    assert data["models"]["data"][0]["id"] == "fake-model"
    assert data["started_at"] <= data["ready_at"] <= data["stopped_at"]
    assert "gpus" in data and not alive(data["pid"])
    assert not group_members(data["pid"])


def test_server_that_never_becomes_ready_fails_with_log_tail_and_no_orphan(tmp_path):
    pidfile = tmp_path / "pids.json"
    start = time.monotonic()
    proc = _launch(
        [
            "--engine",
            "sglang",
            "--model",
            "M",
            "--port",
            str(free_port()),
            "--receipt",
            str(tmp_path / "r.json"),
            "--engine-command",
            f"{shlex.quote(PY)} {shlex.quote(FAKE)} --fake-mode 503 --fake-pidfile {pidfile}",
            "--ready-timeout",
            "4",
        ],
        {},
        tmp_path,
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, (out, err)
    assert "not ready after 4s" in err and "HTTP 503" in err
    assert "fake engine: still warming up" in err  # the server's own log tail
    assert time.monotonic() - start < 40
    pids = json.loads(pidfile.read_text())
    assert not alive(pids["server"]) and not alive(pids["child"])  # the server's own child died with it
    assert not group_members(pids["server"])
    receipt = json.loads((tmp_path / "r.json").read_text())
    assert receipt["ready_at"] is None and receipt["stopped_at"] is not None


def test_server_that_exits_early_and_one_that_never_listens(tmp_path):
    proc = _launch(
        [
            "--engine",
            "vllm",
            "--model",
            "M",
            "--port",
            str(free_port()),
            "--receipt",
            str(tmp_path / "r.json"),
            "--engine-command",
            f"{shlex.quote(PY)} {shlex.quote(FAKE)} --fake-mode exit",
            "--ready-timeout",
            "30",
        ],
        {},
        tmp_path,
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "exited with code 3" in err and "cannot load model weights" in err

    sleeper = (PY, "-c", "import time; print('sleeping', flush=True); time.sleep(600)")
    launcher = make_launcher(LaunchOptions(engine="native", port=free_port(), engine_command=sleeper))
    launcher.start(tmp_path / "sleep.log")
    pgid = launcher.pgid
    with pytest.raises(Exception) as info:
        launcher.wait_ready(timeout=2)
    assert "not ready after 2s" in str(info.value) and "sleeping" in str(info.value)
    assert not alive(pgid) and not group_members(pgid)


def test_server_reporting_lossy_settings_is_refused(tmp_path):
    info = json.dumps({"speculative_accept_threshold_acc": 0.7})
    proc = _launch(
        [
            "--engine",
            "sglang",
            "--model",
            "M",
            "--port",
            str(free_port()),
            "--receipt",
            str(tmp_path / "r.json"),
            "--engine-command",
            f"{shlex.quote(PY)} {shlex.quote(FAKE)} --fake-info-json {shlex.quote(info)}",
            "--ready-timeout",
            "30",
        ],
        {},
        tmp_path,
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "lossy acceptance" in err, err
    receipt = json.loads((tmp_path / "r.json").read_text())
    assert not alive(receipt["pid"]) and receipt["stopped_at"]


def test_evalpipe_serve_hook_routes_engines_and_dry_run():
    """Through the real console entry: `evalpipe serve --engine sglang --dry-run` never starts anything."""
    env = {**os.environ, "SGLANG_FOO": "1"}
    out = subprocess.run(
        [
            PY,
            "-m",
            "evalpipe.cli",
            "serve",
            "--engine",
            "sglang",
            "--model",
            "M",
            "--speculative",
            "dspark",
            "--draft-model",
            "D",
            "--dry-run",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["argv"][:3] == SGL and "DSPARK" in plan["argv"] and plan["env_removed"] == ["SGLANG_FOO"]
    help_text = subprocess.run(
        [PY, "-m", "evalpipe.cli", "serve", "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    assert "--engine [native|sglang|vllm]" in help_text and "--dry-run" in help_text
    engine_help = subprocess.run(
        [PY, "-m", "evalpipe.cli", "serve", "--engine", "vllm", "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    assert "only way to exercise those engines" in " ".join(engine_help.split())


def test_server_dies_with_a_launcher_killed_by_sigkill(tmp_path):
    """A launcher that cannot clean up (SIGKILL) still leaves no server behind: the kernel's parent-death signal."""
    receipt = tmp_path / "r.json"
    proc = _launch(
        [
            "--engine",
            "sglang",
            "--model",
            "M",
            "--port",
            str(free_port()),
            "--receipt",
            str(receipt),
            "--engine-command",
            f"{shlex.quote(PY)} {shlex.quote(FAKE)}",
            "--ready-timeout",
            "60",
        ],
        {},
        tmp_path,
    )
    try:
        assert proc.stdout.readline().startswith("ready: ")
        server = json.loads(receipt.read_text())["pid"]
        assert alive(server)
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    deadline = time.monotonic() + 20
    while alive(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    survived = alive(server)
    if survived:
        os.kill(server, signal.SIGKILL)  # do not leave it to the next test
    assert not survived


def test_native_receipts_differ_when_the_engine_code_changed_between_boots():
    a = {
        "engine": "native",
        "engine_version": "0.1.0",
        "evalpipe_source": {"git_commit": "abc", "git_diff_sha256": None},
    }
    b = {**a, "evalpipe_source": {"git_commit": "def", "git_diff_sha256": None}}
    assert receipt_differences(a, a) == []
    assert receipt_differences(a, b, declared=["speculative"]) == [
        "evalpipe source (the native engine's code): A={'git_commit': 'abc', 'git_diff_sha256': None} "
        "B={'git_commit': 'def', 'git_diff_sha256': None}"
    ]
    sglang = {**a, "engine": "sglang"}
    assert receipt_differences(sglang, {**b, "engine": "sglang"}) == []  # launcher code, not the engine's


def test_engine_interpreter_default_follows_the_console_script_on_path(tmp_path):
    """Without --engine-python: this interpreter if it imports the engine, else the one behind `vllm` on PATH
    (its #! line, or pip's exec form for long paths), else this one."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter imports vllm itself, so it is always the default")
    shebang, long_form, empty = (tmp_path / name for name in ("shebang", "long", "empty"))
    for folder in (shebang, long_form, empty):
        folder.mkdir()
    (shebang / "vllm").write_text("#!/opt/vllm-env/bin/python3.11\nimport sys\n")
    (long_form / "vllm").write_text("#!/bin/sh\n'''exec' '/opt/a very long/path/bin/python' \"$0\" \"$@\"\n' '''\n")
    for folder in (shebang, long_form):
        (folder / "vllm").chmod(0o755)
    vllm = ["--engine", "vllm", "--model", "M"]
    assert dry_run(vllm, env={"PATH": str(shebang)})["argv"][0] == "/opt/vllm-env/bin/python3.11"
    assert dry_run(vllm, env={"PATH": str(long_form)})["argv"][0] == "/opt/a very long/path/bin/python"
    assert dry_run(["--engine", "vllm", "--model", "M"], env={"PATH": str(empty)})["argv"][0] == PY
    assert dry_run(["--engine", "vllm", "--model", "M", "--engine-python", "rel/bin/python"])["engine_python"] == str(
        Path.cwd() / "rel" / "bin" / "python"
    )


def test_an_interpreter_without_the_engine_is_refused_before_anything_starts(tmp_path):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter imports vllm")
    proc = _launch(
        [
            "--engine",
            "vllm",
            "--model",
            "M",
            "--port",
            str(free_port()),
            "--engine-python",
            PY,
            "--receipt",
            str(tmp_path / "r.json"),
        ],
        {},
        tmp_path,
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, (out, err)
    assert f"{PY} cannot import vllm" in err and "--engine-python" in err and "Traceback" not in err
    assert not (tmp_path / "r.json").exists()  # nothing was started


def test_several_api_keys_reach_the_native_server_and_other_engines_refuse_them():
    from evalpipe.launchers.errors import LaunchConfigError
    from evalpipe.launchers.flags import parse_serve_args

    options, _ = parse_serve_args(["--api-key", "key-a", "--api-key", "key-b"])
    assert options.api_key == "key-a" and options.more_api_keys == ("key-b",)
    argv = make_launcher(options).command()
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--api-key"] == ["key-a", "key-b"]
    assert "key-b" not in json.dumps(options.recorded()) and "key-b" in make_launcher(options).secret_values()
    for engine in ("sglang", "vllm"):
        options, _ = parse_serve_args(["--engine", engine, "--model", "m", "--api-key", "a", "--api-key", "b"])
        with pytest.raises(LaunchConfigError, match="takes one --api-key"):
            make_launcher(options).validate()


def test_deterministic_is_one_flag_for_every_engine():
    """One `--deterministic` for native, sglang and vllm; the native engine takes it in this process (no launcher),
    sets EngineConfig.deterministic and passes it on when launched."""
    from evalpipe.launchers.flags import parse_serve_args

    assert [p.name for p in launch_command.params if "--deterministic" in p.opts] == ["deterministic"]
    options, names = parse_serve_args(["--deterministic"])
    assert options.deterministic is True and options.native.deterministic is True
    assert not needs_launcher({"engine": "native", "dry_run": False}, names)
    assert parse_serve_args([])[0].native.deterministic is False
    native = dry_run(["--deterministic", "--speculative", "block"])
    assert native["argv"][: len(NATIVE)] == NATIVE and native["argv"].count("--deterministic") == 1
    sglang = dry_run(["--engine", "sglang", "--model", "M", "--deterministic"])
    assert sglang["argv"].count("--enable-deterministic-inference") == 1 and sglang["env_set"] == {}
    assert "VLLM_BATCH_INVARIANT" not in dry_run(["--engine", "vllm", "--model", "M", *EP])["env_set"]


def test_server_reporting_deterministic_off_when_asked_is_refused(tmp_path):
    """SGLang's own report decides: a server asked for --deterministic that reports it off is not used."""
    info = json.dumps({"enable_deterministic_inference": False})
    proc = _launch(
        [
            "--engine",
            "sglang",
            "--model",
            "M",
            "--deterministic",
            "--port",
            str(free_port()),
            "--receipt",
            str(tmp_path / "r.json"),
            "--engine-command",
            f"{shlex.quote(PY)} {shlex.quote(FAKE)} --fake-info-json {shlex.quote(info)}",
            "--ready-timeout",
            "30",
        ],
        {},
        tmp_path,
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "--deterministic was requested but the server reports" in err, err
    receipt = json.loads((tmp_path / "r.json").read_text())
    assert receipt["deterministic"] is False and not alive(receipt["pid"])
    assert "--enable-deterministic-inference" in receipt["argv"]


# chat templates of the families in tool_parsers.py's table, cut to the markers that decide
TEMPLATES = {
    "qwen": "{% if tools %}<tools>{{ tools }}</tools> <tool_call>{...}</tool_call>{% endif %}<|im_start|>",
    "llama3": "<|start_header_id|>{{ role }}<|end_header_id|>{% if tools %}<|python_tag|>{% endif %}",
    "mistral": "[INST]{{ content }}[/INST]{% if tools %}[TOOL_CALLS]{% endif %}",
    "chatml": "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'}}",
    "plain": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
}


def _model_folder(root, name: str, in_jinja: bool):
    folder = root / name
    folder.mkdir()
    if in_jinja:
        (folder / "chat_template.jinja").write_text(TEMPLATES[name])
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATES["plain"]}))
    else:
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATES[name]}))
    return str(folder)


@pytest.mark.parametrize(
    "name, in_jinja, parser",
    [
        ("qwen", False, "hermes"),
        ("llama3", True, "llama3_json"),
        ("mistral", False, "mistral"),
        ("chatml", True, "hermes"),  # SmolLM2's template: ChatML without tool markup
        ("plain", False, None),
    ],
)
def test_vllm_gets_the_tool_parser_of_its_models_chat_template(tmp_path, name, in_jinja, parser):
    model = _model_folder(tmp_path, name, in_jinja)
    argv = dry_run(["--engine", "vllm", "--model", model, *EP])["argv"]
    tail = argv[argv.index("30000") + 1 :]
    tools = ["--enable-auto-tool-choice", "--tool-call-parser", parser] if parser else []
    assert tail == ["--enable-prompt-tokens-details", *tools]


def test_the_tool_parser_flag_overrides_turns_off_and_yields_to_the_passthrough(tmp_path):
    model = _model_folder(tmp_path, "qwen", False)
    base = ["--engine", "vllm", "--model", model, *EP]
    argv = dry_run([*base, "--tool-call-parser", "llama3_json"])["argv"]
    assert argv[-3:] == ["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    argv = dry_run([*base, "--tool-call-parser", "off"])["argv"]
    assert "--enable-auto-tool-choice" not in argv and "--tool-call-parser" not in argv
    argv = dry_run([*base, "--", "--tool-call-parser", "pythonic", "--enable-auto-tool-choice"])["argv"]
    assert argv.count("--tool-call-parser") == 1 and argv[-3:] == [
        "--tool-call-parser",
        "pythonic",
        "--enable-auto-tool-choice",
    ]
    argv = dry_run([*base, "--", "--enable-prompt-tokens-details"])["argv"]
    assert argv.count("--enable-prompt-tokens-details") == 1
    assert "vllm setting" in refused(["--tool-call-parser", "hermes"])
    assert "-- --tool-call-parser NAME" in refused(["--engine", "sglang", "--model", "M", "--tool-call-parser", "x"])
