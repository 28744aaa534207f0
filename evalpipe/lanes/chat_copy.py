"""Lane `chat-copy`: the `copy` skill for instruct models, 200 held-out random strings of evalpipe.skills.copy_text
(8 to 256 characters, 40 per length group), as one user message through the model's own chat template.

The user message is the copy question and then what to reply: `Copy the text exactly: <text>` and, on the next
line, `Reply with the text only.` /v1/chat/completions, greedy (temperature 0, seed 0), max_tokens 384 (a random
string of 256 letters and digits is at most 256 tokens in any tokenizer that has single-character tokens for them).
Graded exact: message.content with surrounding whitespace stripped must equal the string (nothing else is
normalised: case, inner spaces and punctuation count). Reported per length group. The default model keeps its
completion form in `copy`.
"""

from evalpipe.lanes.skill_lane import as_user_message, chat_skill_lane
from evalpipe.skills import copy_text
from evalpipe.skills.chat import ChatExample

# (group, shortest, longest) characters: doubling lengths, so the group where copies start to fail shows
RANGES = [("c16", 8, 16), ("c32", 17, 32), ("c64", 33, 64), ("c128", 65, 128), ("c256", 129, 256)]
TEMPLATE = "{body}\nReply with the text only."
PARAMS = {"temperature": 0.0, "top_p": 1.0, "seed": 0, "max_tokens": 384}


def generate(rng, lo: int, hi: int) -> ChatExample:
    return as_user_message("chat-copy", copy_text.generate(rng, length=rng.randint(lo, hi)), TEMPLATE)


LANE = chat_skill_lane(
    name="chat-copy",
    description="Synthetic exact copy of random strings (8-256 characters), asked through the chat template.",
    grader="exact_text",
    params=PARAMS,
    seed="lane|chat-copy|v1",
    repeats=1,
    groups=[(label, 40, lambda rng, lo=lo, hi=hi: generate(rng, lo, hi)) for label, lo, hi in RANGES],
    template=TEMPLATE,
    headline="accuracy = exact copies / 200 planned (by group: string length)",
    notes="held-out split of evalpipe.skills (identity hash); exact match after stripping surrounding whitespace",
)
