"""A step's logits become committed tokens: the first token of each finished prompt (greedy rows read in one host
transfer, keyed-sampled rows drawn in one pass, grammar masks, min_tokens bans), and each decoding sequence's rows
through its decoder's `accept` (plain sampling, or speculative verification). Prompt rows asked for logprobs are
scored on the way.
"""

from __future__ import annotations

import torch

from evalpipe.engine import output
from evalpipe.engine.contracts import Decoder
from evalpipe.engine.keyed import KeyedNoise
from evalpipe.engine.sampling import KeyedRow, StepArgmax, keyed_sample_rows, sample_token
from evalpipe.engine.scheduler import Sequence, StepBatch


def commit_tokens(
    batch: StepBatch,
    rows: list[list[int]],
    logits: torch.Tensor,
    all_logits: bool,
    decoder: Decoder,
    eos_token_id: int | None,
) -> dict[Sequence, tuple[list[int], torch.Tensor]]:
    """Sample the first token of each finished prompt and let the decoder advance the decoding sequences."""
    out: dict[Sequence, tuple[list[int], torch.Tensor]] = {}
    offset = 0
    width = [len(r) if all_logits else 1 for r in rows]
    argmax = StepArgmax(logits)  # greedy rows without a grammar: one host read for the whole step
    samples = step_keyed_samples(batch, width, logits, decoder)
    for chunk, w in zip(batch.prefills, width):
        if chunk.seq.params.prompt_logprobs is not None:
            output.score_prompt_chunk(chunk, logits[offset : offset + w])
        if chunk.last:
            row = logits[offset + w - 1 : offset + w]
            constraint = chunk.seq.matcher
            banned = chunk.seq.params.bans_stops(0)
            if constraint is None and chunk.seq.params.greedy and not banned:
                token = argmax.rows(offset + w - 1, offset + w)[0]
            elif chunk.seq in samples:
                token = samples[chunk.seq][0]
            else:
                sampled = constraint.mask(row) if constraint is not None else row
                sampled = ban_stops(chunk.seq, sampled, eos_token_id) if banned else sampled
                token = sample_token(sampled[0], chunk.seq.params, chunk.seq.generator, len(chunk.seq.output))
            if constraint is not None:
                constraint.commit([token])
            out[chunk.seq] = ([token], row)
        offset += w
    decode_rows, decode_width = rows[len(batch.prefills) :], width[len(batch.prefills) :]
    # every decoding sequence's rows as views made in one call: a slice per sequence costs microseconds of host time
    decode_logits = logits[offset : offset + sum(decode_width)].split(decode_width) if batch.decodes else ()
    for seq, w, fed, seq_rows in zip(batch.decodes, decode_width, decode_rows, decode_logits):
        constraint = seq.matcher
        banned = seq.params.bans_stops(len(seq.output))
        if constraint is None and not banned:
            greedy_rows = argmax.rows(offset, offset + w) if seq.params.greedy else None
            tokens = decoder.accept(seq, seq_rows, greedy_rows, samples.get(seq))
        else:  # row i scores the token after fed[:i + 1]; fed[1:] are the drafts (none in plain decoding)
            masked = constraint.mask(seq_rows, fed[1:]) if constraint is not None else seq_rows
            tokens = decoder.accept(seq, ban_stops(seq, masked, eos_token_id) if banned else masked)
            if constraint is not None:
                constraint.commit(tokens)
        out[seq] = (tokens, seq_rows if len(tokens) >= w else seq_rows[: len(tokens)])  # the rows of its tokens
        offset += w
    return out


def step_keyed_samples(
    batch: StepBatch, width: list[int], logits: torch.Tensor, decoder: Decoder
) -> dict[Sequence, list[int]]:
    """The keyed samples (`--deterministic`) of every row of the step that is drawn unmasked (no grammar, no min_tokens
    ban), in one pass (sampling.keyed_sample_rows): the first token of each finished prompt, and the rows of each
    decoding sequence whose decoder takes them drawn (`Decoder.takes_samples`). Per sequence, in row order."""
    wanted: list[KeyedRow] = []
    owners: list[tuple[Sequence, int]] = []
    offset = 0
    for chunk, w in zip(batch.prefills, width):
        seq = chunk.seq
        if chunk.last and unmasked_keyed(seq):
            wanted.append((offset + w - 1, seq.params, seq.generator, len(seq.output)))
            owners.append((seq, 1))
        offset += w
    for seq, w in zip(batch.decodes, width[len(batch.prefills) :]):
        if unmasked_keyed(seq) and decoder.takes_samples(seq):
            wanted += [(offset + i, seq.params, seq.generator, len(seq.output) + i) for i in range(w)]
            owners.append((seq, w))
        offset += w
    drawn = keyed_sample_rows(logits, wanted)
    out, at = {}, 0
    for seq, n in owners:
        out[seq], at = drawn[at : at + n], at + n
    return out


def unmasked_keyed(seq: Sequence) -> bool:
    """A keyed-sampled sequence whose next rows are drawn from the model's own distribution (nothing masked)."""
    return isinstance(seq.generator, KeyedNoise) and seq.matcher is None and not seq.params.bans_stops(len(seq.output))


def ban_stops(seq: Sequence, rows: torch.Tensor, eos_token_id: int | None) -> torch.Tensor:
    """`rows` (row i scores output token len(output) + i) with EOS and the stop token ids at -inf in every row
    that min_tokens still holds open; a copy, so the logprobs reported stay the model's own."""
    params, done = seq.params, len(seq.output)
    banned = [t for t in (*params.stop_token_ids, eos_token_id) if t is not None and 0 <= t < rows.shape[-1]]
    held = sum(1 for i in range(rows.shape[0]) if params.bans_stops(done + i))
    if not banned or not held:
        return rows
    rows = rows.clone()
    rows[:held, banned] = float("-inf")
    return rows
