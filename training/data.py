"""Training batches from the skill generators: token ids, the answer-token loss mask, and the held-out eval sets.

A batch is either *short* (the skill mixture of the recipe's stage in force, every example under ~1k tokens) or *long*
(retrieval reaching to the far end of the context), of examples of similar length padded on the right. The recipes
and their schedule over training progress are training/curriculum.py's. Only answer tokens (the reply and
its closing `<|eos|>`) carry loss. Each worker draws from its own seeded stream, and only identities of the training
split are used (`evalpipe.skills.split_of`).
"""

from __future__ import annotations

import multiprocessing
import random
from dataclasses import dataclass

import torch

from evalpipe.engine.tokenizer import ByteTokenizer
from evalpipe.skills import Example, arith, boxed, chat, copy_text, draw, retrieval, tools
from training.buckets import LONG_BUCKETS, SHORT_BUCKETS, check_short
from training.curriculum import DEFAULT_RECIPE, RECIPES, Recipe, Stage

TOKENIZER = ByteTokenizer()
PAD_ID = 7  # <|pad|>; right padding is never attended to by real tokens (causal) and carries no loss

LONG_AFTER = (512, 3900)  # filler bytes after the needle in long batches: the top caps every recipe's long range


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
        prompt = TOKENIZER.apply_chat_template(
            ex.messages, add_generation_prompt=True, tools=ex.tools, **ex.template_kwargs
        )
        reply = TOKENIZER.encode(ex.reply)
        group = ex.skill
    else:
        prompt = TOKENIZER.encode_prompt(ex.prompt)
        reply = TOKENIZER.encode(ex.completion)
        group = ex.group
    return Encoded(ex.skill, group, prompt + reply + [TOKENIZER.eos_token_id], len(prompt))


def sample_short(
    rng: random.Random, split: str = "train", recipe: Recipe | None = None, stage: Stage | None = None
) -> Encoded:
    """One short example of `stage` (default: the recipe's last stage; recipe default: the default recipe)."""
    recipe = recipe or RECIPES[DEFAULT_RECIPE]
    stage = stage or recipe.stages[-1]
    return encode(draw(recipe.sample_part(rng, stage), rng, split))


def sample_long(
    rng: random.Random, split: str = "train", recipe: Recipe | None = None, stage: Stage | None = None
) -> Encoded:
    """One deep-retrieval example of `stage`'s long range (capped at LONG_AFTER's top)."""
    recipe = recipe or RECIPES[DEFAULT_RECIPE]
    stage = stage or recipe.stages[-1]
    return encode(draw(recipe.long_example(rng, stage, LONG_AFTER[1]), rng, split))


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


class BatchStream(torch.utils.data.IterableDataset):
    """Endless batches of about `batch_tokens` padded tokens, each of examples of similar length (a batch is padded
    to its length bucket's bound, `short_buckets` for the short batches, so little compute goes to padding; fewer
    buckets mean fewer shapes for a compiled step). Every `long_every`-th batch is a long one of
    `long_tokens`. Worker w of W draws from the seeded stream (seed, w), and call k > 0 of a resumed run from
    (seed, w, k), so a resumed run never repeats the examples of its earlier calls.

    Each batch is drawn from the recipe's stage at the progress the trainer last set (`set_progress`, a fraction
    of the planned steps, shared with forked data workers); batches already queued keep the stage they were drawn
    in."""

    def __init__(
        self,
        seed: int,
        batch_tokens: int,
        long_tokens: int,
        long_every: int,
        call: int = 0,
        recipe: Recipe | str = DEFAULT_RECIPE,
        progress: float = 0.0,
        short_buckets: tuple = SHORT_BUCKETS,
    ):
        check_short(short_buckets)
        self.seed, self.batch_tokens, self.long_tokens, self.long_every = seed, batch_tokens, long_tokens, long_every
        self.short_buckets = tuple(short_buckets)
        self.call = call
        self.recipe = RECIPES[recipe] if isinstance(recipe, str) else recipe
        self._progress = multiprocessing.Value("d", progress, lock=False)

    def set_progress(self, fraction: float) -> None:
        self._progress.value = fraction

    def stage(self) -> Stage:
        return self.recipe.stage_at(self._progress.value)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info else (0, 1)
        rng = random.Random(f"train|{self.seed}|{worker}" + (f"|call{self.call}" if self.call else ""))
        pools = {b: [] for b in self.short_buckets + LONG_BUCKETS}
        step = worker
        while True:
            long = self.long_every and step % self.long_every == self.long_every - 1
            buckets, budget, sample = (
                (LONG_BUCKETS, self.long_tokens, sample_long)
                if long
                else (self.short_buckets, self.batch_tokens, sample_short)
            )
            stage = self.stage()
            while True:
                ex = sample(rng, recipe=self.recipe, stage=stage)
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
    add("boxed", boxed.generate, n=per_group // 2)
    add("boxed-think", boxed.generate_thinking, n=per_group // 2)
    add("tools", tools.generate, n=per_group // 2)
    for lo, hi in ((4, 60), (161, 256)):  # copy inside the window, and longer than the copy lane's strings
        add(
            f"copy/{lo}-{hi}", lambda r, lo=lo, hi=hi: copy_text.generate(r, length=r.randint(lo, hi)), n=per_group // 2
        )
    return sets
