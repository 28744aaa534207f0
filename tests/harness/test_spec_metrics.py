"""Run-level speculative statistics from Prometheus /metrics (evalpipe/harness/spec_metrics.py): parsing vLLM's and
SGLang's expositions, the after-minus-before arithmetic, and the refusals (no snapshot before, a counter reset).

The exposition texts are in the form vLLM 0.32 (CPU build, ngram speculation) and SGLang 0.5.23 write them;
tests/interop/test_vllm_peer.py reads the same counters from a running vLLM.
"""

from __future__ import annotations

import pytest

from evalpipe.harness import spec_metrics


def vllm_text(drafts: float, draft_tokens: float, accepted: float, per_pos: list[float], engines: int = 1) -> str:
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="/m/tiny"} 0.0',
    ]
    for name, value in (("drafts", drafts), ("draft_tokens", draft_tokens), ("accepted_tokens", accepted)):
        lines += [f"# HELP vllm:spec_decode_num_{name}_total x", f"# TYPE vllm:spec_decode_num_{name}_total counter"]
        lines += [
            f'vllm:spec_decode_num_{name}_total{{engine="{e}",model_name="/m/tiny"}} {value}' for e in range(engines)
        ]
        lines += [
            f"# TYPE vllm:spec_decode_num_{name}_created gauge",
            f'vllm:spec_decode_num_{name}_created{{engine="0",model_name="/m/tiny"}} 1.796117807694e+09',
        ]
    lines += [
        "# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.",
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter",
    ]
    lines += [
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="/m/tiny",position="{i}"}} {v}'
        for i, v in enumerate(per_pos)
    ]
    return "\n".join(lines) + "\n"


def test_vllm_counters_are_summed_and_subtracted():
    before = spec_metrics.parse(vllm_text(8, 22, 22, [8, 8, 6]))
    after = spec_metrics.parse(vllm_text(78, 222, 222, [78, 78, 66]))
    assert before == {
        "engine": "vllm",
        "counters": {"drafts": 8.0, "draft_tokens": 22.0, "accepted_tokens": 22.0},
        "accepted_per_position": {"0": 8.0, "1": 8.0, "2": 6.0},
    }
    block = spec_metrics.run_level(before, after)
    assert block["level"] == "run" and "not one request" in block["scope"]
    assert (block["drafts"], block["draft_tokens"], block["accepted_tokens"]) == (70, 200, 200)
    assert block["accepted_per_position"] == [70, 70, 60]
    assert block["acceptance_per_position"] == pytest.approx([1.0, 1.0, 60 / 70])
    assert block["mean_accept_length"] == pytest.approx(1 + 200 / 70) and block["draft_acceptance_rate"] == 1.0
    assert block["before"] == before and block["after"] == after
    assert spec_metrics.accept_length(block) == pytest.approx(1 + 200 / 70)
    # two engines (data parallel) count together
    two = spec_metrics.parse(vllm_text(5, 10, 4, [3, 1], engines=2))
    assert two["counters"] == {"drafts": 10.0, "draft_tokens": 20.0, "accepted_tokens": 8.0}


def test_no_speculation_no_drafts_no_snapshot_and_restarts():
    off = '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 0.0\n'
    assert spec_metrics.parse(off) is None
    assert spec_metrics.run_level(None, None) is None
    idle = spec_metrics.parse(vllm_text(8, 22, 22, [8, 8, 6]))
    block = spec_metrics.run_level(idle, idle)
    assert block["drafts"] == 0 and block["mean_accept_length"] is None and block["acceptance_per_position"] is None
    assert "cannot be isolated" in spec_metrics.run_level(None, idle)["error"]
    restarted = spec_metrics.run_level(idle, spec_metrics.parse(vllm_text(1, 3, 2, [1, 1, 0])))
    assert "restarted" in restarted["error"] and "mean_accept_length" not in restarted
    with pytest.raises(ValueError):
        spec_metrics.parse("this is {not prometheus\n")


def test_sglang_counters_give_the_accept_length_and_gauges_are_read_after():
    def sglang_text(tokens: float, verify: float, gauge: float) -> str:
        return (
            "# TYPE sglang:generation_tokens_total counter\n"
            f'sglang:generation_tokens_total{{model_name="M",is_streaming="false"}} {tokens}\n'
            "# TYPE sglang:spec_verify_calls_total counter\n"
            f'sglang:spec_verify_calls_total{{model_name="M"}} {verify}\n'
            "# TYPE sglang:spec_accept_length gauge\n"
            f'sglang:spec_accept_length{{model_name="M"}} {gauge}\n'
        )

    before, after = spec_metrics.parse(sglang_text(100, 40, 2.4)), spec_metrics.parse(sglang_text(420, 140, 3.1))
    block = spec_metrics.run_level(before, after)
    assert block["engine"] == "sglang" and (block["generation_tokens"], block["verify_calls"]) == (320, 100)
    assert block["mean_accept_length"] == pytest.approx(3.2) and block["gauges_after"] == {"accept_length": 3.1}
    # generation tokens alone (speculation off) are not speculative statistics
    assert (
        spec_metrics.parse("# TYPE sglang:generation_tokens_total counter\nsglang:generation_tokens_total 5\n") is None
    )
