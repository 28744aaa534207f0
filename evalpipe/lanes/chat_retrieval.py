"""Lane `chat-retrieval`: the `retrieval` skill for instruct models, 200 held-out needles of
evalpipe.skills.retrieval in prompts of up to 12,000 bytes, 40 at each of five depths, as one user message through
the model's own chat template.

The user message is the notes, the question, and then what to reply: `Reply with the code only.` Depth = bytes from
the needle's value to the end of the notes and question: just before the question (d0), about 1,000, 3,000 and
6,000 bytes, and the deepest (the needle first). A subword tokenizer spends about 3 to 4 bytes per token on these
notes (SmolLM2's: about 3.2), so the longest prompts are about 3,000 to 4,000 tokens: a server with a 4,096-token
context takes them. They are longer than the byte-level default model's 4,096-token context; it keeps `retrieval`.
/v1/chat/completions, greedy (temperature 0, seed 0), max_tokens 16. Graded exact: message.content with surrounding
whitespace stripped must equal the 5-digit code. Reported per depth group.
"""

from evalpipe.lanes.skill_lane import as_user_message, chat_skill_lane
from evalpipe.skills import retrieval
from evalpipe.skills.chat import ChatExample

CONTEXT_BYTES = 12000  # the prompt and reply budget in bytes handed to the generator
# (group, filler bytes after the needle, filler bytes before it: None = random, 0 = the needle first)
DEPTHS = [("d0", 0, None), ("d1k", 900, None), ("d3k", 2900, None), ("d6k", 5900, None), ("deepest", 11600, 0)]
TEMPLATE = "{body}\nReply with the code only."
PARAMS = {"temperature": 0.0, "top_p": 1.0, "seed": 0, "max_tokens": 16}


def generate(rng, after: int, before) -> ChatExample:
    return as_user_message(
        "chat-retrieval", retrieval.generate(rng, after=after, before=before, context=CONTEXT_BYTES), TEMPLATE
    )


LANE = chat_skill_lane(
    name="chat-retrieval",
    description="Synthetic needle retrieval at five depths in prompts up to 12,000 bytes, asked through the chat "
    "template.",
    grader="exact_text",
    params=PARAMS,
    seed="lane|chat-retrieval|v1",
    repeats=1,
    groups=[(label, 40, lambda rng, a=after, b=before: generate(rng, a, b)) for label, after, before in DEPTHS],
    template=TEMPLATE,
    headline="accuracy = exact codes / 200 planned (by group: depth)",
    notes="held-out split of evalpipe.skills (identity hash); exact match after stripping surrounding whitespace",
)
