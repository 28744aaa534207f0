"""What a lane run will do, settled before any generation request: `RunConfig` (what was asked) -> `PreparedRun`.

`prepare_run` loads and hash-checks the lane data, selects the items, resolves the sampling parameters, asks the
server who it is (model list, server info, /metrics counters) and refuses a server that simulates speculative
acceptance. The prepared run is frozen: the run folder (run_folder.py) and the sender (lane_run.py) only read it.
`RunConfig.from_manifest` rebuilds the config of a run folder for `--resume`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from evalpipe.harness import client as http
from evalpipe.harness import manifest as manifest_mod
from evalpipe.harness import spec_metrics
from evalpipe.harness.client import EndpointError, Server
from evalpipe.harness.records import (
    MANIFEST_FILE,
    RESPONSES_FILE,
    MalformedFile,
    read_json_object,
    read_records,
)
from evalpipe.harness.server_facts import (
    debug_faults,
    deterministic_mode,
    lossy_acceptance,
    simulation_reason,
)
from evalpipe.lanes import (
    Item,
    Lane,
    LaneData,
    computed_pins,
    get_lane,
    id_list_sha256,
    pin_differences,
    prompt_stream_sha256,
)
from evalpipe.lanes.data import DataError, recorded_data_dir
from evalpipe.redact import redact_text


class RunError(Exception):
    """A run cannot start or must stop; the message says why and what to do."""


class SimulatedServerRefused(RunError):
    """The server simulates speculative acceptance: its outputs are not scored."""


class NotResumable(RunError):
    """The folder given to --resume is not a run folder evalpipe can continue (a bad or imported manifest)."""


class ResumeConflict(RunError):
    """A flag given with --resume contradicts the run's manifest (a usage error)."""


# The command-line names of what defines a run's protocol: `--resume` keeps the run's own and refuses them.
PROTOCOL_OPTIONS = (
    "max_tokens",
    "temperature",
    "seed",
    "sample_seeds",
    "top_p",
    "num_examples",
    "repeats",
    "concurrency",
)
# The lane parameters a command line may override (RunConfig.overrides); the rest of the protocol is the lane's.
LANE_OVERRIDES = ("max_tokens", "temperature", "top_p")


@dataclass
class RunConfig:
    lane: Lane
    base_url: str
    model: Optional[str] = None
    api_key: Optional[str] = None
    arm: str = "default"
    out_dir: Path = Path("results")
    concurrency: Optional[int] = None
    timeout_s: float = 14400.0
    max_retries: int = 3
    retry_backoff_s: float = 1.0
    overrides: dict = field(default_factory=dict)  # param name -> value (None = "do not send")
    num_examples: Optional[int] = None
    repeats: Optional[int] = None
    data_dir: Optional[Path] = None
    allow_data_drift: bool = False
    token_ids: bool = True
    logprobs: Optional[int] = None
    grader_workers: int = 2
    grader_timeout_s: float = 30.0
    fsync: bool = False
    progress: bool = True
    resume_dir: Optional[Path] = None
    command_line: list = field(default_factory=list)
    # the deterministic mode of a server evalpipe launched, for engines that do not report it (vLLM: the
    # VLLM_BATCH_INVARIANT it was started with); what a server reports wins. None: not known.
    launched_deterministic: Optional[bool] = None
    # --sample-seeds BASE: each (question, repeat) sends sample_seeds.sample_seed(BASE, question, repeat); None: off
    sample_seeds: Optional[int] = None

    @classmethod
    def from_manifest(
        cls,
        run_dir: Path,
        lane_name: Optional[str] = None,
        base_url: Optional[str] = None,
        model: Optional[str] = None,
        data_dir: Optional[Path] = None,
        allow_data_drift: bool = False,
        token_ids: bool = True,
        logprobs: Optional[int] = None,
        **transport,
    ) -> "RunConfig":
        """The config that continues `run_dir`. Its protocol (lane, arm, overrides, selection, concurrency) comes
        from its manifest; the endpoint, data folder, model and logprobs too unless given; data drift and no token
        ids stay on once the run had them. `transport` is the rest of RunConfig's fields (key, timeouts, ...).
        NotResumable: the folder cannot be resumed; ResumeConflict: a given value contradicts the manifest."""
        run_dir = Path(run_dir)
        mpath = run_dir / MANIFEST_FILE
        if not mpath.exists():
            raise ResumeConflict(f"{run_dir} is not a run folder (no {MANIFEST_FILE})")
        try:
            old = read_json_object(mpath)
            if isinstance(old.get("imported"), dict):
                raise NotResumable(
                    f"{run_dir} was made by `evalpipe import` from {old['imported'].get('tool')}: run "
                    "that tool again and import its output; evalpipe cannot resume it"
                )
            eff = old["start"]["lane"]["effective"]
            dataset = old["start"]["dataset"]
            recorded_data = dataset["path"]
        except MalformedFile as exc:
            raise NotResumable(f"{exc}; cannot resume") from None
        except (KeyError, TypeError) as exc:
            raise NotResumable(f"{mpath}: no start snapshot ({type(exc).__name__}: {exc}); cannot resume") from None
        read = read_records(run_dir / RESPONSES_FILE)
        if read.bad_lines:
            raise NotResumable(f"{read.first_bad(run_dir / RESPONSES_FILE)}; fix or remove the line, then resume")
        try:  # the resume counts Records: a line without a required key is named here, before the server is asked
            read.typed(run_dir / RESPONSES_FILE)
        except MalformedFile as exc:
            raise NotResumable(f"{exc}; fix or remove the line, then resume") from None
        if data_dir is None:
            data_dir = recorded_data_dir(recorded_data)
        if lane_name is not None and lane_name != old["lane"]:
            raise ResumeConflict(f"{run_dir} is a {old['lane']!r} run, not {lane_name!r}")
        lane = get_lane(old["lane"])
        model = model or eff.get("model")
        if model != eff.get("model"):
            raise ResumeConflict(f"run used model {eff.get('model')!r}; cannot resume with {model!r}")
        if base_url is None:
            base_url = (old["start"].get("endpoint") or {}).get("base_url")
            if not base_url:
                raise ResumeConflict(f"{mpath} records no endpoint; pass --base-url")
        return cls(
            lane=lane,
            base_url=base_url,
            model=model,
            arm=old["arm"],
            overrides=dict(old["start"]["lane"]["overrides"]),
            num_examples=eff.get("num_examples"),
            repeats=eff.get("repeats") if eff.get("repeats") != lane.repeats else None,
            concurrency=eff.get("concurrency"),
            data_dir=data_dir,
            allow_data_drift=allow_data_drift or dataset.get("allow_data_drift", False),
            token_ids=token_ids and eff.get("return_token_ids") is not False,
            logprobs=logprobs if logprobs is not None else eff.get("logprobs"),
            sample_seeds=eff.get("sample_seeds"),
            resume_dir=run_dir,
            **transport,
        )


@dataclass(frozen=True)
class ServerIdentity:
    """Who the server said it is before the first generation request."""

    model: str  # the model id every request names
    facts: dict  # {"models", "server_info_path", "server_info"} as the server reported them
    lossy: Optional[str]  # the lossy acceptance rule it runs, else None (scored, with a warning)
    faults: list  # planted debug faults it runs (scored, with a warning)
    deterministic: Optional[bool]  # its batch-invariant mode (`server_deterministic`), None when unknown
    metrics_before: Optional[dict]  # its speculative /metrics counters before the run


@dataclass(frozen=True)
class PreparedRun:
    """Everything a run reads: the config, the lane data and selection, the parameters sent, the server."""

    cfg: RunConfig
    data: LaneData
    pin_diffs: tuple  # where the data differs from the lane's pins (empty unless --allow-data-drift)
    items: tuple  # the selected items, in order
    repeats: int
    concurrency: int
    params: dict  # the lane's sampling parameters with the overrides applied (None = not sent)
    server: ServerIdentity
    recorded_url: str  # what records and manifests say: the base URL without its password

    @property
    def lane(self) -> Lane:
        return self.cfg.lane

    @property
    def model(self) -> str:
        return self.server.model

    def planned(self) -> list[tuple[Item, int]]:
        """Every (item, repeat) the run must record, question-major."""
        return [(it, r) for it in self.items for r in range(self.repeats)]

    def snapshot(self, server: dict) -> dict:
        """A manifest snapshot of this prepared run with the `server` facts given (start, resume or end)."""
        cfg, lane, data = self.cfg, self.lane, self.data
        return manifest_mod.capture(
            lane_desc=lane.describe(),
            overrides=dict(cfg.overrides),
            effective={
                "params": self.params,
                "concurrency": self.concurrency,
                "repeats": self.repeats,
                "num_examples": cfg.num_examples,
                "return_token_ids": cfg.token_ids,
                "logprobs": cfg.logprobs,
                **({"sample_seeds": cfg.sample_seeds} if cfg.sample_seeds is not None else {}),
                "model": self.model,
                "arm": cfg.arm,
            },
            transport={
                "timeout_s": cfg.timeout_s,
                "max_retries": cfg.max_retries,
                "retry_backoff_s": cfg.retry_backoff_s,
                "retry_policy": http.RETRY_POLICY,
                "grader_timeout_s": cfg.grader_timeout_s,
                "grader_workers": cfg.grader_workers,
                "fsync": cfg.fsync,
            },
            data_facts={
                "path": data.dataset_path,
                "sha256": data.dataset_sha256,
                "data_drift": data.data_drift,
                "allow_data_drift": cfg.allow_data_drift,
                "pin_differences": list(self.pin_diffs),
                "all_items": computed_pins(lane, data),
                "selected_id_list_sha256": id_list_sha256([it.question_id for it in self.items]),
                "selected_n_items": len(self.items),
                **data.extra,
            },
            prompt_facts={
                "template_id": data.template_id,
                "template_sha256": data.template_sha256,
                "prompt_stream_sha256_all": data.stream_sha256(),
                "prompt_stream_sha256_selected": prompt_stream_sha256([it.prompt_sha256 for it in self.items]),
            },
            endpoint={"base_url": self.recorded_url, "api": lane.api, "model": self.model},
            # as the server reported it (redacted on write); comparisons drop what is volatile
            server={**server, "deterministic": server_deterministic(server.get("server_info"), cfg)},
        )


def prepare_run(cfg: RunConfig) -> PreparedRun:
    """Load and check the data, select the items, then ask the server who it is; RunError says what is wrong."""
    lane = cfg.lane
    try:
        data = lane.load(cfg.data_dir, cfg.allow_data_drift)
    except DataError as exc:
        raise RunError(str(exc)) from exc
    pin_diffs = pin_differences(lane, data)
    if pin_diffs and not cfg.allow_data_drift:
        raise RunError(
            f"lane {lane.name}: hashes differ from the pins in evalpipe/lanes/pins/{lane.name}.json:\n  "
            + "\n  ".join(pin_diffs)
            + "\nThe prompts are not the pinned ones; pass --allow-data-drift to run anyway (recorded)."
        )
    items = data.items
    if cfg.num_examples is not None:
        if cfg.num_examples < 1:
            raise RunError("--num-examples must be >= 1")
        items = items[: cfg.num_examples]
    repeats = cfg.repeats if cfg.repeats is not None else lane.repeats
    if repeats < 1:
        raise RunError("--repeats must be >= 1")
    with Server(cfg.base_url, cfg.api_key) as server:
        identity = ask_server(server, cfg)
    return PreparedRun(
        cfg=cfg,
        data=data,
        pin_diffs=tuple(pin_diffs),
        items=tuple(items),
        repeats=repeats,
        concurrency=cfg.concurrency or lane.concurrency,
        params={**lane.params, **cfg.overrides},
        server=identity,
        recorded_url=redact_text(cfg.base_url),
    )


def ask_server(server: Server, cfg: RunConfig) -> ServerIdentity:
    """Who is the server? (before any generation request): its model, its settings, its /metrics counters."""
    try:
        models_json = server.models()
    except EndpointError as exc:
        raise RunError(str(exc)) from exc
    served = [m["id"] for m in models_json["data"]]
    if cfg.model is None:
        model = served[0]
    elif cfg.model not in served:
        raise RunError(f"--model {cfg.model!r} is not served by {cfg.base_url} (it lists: {', '.join(served)})")
    else:
        model = cfg.model
    info_path, info = server.server_info()
    reason = simulation_reason(info)
    if reason:
        raise SimulatedServerRefused(f"refusing to score: {reason}. Restart the server without simulation.")
    # a lossy acceptance rule is scored (measuring its accuracy cost is its purpose), never hidden
    lossy = lossy_acceptance(info)
    if lossy:
        print(
            f"evalpipe run: warning: the server's speculative acceptance is LOSSY {lossy}; "
            "the responses it decides measure that rule, not the model (scored on purpose)",
            file=sys.stderr,
        )
    faults = debug_faults(info)
    if faults:
        print(
            f"evalpipe run: WARNING: THE SERVER IS BROKEN ON PURPOSE: planted debug faults "
            f"{', '.join(faults)} (evalpipe serve --debug-fault); these scores measure the "
            "faults, not the model",
            file=sys.stderr,
        )
    return ServerIdentity(
        model=model,
        facts={"models": models_json, "server_info_path": info_path, "server_info": info},
        lossy=lossy,
        faults=faults,
        deterministic=server_deterministic(info, cfg),
        # speculative counters from /metrics (vLLM reports speculation nowhere else): run-level, before and after
        metrics_before=spec_metrics.snapshot(server),
    )


def server_deterministic(info, cfg: RunConfig) -> Optional[bool]:
    """The server's deterministic mode: what it reports (server_facts.deterministic_mode), else what the launcher
    that started it knows (`RunConfig.launched_deterministic`), else None."""
    reported = deterministic_mode(info)
    return cfg.launched_deterministic if reported is None else reported
