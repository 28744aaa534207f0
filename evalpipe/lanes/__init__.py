"""What a lane is, and the registry of the lanes in this package.

A lane is a complete protocol: which rows are scored, the exact prompt, the endpoint, the sampling
parameters, how many repeats, and how an answer is graded. Each lane lives in one module of this package
(`evalpipe/lanes/<lane>.py`) so its whole protocol reads in one place; this module only holds the shared shapes,
the lookup and the pins. To add a lane: write its module (a `LANE` object), add it to LANE_MODULES, and pin its
hashes in `pins/<lane>.json` (`evalpipe lanes --check-pins --json` prints them).
"""

from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

# lane name -> module that defines `LANE`
LANE_MODULES: dict[str, str] = {
    "gsm8k": "evalpipe.lanes.gsm8k",
    "aime26": "evalpipe.lanes.aime26",
    "aime26-x16": "evalpipe.lanes.aime26_x16",
    "arith": "evalpipe.lanes.arith",
    "retrieval": "evalpipe.lanes.retrieval",
    "copy": "evalpipe.lanes.copy_text",
    "chat-copy": "evalpipe.lanes.chat_copy",
    "chat-retrieval": "evalpipe.lanes.chat_retrieval",
    "chat-arith-boxed": "evalpipe.lanes.chat_arith_boxed",
    "chat-arith-boxed-think": "evalpipe.lanes.chat_arith_boxed_think",
    "chat-arith-boxed-think-x16": "evalpipe.lanes.chat_arith_boxed_think_x16",
}


def sha256_hex(data: bytes | str) -> str:
    if isinstance(data, str):
        data = data.encode("utf-8")
    return hashlib.sha256(data).hexdigest()


def canonical_json(obj: Any) -> str:
    """The one JSON spelling used for hashing (sorted keys, no spaces, UTF-8 kept)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def prompt_sha256(prompt: str | list) -> str:
    """sha256 of the exact UTF-8 prompt text, or of the canonical JSON of chat messages."""
    return sha256_hex(prompt if isinstance(prompt, str) else canonical_json(prompt))


def prompt_stream_sha256(prompt_digests_hex: list[str]) -> str:
    """sha256 over the concatenated raw 32-byte per-prompt digests, in id order."""
    return hashlib.sha256(b"".join(bytes.fromhex(d) for d in prompt_digests_hex)).hexdigest()


def id_list_sha256(ids: list) -> str:
    """sha256 of the ordered held-out id list, as canonical JSON (`[5,6,...]` or `["aime26-0",...]`)."""
    return sha256_hex(canonical_json(list(ids)))


@dataclass(frozen=True)
class Item:
    """One scored question: its id, the exact prompt (str for /completions, messages for chat), the gold."""

    question_id: Any
    prompt: Any
    expected_answer: Any
    prompt_sha256: str
    group: Optional[str] = None  # reporting bucket (e.g. number of operations); summary gives accuracy per group


def item_groups(items: list[Item]) -> Optional[dict]:
    """question id -> reporting group, for lanes whose items have groups (else None)."""
    groups = {it.question_id: it.group for it in items if it.group is not None}
    return groups or None


@dataclass
class LaneData:
    """The loaded, hash-checked items of a lane plus the provenance the manifest records."""

    items: list[Item]
    dataset_path: str
    dataset_sha256: str
    data_drift: bool  # True when the file differs from the pin and --allow-data-drift let it through
    template_id: str
    template_sha256: str
    extra: dict = field(default_factory=dict)  # lane-specific provenance (e.g. prompt wording note)

    @property
    def ids(self) -> list:
        return [it.question_id for it in self.items]

    def stream_sha256(self) -> str:
        return prompt_stream_sha256([it.prompt_sha256 for it in self.items])


@dataclass(frozen=True)
class Lane:
    """A lane's fixed protocol. Subclasses in the lane modules implement `load`."""

    name: str
    description: str
    api: str  # "completions" (raw prompt) or "chat"
    params: dict  # sampling parameters sent by default: temperature, top_p, seed, max_tokens, stop, ...
    concurrency: int
    repeats: int
    grader: str  # "legacy_last_int", "exact_text" (in-process) or "ns_last_boxed" (process pool, hard timeout)
    headline: str  # what `accuracy` means for this lane
    notes: str = ""

    def load(self, data_dir: Optional[Path], allow_data_drift: bool) -> LaneData:  # pragma: no cover
        raise NotImplementedError

    def describe(self) -> dict:
        """The protocol as recorded in every manifest: the fields above, in that order (a subclass's own are not)."""
        desc = {f.name: getattr(self, f.name) for f in fields(Lane)}
        return {**desc, "params": dict(self.params)}


def get_lane(name: str) -> Lane:
    if name not in LANE_MODULES:
        raise KeyError(name)
    return importlib.import_module(LANE_MODULES[name]).LANE


def all_lanes() -> list[Lane]:
    return [get_lane(n) for n in LANE_MODULES]


# ---------------------------------------------------------------------------------------------------------
# pins (pins/<lane>.json): the expected dataset / id-list / template / prompt-stream hashes. They ship inside the
# package (package data), so an installed evalpipe checks the same hashes as a source checkout.

PINS_DIR = Path(__file__).resolve().parent / "pins"


def load_pins(lane_name: str) -> dict:
    path = PINS_DIR / f"{lane_name}.json"
    if not path.exists():
        raise FileNotFoundError(f"no pin file for lane {lane_name!r} at {path}")
    return json.loads(path.read_text())


def computed_pins(lane: Lane, data: LaneData) -> dict:
    """The hashes `pins/<lane>.json` holds, computed from loaded data (all scored items)."""
    return {
        "lane": lane.name,
        "n_items": len(data.items),
        "dataset_sha256": data.dataset_sha256,
        "id_list_sha256": id_list_sha256(data.ids),
        "template_id": data.template_id,
        "template_sha256": data.template_sha256,
        "prompt_stream_sha256": data.stream_sha256(),
    }


def pin_differences(lane: Lane, data: LaneData) -> list[str]:
    """Human-readable differences between computed and pinned hashes (empty when all match)."""
    pins = load_pins(lane.name)
    got = computed_pins(lane, data)
    return [
        f"{k}: pinned {pins.get(k)!r}, got {got[k]!r}"
        for k in ("n_items", "dataset_sha256", "id_list_sha256", "template_sha256", "prompt_stream_sha256")
        if pins.get(k) != got[k]
    ]
