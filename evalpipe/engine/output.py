"""The output half of an engine step: committed tokens become text, stops, logprobs and the events a request's
listener receives (what nano-vllm keeps out of its `LLMEngine`).

- `advance`: append the tokens a step committed to a sequence, detokenize them, and find where it ends (a stop
  token, a stop string, or its length limit); min_tokens holds every stop off.
- `take_text`: the text not yet sent, less a tail that may still grow into a stop string (held back from streams).
- `logprob_entries`: the chosen tokens' logprobs and top alternatives, when the request asked for them.
- `deliver`: hand an event to the listener, merging events up to the stream interval.
- `score_prompt_chunk`: the prompt tokens' logprobs and ranks (`prompt_logprobs`), chunk by chunk.
"""

from __future__ import annotations

import logging
import traceback

import torch

from evalpipe.engine.ipc import SeqEvent
from evalpipe.engine.sampling import token_logprobs
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import PrefillChunk, Sequence

log = logging.getLogger("evalpipe.engine")


def advance(seq: Sequence, tokens: list[int], eos_token_id: int | None, max_len: int) -> tuple[list[int], str | None]:
    """Commit `tokens` to `seq` up to its end; (the tokens taken, the finish reason or None)."""
    params = seq.params
    taken: list[int] = []
    reason: str | None = None
    stop_hit = False
    for tok in tokens:
        held_open = params.bans_stops(len(seq.output))  # min_tokens: no stop of any kind yet
        seq.output.append(tok)
        taken.append(tok)
        stops_at_eos = not params.ignore_eos or params.grammar is not None  # a grammar ends at the stop token
        if not held_open and (tok in params.stop_token_ids or (tok == eos_token_id and stops_at_eos)):
            reason, seq.matched_stop = "stop", tok
            if params.include_stop_str_in_output:
                seq.text += seq.detokenizer.push([tok])
            break
        seq.text += seq.detokenizer.push([tok])
        if held_open:
            seq.stop_from = len(seq.text)  # stop strings match only in text after the first min_tokens
        elif params.stop and find_stop(seq):
            reason, stop_hit = "stop", True
            break
        if len(seq.output) >= params.max_tokens or len(seq.prompt) + len(seq.output) >= max_len:
            reason = "length"
            break
    if reason is not None and not stop_hit:
        seq.text += seq.detokenizer.flush()
    return taken, reason


def take_text(seq: Sequence, finished: bool) -> str:
    """The text to send now: all that is new when the sequence finished, else less what may become a stop string."""
    end = len(seq.text) if finished else len(seq.text) - stop_holdback(seq.text, seq.params.stop)
    delta = seq.text[seq.sent : max(end, seq.sent)]
    seq.sent = max(end, seq.sent)
    return delta


def logprob_entries(params: SamplingParams, taken: list[int], logit_rows: torch.Tensor | None) -> list[dict] | None:
    if params.logprobs is None:
        return None
    pairs = token_logprobs(logit_rows[: len(taken)], torch.tensor(taken, device=logit_rows.device), params.logprobs)
    return [{"id": t, "logprob": lp, "top": top} for t, (lp, top) in zip(taken, pairs)]


def find_stop(seq: Sequence) -> bool:
    """Search the new text for a stop string; on a match cut the text before it and record the match."""
    text = seq.text
    longest = max(len(s) for s in seq.params.stop)
    start = max(seq.stop_from, seq.checked - longest + 1)
    best = None
    for s in seq.params.stop:
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    seq.checked = len(text)
    if best is None:
        return False
    seq.text = text[: best[0] + (len(best[1]) if seq.params.include_stop_str_in_output else 0)]
    seq.matched_stop = best[1]
    return True


def stop_holdback(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that could still grow into a stop string (held back from streams)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def deliver(seq: Sequence, event: SeqEvent, stream_interval: int) -> None:
    """Hand `event` to the sequence's listener. With a stream interval N > 1, events after the one with the
    first token are held and merged until they carry N tokens or end the sequence (SGLang's --stream-interval):
    N times fewer events for the server process and its clients to stream, the same tokens and text."""
    if seq.on_event is None:
        return
    held, seq.held = seq.held, None
    if held is not None:
        event = held.then(event)
    if (
        stream_interval > 1
        and event.finish_reason is None
        and event.error is None
        and len(event.token_ids) < stream_interval
        and len(seq.output) > len(event.token_ids)
    ):
        seq.held = event
        return
    try:
        seq.on_event(event)
    except Exception:  # a failing listener must not kill the engine loop
        log.warning("dropping event for sequence %s:\n%s", seq.id, traceback.format_exc())


def score_prompt_chunk(chunk: PrefillChunk, rows: torch.Tensor) -> None:
    """Each prompt token's logprob (and the top k) from the rows of this prompt chunk: row j of a chunk starting
    at prompt position s scores prompt[s + j + 1]; the prompt's last row scores the first generated token and is
    left to the output path. The first prompt token has no logprob (None)."""
    seq = chunk.seq
    start = seq.num_prefilled - len(chunk.tokens)
    targets = seq.prompt[start + 1 : start + 1 + len(chunk.tokens)]
    if seq.prompt_logprobs is None:
        seq.prompt_logprobs = [None] if start == 0 else []
    scored = seq.prompt_logprobs
    if not targets:
        return
    rows = rows[: len(targets)]
    ids = torch.tensor(targets, device=rows.device)
    pairs = token_logprobs(rows, ids, seq.params.prompt_logprobs)
    logp = torch.log_softmax(rows.float(), dim=-1)
    ranks = (logp > logp.gather(-1, ids.view(-1, 1))).sum(-1).add(1).tolist()  # vLLM's rank: 1 = the argmax
    scored.extend({"id": t, "logprob": lp, "rank": r, "top": top} for t, (lp, top), r in zip(targets, pairs, ranks))
