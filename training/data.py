"""Training batches from the skill generators: token ids, the answer-token loss mask, and the held-out eval sets.

A batch is either *short* (the skill mixture below, every example under ~1k tokens) or *long* (retrieval reaching to
the far end of the context), of examples of similar length padded on the right. Only answer tokens (the reply and
its closing `<|eos|>`) carry loss. Each worker draws from its own seeded stream, and only identities of the training
split are used (`evalpipe.skills.split_of`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from evalpipe.engine.tokenizer import ByteTokenizer
from evalpipe.skills import Example, arith, chat, copy_text, draw, retrieval

TOKENIZER = ByteTokenizer()
PAD_ID = 7  # <|pad|>; right padding is never attended to by real tokens (causal) and carries no loss

# name -> (weight, generator) of the short mixture (`--mix` can change the weights)
SHORT_MIX = {
    "arith": (0.30, arith.generate),
    "calc": (0.08, arith.drill),
    "copy-short": (0.07, lambda rng: copy_text.generate(rng, length=rng.randint(8, copy_text.LENGTHS[0]))),
    "copy": (0.08, copy_text.generate),
    "retrieval": (
        0.15,
        lambda rng: retrieval.generate(rng, after=int(2 ** rng.uniform(3, 9.3)), before=rng.randint(0, 256)),
    ),
    "chat": (0.32, chat.generate),
}


def set_mix(spec: str) -> None:
    """Reweight the short mixture from `name=weight,...` (weights are normalised)."""
    weights = {k: float(v) for k, v in (part.split("=") for part in spec.split(",") if part)}
    unknown = set(weights) - set(SHORT_MIX)
    if unknown:
        raise ValueError(f"unknown mixture parts {sorted(unknown)}; known: {sorted(SHORT_MIX)}")
    total = sum(weights.get(k, 0.0) for k in SHORT_MIX)
    for k, (_, gen) in list(SHORT_MIX.items()):
        SHORT_MIX[k] = (weights.get(k, 0.0) / total, gen)


LONG_AFTER = (512, 3900)  # filler bytes after the needle in long batches (log-uniform)


@dataclass
class Encoded:
    skill: str
    group: str
    ids: list[int]
    n_prompt: int  # the first n_prompt ids are the prompt; the rest are answer tokens with loss

    def __len__(self) -> int:
        return len(self.ids)


def encode(ex: Example | chat.ChatExample) -> Encoded:
    """Prompt ids exactly as the server builds them (BOS + text, or the chat template), then reply + <|eos|>."""
    if isinstance(ex, chat.ChatExample):
        prompt = TOKENIZER.apply_chat_template(ex.messages, add_generation_prompt=True, tools=ex.tools)
        reply = TOKENIZER.encode(ex.reply)
        group = ex.skill
    else:
        prompt = TOKENIZER.encode_prompt(ex.prompt)
        reply = TOKENIZER.encode(ex.completion)
        group = ex.group
    return Encoded(ex.skill, group, prompt + reply + [TOKENIZER.eos_token_id], len(prompt))


def sample_short(rng: random.Random, split: str = "train") -> Encoded:
    r, acc = rng.random(), 0.0
    for weight, gen in SHORT_MIX.values():
        acc += weight
        if r < acc:
            break
    return encode(draw(gen, rng, split))


def sample_long(rng: random.Random, split: str = "train") -> Encoded:
    lo, hi = LONG_AFTER
    after = int(round(2 ** rng.uniform(math.log2(lo), math.log2(hi))))
    return encode(draw(lambda r: retrieval.generate(r, after=after), rng, split))


def collate(examples: list[Encoded], width: int | None = None) -> dict[str, torch.Tensor]:
    """input_ids [B, S] (right-padded to `width`, default the longest); labels [B, S]: next-token targets of the
    answer, -100 elsewhere; prompt_labels [B, S]: next-token targets inside the prompt (a weak auxiliary loss)."""
    width = width or max(len(e) for e in examples)
    ids = torch.full((len(examples), width), PAD_ID, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    prompt_labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, : len(e)] = torch.tensor(e.ids)
        # position t predicts token t+1: answer tokens are predicted from positions n_prompt-1 .. len-2
        labels[i, e.n_prompt - 1 : len(e) - 1] = torch.tensor(e.ids[e.n_prompt :])
        prompt_labels[i, : e.n_prompt - 1] = torch.tensor(e.ids[1 : e.n_prompt])
    return {"input_ids": ids, "labels": labels, "prompt_labels": prompt_labels}


SHORT_BUCKETS = (192, 256, 320, 384, 448, 512, 640, 768, 1024)  # padded lengths of short batches
LONG_BUCKETS = (1536, 2560, 4096)


class BatchStream(torch.utils.data.IterableDataset):
    """Endless batches of about `batch_tokens` padded tokens, each of examples of similar length (a batch is padded
    to its length bucket's bound, so little compute goes to padding). Every `long_every`-th batch is a long one of
    `long_tokens`. Worker w of W draws from the seeded stream (seed, w), and call k > 0 of a resumed run from
    (seed, w, k), so a resumed run never repeats the examples of its earlier calls."""

    def __init__(self, seed: int, batch_tokens: int, long_tokens: int, long_every: int, call: int = 0):
        self.seed, self.batch_tokens, self.long_tokens, self.long_every = seed, batch_tokens, long_tokens, long_every
        self.call = call

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info else (0, 1)
        rng = random.Random(f"train|{self.seed}|{worker}" + (f"|call{self.call}" if self.call else ""))
        pools = {b: [] for b in SHORT_BUCKETS + LONG_BUCKETS}
        step = worker
        while True:
            long = self.long_every and step % self.long_every == self.long_every - 1
            buckets, budget, sample = (
                (LONG_BUCKETS, self.long_tokens, sample_long)
                if long
                else (SHORT_BUCKETS, self.batch_tokens, sample_short)
            )
            while True:
                ex = sample(rng)
                bound = next((b for b in buckets if len(ex) <= b), None)
                if bound is None:
                    continue  # longer than the largest bucket: never happens with the skills' limits
                pools[bound].append(ex)
                if len(pools[bound]) * bound >= budget:
                    batch, pools[bound] = pools[bound], []
                    break
            step += n_workers
            yield collate(batch, width=bound)


def eval_sets(seed: int = 1234, per_group: int = 64, max_after: int = 4096) -> dict[str, list[Encoded]]:
    """Held-out examples per (skill, group) for teacher-forced exact match during training (retrieval depths up
    to `max_after` bytes of filler)."""
    rng = random.Random(f"train-eval|{seed}")
    sets: dict[str, list[Encoded]] = {}

    def add(name, gen, n=per_group):
        sets[name] = [encode(draw(gen, rng, "heldout")) for _ in range(n)]

    for n_ops in (2, 3, 4):
        add(f"arith/{n_ops}ops", lambda r, k=n_ops: arith.generate(r, n_ops=k))
    add("copy", copy_text.generate)
    add("copy-short", lambda r: copy_text.generate(r, length=r.randint(8, copy_text.LENGTHS[0])), n=per_group // 2)
    add("calc", arith.drill, n=per_group // 2)
    for label, after in (("in-window", 0), ("d256", 150), ("d1024", 800), ("d2048", 1800), ("deepest", 3800)):
        if after > max_after:
            continue
        add(
            f"retrieval/{label}",
            lambda r, a=after: retrieval.generate(r, after=a, before=0 if a > 3000 else None),
            n=per_group // 2,
        )
    add("chat/tool_call", chat.tool_call, n=per_group // 2)
    add("chat/tool_result", chat.tool_result, n=per_group // 2)
    add("chat/json", chat.json_reply, n=per_group // 2)
    add("chat/arith", lambda r: chat.from_example(arith.generate(r)), n=per_group // 2)
    return sets
