"""SGLang: `python -m sglang.launch_server` with a speculation profile, lossless settings only.

The interpreter is the one of the environment where SGLang lives (`--engine-python`; default: this one if it
imports sglang, else the one behind `sglang` on PATH).

Profiles: `off`; `dspark` (DSPARK algorithm, draft model path, optional block size -- the server normalises the
tree to a linear block); `eagle` / `eagle3` / `nextn` (tree shape: steps, top-k and draft tokens set all together or
not at all, as SGLang's auto-defaults otherwise fill in the rest). Acceptance thresholds are passed as 1.0 and any
other value given as a passthrough flag is refused: below 1.0 SGLang accepts drafts the target did not choose,
which an accuracy run must never do by accident. Only evalpipe's own `--spec-accept-threshold-single/-acc` pass
lower values, on purpose, to measure what a lossy speculator costs (recorded as `lossy_acceptance` in the receipt;
SGLang applies them to sampled requests only). Multi-node and memory flags are SGLang's own and pass through.
"""

from __future__ import annotations

from functools import cached_property

from evalpipe.launchers.base import Launcher, engine_interpreter, fmt_number
from evalpipe.launchers.errors import require

PROFILES = ("off", "dspark", "eagle", "eagle3", "nextn")
ALGORITHM = {"dspark": "DSPARK", "eagle": "EAGLE", "eagle3": "EAGLE3", "nextn": "NEXTN"}
ACCEPT_THRESHOLD_FLAGS = ("--speculative-accept-threshold-single", "--speculative-accept-threshold-acc")

# Flags the launcher itself owns; giving them as extra args would bypass validation or the free port.
OWNED_FLAGS = {
    "--model-path",
    "--model",
    "--host",
    "--port",
    "--tokenizer-path",
    "--tp-size",
    "--tp",
    "--ep-size",
    "--ep",
    "--dp-size",
    "--dp",
    "--speculative-algorithm",
    "--speculative-draft-model-path",
    "--speculative-draft",
    "--speculative-dspark-block-size",
    "--speculative-num-steps",
    "--speculative-eagle-topk",
    "--speculative-num-draft-tokens",
    "--enable-deterministic-inference",
    "--api-key",
    "--dtype",
}


def extra_flag_values(extra: tuple[str, ...] | list[str]) -> list[tuple[str, str | None]]:
    """(flag, value) pairs of passthrough args: `--x=1`, `--x 1`, or a bare switch `--x`."""
    pairs, i = [], 0
    extra = list(extra)
    while i < len(extra):
        token = extra[i]
        if token.startswith("--"):
            flag, sep, value = token.partition("=")
            if sep:
                pairs.append((flag, value))
            elif i + 1 < len(extra) and not extra[i + 1].startswith("--"):
                pairs.append((flag, extra[i + 1]))
                i += 1
            else:
                pairs.append((flag, None))
        i += 1
    return pairs


def check_passthrough(extra, owned: set[str], engine: str) -> None:
    for flag, value in extra_flag_values(extra):
        require(flag not in owned, f"{flag} is set by evalpipe's own option for {engine}; use that option instead")


class SGLangLauncher(Launcher):
    engine = "sglang"
    health_path = "/health_generate"
    info_paths = ("/get_server_info", "/server_info")
    accept_rules = ("threshold",)
    engine_module = "sglang"

    @cached_property
    def interpreter(self) -> str | None:
        if self.options.engine_command:
            return None
        return engine_interpreter(self.options.engine_python, "sglang", "sglang")

    def validate(self) -> None:
        o = self.options
        profile = o.speculative or "off"
        require(not o.more_api_keys, "sglang takes one --api-key; several keys are a native-server feature")
        require(not (o.engine_command and o.engine_python), "give --engine-command or --engine-python, not both")
        require(o.ngram_min is None and o.ngram_max is None, "--ngram-min/--ngram-max are vllm ngram settings")
        require(
            o.tool_call_parser is None,
            "--tool-call-parser is evalpipe's vllm setting; pass SGLang's own after `--` (-- --tool-call-parser NAME)",
        )
        require(
            profile in PROFILES, f"sglang speculation profile must be one of {', '.join(PROFILES)}; got {profile!r}"
        )
        require(bool(o.model), "sglang needs --model (a local path or a Hugging Face id)")
        require(o.drafter is None, "--drafter is for the native engine; sglang takes --draft-model")
        require(o.device in (None, "cuda"), "sglang runs on CUDA devices; drop --device")
        require(o.max_batch is None, "--max-batch is a native-engine flag; for sglang pass --max-running-requests N")
        for flag, value in extra_flag_values(o.extra_args):
            if flag in ACCEPT_THRESHOLD_FLAGS:
                require(
                    value is not None and _is_one(value),
                    f"{flag} {value} is lossy (accepts drafts the target did not choose); accuracy runs need 1.0. "
                    "To measure a lossy setting on purpose use --spec-accept-threshold-single/-acc (recorded)",
                )
                require(
                    o.spec_accept_threshold_single is None and o.spec_accept_threshold_acc is None,
                    f"{flag} given twice: as a passthrough and through --spec-accept-threshold-*; keep one",
                )
        check_passthrough(
            [a for a in o.extra_args if a.partition("=")[0] not in ACCEPT_THRESHOLD_FLAGS], OWNED_FLAGS, "sglang"
        )
        tree = (o.spec_steps, o.spec_topk, o.spec_draft_tokens)
        if profile == "off":
            require(
                o.block_size is None and o.draft_model is None and all(v is None for v in tree),
                "speculation flags given with --speculative off",
            )
            require(o.simulate_acc_len is None, "--simulate-acc-len needs a speculation profile")
        elif profile == "dspark":
            require(
                bool(o.draft_model),
                "--speculative dspark needs --draft-model (e.g. deepseek-ai/DeepSeek-V4-Flash-DSpark)",
            )
            require(
                all(v is None for v in tree),
                "dspark fixes the tree itself (steps 1, top-k 1, draft tokens = block size + 1); use --block-size",
            )
            require(o.block_size is None or o.block_size >= 1, "--block-size must be >= 1")
        else:
            require(
                o.block_size is None,
                f"--block-size is for dspark; {profile} takes --spec-steps/--spec-topk/--spec-draft-tokens",
            )
            require(profile == "nextn" or bool(o.draft_model), f"--speculative {profile} needs --draft-model")
            given = [v is not None for v in tree]
            require(
                all(given) or not any(given),
                "set --spec-steps, --spec-topk and --spec-draft-tokens together, or none (SGLang's auto-defaults)",
            )
            if all(given):
                steps, topk, draft = tree
                require(steps >= 1 and topk >= 1 and draft >= 1, "speculation tree sizes must be >= 1")
                require(
                    topk != 1 or draft == steps + 1,
                    f"with --spec-topk 1 SGLang forces draft tokens to steps + 1 = {steps + 1}; got {draft}",
                )

    def command(self) -> list[str]:
        o = self.options
        argv = list(o.engine_command or (self.interpreter, "-m", "sglang.launch_server"))
        argv += ["--model-path", o.model, "--host", o.host, "--port", str(o.port)]
        if o.tokenizer:
            argv += ["--tokenizer-path", o.tokenizer]
        for flag, value in (("--tp-size", o.tp), ("--ep-size", o.ep), ("--dp-size", o.dp)):
            if value is not None:
                argv += [flag, str(value)]
        if o.dtype:
            argv += ["--dtype", o.dtype]
        if o.api_key:
            argv += ["--api-key", o.api_key]
        profile = o.speculative or "off"
        if profile != "off":
            argv += ["--speculative-algorithm", ALGORITHM[profile]]
            if o.draft_model:
                argv += ["--speculative-draft-model-path", o.draft_model]
            if profile == "dspark" and o.block_size is not None:
                argv += ["--speculative-dspark-block-size", str(o.block_size)]
            if o.spec_steps is not None:
                argv += [
                    "--speculative-num-steps",
                    str(o.spec_steps),
                    "--speculative-eagle-topk",
                    str(o.spec_topk),
                    "--speculative-num-draft-tokens",
                    str(o.spec_draft_tokens),
                ]
            chosen = (o.spec_accept_threshold_single, o.spec_accept_threshold_acc)
            for flag, value in zip(ACCEPT_THRESHOLD_FLAGS, chosen):
                argv += [flag, "1.0" if value is None else fmt_number(value)]
        if o.deterministic:
            argv += ["--enable-deterministic-inference"]
        return argv + list(o.extra_args)

    def engine_variables(self) -> dict[str, str]:
        if self.options.simulate_acc_len is None:
            return {}
        return {"SGLANG_SIMULATE_ACC_LEN": fmt_number(self.options.simulate_acc_len)}


def _is_one(value: str) -> bool:
    try:
        return float(value) == 1.0
    except ValueError:
        return False
