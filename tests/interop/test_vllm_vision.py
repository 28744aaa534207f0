"""Gate `vision` against a real engine on a real vision architecture: vLLM's CPU build serving a tiny random-weight
Idefics3 (SmolVLM's architecture) with SmolLM2's tokenizer, built in seconds (tests/support/tiny_vlm.py), through
`evalpipe serve --engine vllm`. Random weights carry each image into the first token's logprobs, so the gate passes;
the dropper and the text-only refusal are in tests/qualify/test_qualify.py. One boot for the module.
"""

from __future__ import annotations

import json

import pytest

from tests.support.tiny_vlm import build_with, require_smollm2
from tests.support.vllm_peer import PASSTHROUGH, evalpipe, require_vllm, serve_model

# the checkpoint has real (random) weights: vLLM loads them instead of drawing its dummy ones; its engine skips
# profiling memory with a dummy image (the CPU build's KV space is set, not measured)
_DUMMY = PASSTHROUGH.index("--load-format")
WEIGHTS = PASSTHROUGH[:_DUMMY] + PASSTHROUGH[_DUMMY + 2 :] + ["--skip-mm-profiling"]


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-vlm")
    model = build_with(require_vllm(), root / "tiny-vlm", require_smollm2())
    yield from serve_model(root, model, passthrough=WEIGHTS)


def test_vision_gate_passes_against_vllm_serving_a_vision_language_model(vlm_server, tmp_path):
    base_url, receipt, _ = vlm_server
    assert json.loads(receipt.read_text())["argv"][-len(WEIGHTS) :] == WEIGHTS  # no --load-format dummy
    result = evalpipe("qualify", "--base-url", base_url, "--gates", "vision", "--out", str(tmp_path / "q"))
    gate = json.loads((tmp_path / "q" / "qualify.json").read_text())["gates"][0]
    assert result.returncode == 0 and gate["verdict"] == "pass", (gate["reason"], result.stderr[-2000:])
    assert gate["requests"] == 5 and gate["passed"] == 5
    tokens = gate["notes"]["prompt_tokens"]  # each image became tokens of the prompt
    assert all(n > tokens["control"] for key, n in tokens.items() if key != "control"), tokens
    differs = [c for r in gate["records"] for c in r["checks"] if c["name"].startswith("differs from")]
    assert len(differs) == 3 and all(c["ok"] for c in differs)
