"""evalpipe's arith lane as lm-eval documents: a multiple-choice task (each held-out item's worked answer among
distractors, evalpipe_arith_mc.yaml) and a chat task (the story as the user's message, evalpipe_arith_chat.yaml).

Document i is the arith lane's question i (same prompt `Question: ...\\nAnswer:`, so lm-eval's doc_id is evalpipe's
question id). Its four choices are worked answers in the trained format: the right one; the right working with a
wrong final `#### N` (off by 1 to 9); and the worked answers of two other stories of the lane (i + 1 and i + 2). A
model that follows the story and its own working prefers the right one; chance is 1/4. The order of the choices is
drawn from a generator seeded by the question id, so every run sees the same documents.

lm-eval's environment does not install evalpipe: the repository root (this folder's parent) goes on sys.path and
the items come from the lane's own generator (`evalpipe.lanes.skill_lane.lane_examples`), never from a copy.
"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
CHOICES = 4


def arith_examples() -> list:
    """The arith lane's held-out examples in question-id order (evalpipe.skills Example: body, prompt, answer)."""
    if str(_REPO) not in sys.path:
        sys.path.insert(0, str(_REPO))
    from evalpipe.lanes import get_lane
    from evalpipe.lanes.skill_lane import lane_examples

    return [ex for _, ex in lane_examples(get_lane("arith"))]


def mc_documents() -> list[dict]:
    examples = arith_examples()
    docs = []
    for i, ex in enumerate(examples):
        rng = random.Random(f"evalpipe_arith_mc|{i}")
        total = ex.meta["expected"]
        wrong_total = total + rng.choice([-1, 1]) * rng.randint(1, 9)
        if wrong_total < 0:
            wrong_total = total + rng.randint(1, 9)
        wrong = re.sub(r"#### \d+$", f"#### {wrong_total}", ex.answer)
        others = [examples[(i + k) % len(examples)].answer for k in (1, 2)]
        choices = [ex.answer, wrong, *others]
        order = list(range(CHOICES))
        rng.shuffle(order)
        docs.append(
            {
                "question_id": i,
                "prompt": ex.prompt,
                "choices": [choices[k] for k in order],
                "gold": order.index(0),
                "expected_answer": str(total),
            }
        )
    return docs


def chat_documents() -> list[dict]:
    """The story alone (the chat skill's user message; the template adds the roles), and the expected total."""
    return [
        {"question_id": i, "body": ex.body, "expected_answer": str(ex.meta["expected"])}
        for i, ex in enumerate(arith_examples())
    ]


def mc_dataset(**_metadata):
    """lm-eval `custom_dataset` hook: the multiple-choice documents as the `test` split."""
    import datasets

    return {"test": datasets.Dataset.from_list(mc_documents())}


def chat_dataset(**_metadata):
    """lm-eval `custom_dataset` hook: the chat documents as the `test` split."""
    import datasets

    return {"test": datasets.Dataset.from_list(chat_documents())}
