"""evalpipe's lane items as lm-eval documents, so lm-eval scores exactly the items `evalpipe run` scores.

lm-eval's environment does not install evalpipe: the repository root (this folder's parent) goes on sys.path and
the items come from the lane itself (`evalpipe.lanes.<lane>`, pure Python), never from a copy that could drift.
A document keeps the lane's question id, prompt, expected answer and group; lm-eval's doc_id is the row index,
which equals the question id because rows are written in id order.
"""

from __future__ import annotations

import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]


def lane_documents(lane_name: str) -> list[dict]:
    if str(_REPO) not in sys.path:
        sys.path.insert(0, str(_REPO))
    from evalpipe.lanes import get_lane

    lane = get_lane(lane_name)
    return [
        {
            "question_id": it.question_id,
            "prompt": it.prompt,
            "expected_answer": str(it.expected_answer),
            "group": it.group,
        }
        for it in lane.load(None, allow_data_drift=False).items
    ]


def arith_dataset(**_metadata):
    """lm-eval `custom_dataset` hook: the arith lane's 1200 held-out items as the `test` split."""
    import datasets

    return {"test": datasets.Dataset.from_list(lane_documents("arith"))}
