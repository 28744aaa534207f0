"""vLLM: `vllm serve MODEL` with `--speculative-config` JSON built from the same profiles as SGLang.

vLLM drafts a linear chain (no top-k tree), sizes expert parallelism as TP x DP (a switch, not a size), and has
no acceptance threshold to loosen; simulated acceptance is its `synthetic` rejection sampler, set only by
`--simulate-acc-len`. The JSON is written with sorted keys so that the same settings give the same argv.
"""

from __future__ import annotations

import json

from evalpipe.launchers.base import Launcher, require
from evalpipe.launchers.sglang import check_passthrough

PROFILES = ("off", "dspark", "eagle", "eagle3", "nextn")
METHOD = {"dspark": "dspark", "eagle": "eagle", "eagle3": "eagle3", "nextn": "mtp"}
OWNED_FLAGS = {
    "--host", "--port", "--model", "--tokenizer", "--tensor-parallel-size", "-tp", "--data-parallel-size", "-dp",
    "--enable-expert-parallel", "--speculative-config", "--api-key", "--dtype",
}


class VLLMLauncher(Launcher):
    engine = "vllm"
    health_path = "/health"
    info_paths = ("/server_info", "/get_server_info")
    version_path = "/version"

    def validate(self) -> None:
        o = self.options
        profile = o.speculative or "off"
        require(profile in PROFILES, f"vllm speculation profile must be one of {', '.join(PROFILES)}; got {profile!r}")
        require(bool(o.model), "vllm needs --model (a local path or a Hugging Face id)")
        require(o.drafter is None, "--drafter is for the native engine; vllm takes --draft-model")
        require(o.max_batch is None, "--max-batch is a native-engine flag; for vllm pass --max-num-seqs N")
        require(o.device in (None, "cuda"), "vllm is launched on CUDA devices here; drop --device")
        check_passthrough(o.extra_args, OWNED_FLAGS, "vllm")
        if o.ep is not None:
            require(
                o.ep == (o.tp or 1) * (o.dp or 1),
                f"vllm sizes expert parallelism as TP x DP = {(o.tp or 1) * (o.dp or 1)}; --ep {o.ep} cannot be honoured",
            )
        if profile == "off":
            require(
                o.block_size is None and o.draft_model is None
                and o.spec_steps is None and o.spec_topk is None and o.spec_draft_tokens is None,
                "speculation flags given with --speculative off",
            )
            require(o.simulate_acc_len is None, "--simulate-acc-len needs a speculation profile")
            return
        require(profile == "nextn" or bool(o.draft_model), f"--speculative {profile} needs --draft-model")
        require(o.spec_topk in (None, 1), "vllm drafts a linear chain: --spec-topk must be 1")
        if profile == "dspark":
            require(o.block_size is not None and o.block_size >= 1, "vllm dspark needs --block-size (draft tokens per step)")
            require(o.spec_steps is None and o.spec_draft_tokens is None, "dspark takes --block-size only")
        else:
            require(o.block_size is None, f"--block-size is for dspark; {profile} takes --spec-steps")
            require(o.spec_steps is not None and o.spec_steps >= 1, f"vllm {profile} needs --spec-steps (draft tokens per step)")
            require(
                o.spec_draft_tokens in (None, o.spec_steps + 1),
                f"a linear chain verifies steps + 1 = {o.spec_steps + 1} tokens; got --spec-draft-tokens {o.spec_draft_tokens}",
            )

    def speculative_config(self) -> dict | None:
        o = self.options
        profile = o.speculative or "off"
        if profile == "off":
            return None
        config = {
            "method": METHOD[profile],
            "num_speculative_tokens": o.block_size if profile == "dspark" else o.spec_steps,
        }
        if o.draft_model:
            config["model"] = o.draft_model
        if o.simulate_acc_len is not None:
            # performance only: accept a synthetic number of drafts without checking them
            config["rejection_sample_method"] = "synthetic"
            config["synthetic_acceptance_length"] = o.simulate_acc_len
        return config

    def command(self) -> list[str]:
        o = self.options
        argv = list(o.engine_command or ("vllm", "serve"))
        argv += [o.model, "--host", o.host, "--port", str(o.port)]
        if o.tokenizer:
            argv += ["--tokenizer", o.tokenizer]
        if o.tp is not None:
            argv += ["--tensor-parallel-size", str(o.tp)]
        if o.dp is not None:
            argv += ["--data-parallel-size", str(o.dp)]
        if o.ep is not None and o.ep > 1:
            argv += ["--enable-expert-parallel"]
        if o.dtype:
            argv += ["--dtype", o.dtype]
        if o.api_key:
            argv += ["--api-key", o.api_key]
        config = self.speculative_config()
        if config is not None:
            argv += ["--speculative-config", json.dumps(config, sort_keys=True, separators=(",", ":"))]
        return argv + list(o.extra_args)

    def engine_variables(self) -> dict[str, str]:
        # vLLM's batch-invariant kernels (beta) are its deterministic-inference switch
        return {"VLLM_BATCH_INVARIANT": "1"} if self.options.deterministic else {}
