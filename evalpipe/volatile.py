"""What changes by itself in a server's description of itself, per engine: the one list evalpipe ignores.

Two descriptions of the same server (`/v1/models` and `/get_server_info` or `/server_info`) are compared in four
places: a run's start and end snapshots (`evalpipe run` marks a changed run partial, `evalpipe audit` fails it),
two runs' manifests (`evalpipe compare` lists every difference), a resumed run against its start, and two boots'
receipts (`evalpipe ab` refuses an unfair pair). Every one of them drops exactly the fields below and compares the
rest, so a changed model path, revision, max length, dtype or speculative config is still reported.

A field is listed when it changes
  per call  -- between two calls to the same running server (fresh ids, clocks, running counters), or
  per boot  -- between two boots with the same settings (process ids, ports, random instance ids).
Each rule names its engine ("any" for all), the document, a dotted path (`[*]` for list items, `**` for any depth)
and why. A rule with `line` drops only the matching lines of a multi-line text field. Rules apply to whatever
server carries the path (a run does not know which engine it talks to); each path is specific to its engine.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any, Iterable, Optional

MODELS = "models"  # GET /v1/models
SERVER_INFO = "server_info"  # GET /get_server_info or /server_info


@dataclass(frozen=True)
class Rule:
    engine: str
    changes: str  # "per call" | "per boot"
    document: str
    path: str
    why: str
    line: Optional[str] = None  # glob over the lines of a text field; None = the whole field


RULES: tuple[Rule, ...] = (
    # ---- any engine ------------------------------------------------------------------------------------
    Rule(
        "any",
        "per boot",
        SERVER_INFO,
        "**.port",
        "the port a boot listens on (a free one per boot); an address, not a setting",
    ),
    Rule("any", "per boot", SERVER_INFO, "**.*_port", "ports of internal channels (chosen free per boot)"),
    Rule("any", "per boot", SERVER_INFO, "**.pid", "process id"),
    # ---- native (evalpipe serve) -------------------------------------------------------------------------
    Rule("native", "per boot", MODELS, "data[*].created", "the boot time"),
    Rule(
        "native",
        "per call",
        SERVER_INFO,
        "internal_states",
        "serving state: slots, pools, RSS, speculative totals, uptime",
    ),
    Rule("native", "per boot", SERVER_INFO, "load_seconds", "how long this boot took to load"),
    Rule(
        "native",
        "per boot",
        SERVER_INFO,
        "launch",
        "the server's own command line, which holds the port; every setting in it is reported under server_args",
    ),
    Rule("native", "per boot", SERVER_INFO, "server_args.argv", "the same command line"),
    # ---- SGLang ------------------------------------------------------------------------------------------
    Rule("sglang", "per call", MODELS, "data[*].created", "a fresh timestamp on every /v1/models call"),
    Rule(
        "sglang",
        "per call",
        SERVER_INFO,
        "internal_states",
        "live scheduler state per DP rank: avg_spec_accept_length, last_gen_throughput, memory",
    ),
    Rule("sglang", "per call", SERVER_INFO, "last_gen_throughput", "running throughput (older builds: top level)"),
    Rule("sglang", "per call", SERVER_INFO, "memory_usage", "current memory use (older builds: top level)"),
    Rule("sglang", "per call", SERVER_INFO, "load", "current load (older builds: top level)"),
    Rule("sglang", "per boot", SERVER_INFO, "startup_time", "when this boot started"),
    Rule(
        "sglang",
        "per boot",
        SERVER_INFO,
        "launch_command",
        "the command line as given, which holds the port; every setting in it is reported resolved beside it",
    ),
    # ---- vLLM --------------------------------------------------------------------------------------------
    Rule("vllm", "per call", MODELS, "data[*].created", "a fresh timestamp on every /v1/models call"),
    Rule("vllm", "per call", MODELS, "data[*].permission[*].id", "a fresh random modelperm-... id on every call"),
    Rule("vllm", "per call", MODELS, "data[*].permission[*].created", "a fresh timestamp on every call"),
    Rule("vllm", "per boot", SERVER_INFO, "vllm_config.instance_id", "a random id drawn at every boot"),
    Rule(
        "vllm",
        "per boot",
        SERVER_INFO,
        "vllm_config.compilation_config.compilation_time",
        "seconds this boot spent compiling",
    ),
    Rule(
        "vllm",
        "per boot",
        SERVER_INFO,
        "vllm_config.compilation_config.encoder_compilation_time",
        "seconds spent compiling",
    ),
    Rule(
        "vllm",
        "per boot",
        SERVER_INFO,
        "vllm_env.VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME",
        "a random shared-memory name per boot",
    ),
    Rule(
        "vllm",
        "per boot",
        SERVER_INFO,
        "system_env.env_vars",
        "the same shared-memory name, inside the environment listing",
        line="VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME=*",
    ),
)

# Settings an engine derives from a speculative config under names that say nothing of speculation: a declared
# speculation flag explains them in `evalpipe ab` (as it explains every setting whose name mentions speculation).
SPECULATION_DERIVED: tuple[Rule, ...] = (
    Rule(
        "vllm",
        "per boot",
        SERVER_INFO,
        "vllm_config.scheduler_config.max_num_scheduled_tokens",
        "set to the token budget once speculation reserves room for draft tokens",
    ),
    Rule(
        "vllm",
        "per boot",
        SERVER_INFO,
        "vllm_config.parallel_config.disable_nccl_for_dp_synchronization",
        "turned off by vLLM when a speculative config is given",
    ),
)


def _segments(path: str) -> list[str]:
    """'data[0].permission[1].id' -> ['data', '[*]', 'permission', '[*]', 'id']."""
    out: list[str] = []
    for part in path.split("."):
        name, *indexes = re.split(r"(?=\[)", part)
        if name:
            out.append(name)
        out.extend("[*]" for _ in indexes)
    return out


def _match(pattern: list[str], path: list[str]) -> bool:
    """Segment-wise glob; `**` matches any number of segments. A pattern matching a prefix covers the subtree."""
    if not pattern:
        return True
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_match(rest, path[i:]) for i in range(len(path) + 1))
    if not path:
        return False
    same = path[0] == head if "[*]" in (head, path[0]) else fnmatch.fnmatchcase(path[0], head)
    return same and _match(rest, path[1:])


def _compiled(rules: Iterable[Rule]) -> list[tuple[Rule, list[str]]]:
    return [(rule, _segments(rule.path)) for rule in rules]


_RULES = _compiled(RULES)
_DERIVED = _compiled(SPECULATION_DERIVED)

# Words in a setting's name that make it a speculation setting (`evalpipe ab` and `evalpipe compare` read them so).
SPECULATION_WORDS = (
    "spec",
    "draft",
    "block_size",
    "accept",
    "simulat",
    "dspark",
    "eagle",
    "nextn",
    "decode_width",
    "verify",
)


def derived_from_speculation(path: str) -> bool:
    segments = _segments(path)
    return any(_match(pattern, segments) for _, pattern in _DERIVED)


def strip(document: str, value: Any) -> Any:
    """A copy of `value` (a /v1/models or server-info JSON document) without its volatile fields."""
    return _strip(value, [], [(rule, pattern) for rule, pattern in _RULES if rule.document == document])


def _strip(value: Any, path: list[str], rules) -> Any:
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            sub = path + [str(key)]
            if any(rule.line is None and _match(pattern, sub) for rule, pattern in rules):
                continue
            out[key] = _strip(item, sub, rules)
        return out
    if isinstance(value, list):
        return [_strip(item, path + ["[*]"], rules) for item in value]
    if isinstance(value, str) and "\n" in value:
        globs = [
            rule.line
            for rule, pattern in rules
            if rule.line is not None and len(pattern) == len(path) and _match(pattern, path)
        ]
        if globs:
            return "\n".join(line for line in value.split("\n") if not any(fnmatch.fnmatchcase(line, g) for g in globs))
    return value


def strip_server(server: Any) -> Any:
    """A run manifest's `server` section ({"models", "server_info_path", "server_info"}) without volatile fields."""
    if not isinstance(server, dict):
        return server
    out = dict(server)
    if "models" in out:
        out["models"] = strip(MODELS, out["models"])
    if "server_info" in out:
        out["server_info"] = strip(SERVER_INFO, out["server_info"])
    return out
