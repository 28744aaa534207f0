"""Grammar-constrained decoding with xgrammar: what a request may generate, as a token mask on every row it samples.

A `GrammarConstraint` (grammar_constraint.py) names the constraint (a JSON schema, any JSON object, tool calls behind
a marker token, or free text without some tokens); `Grammars` compiles constraints once per tokenizer (cached,
thread-safe, so the server compiles on a worker thread and a bad schema is a 400 before anything is queued) and gives
each sequence a `GrammarMatcher`.

The `GrammarMatcher` is the one place the matcher moves. For the rows of one step (the pending token, then any drafts
of block speculation) `mask` fills row i after tentatively accepting drafts[:i] (row 0 is the committed state) and
stops tentative acceptance at the first draft the grammar refuses: that draft is then rejected by every exact
acceptance rule (its masked probability is 0), so the rows after it are never used. `commit` rolls the tentative
drafts back to those the decoder really accepted (`GrammarMatcher.rollback`) and accepts the bonus token. Masked
rows therefore carry exactly the distribution plain decoding would sample from, which keeps speculation lossless.

JSON is generated in the form `json.dumps` writes (", " and ": " separators, no free whitespace): the form the
default model was trained on, and one a model cannot pad with endless whitespace.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from evalpipe.engine.grammar_constraint import GrammarConstraint
from evalpipe.engine.tokenizer import HFTokenizer, Tokenizer

if TYPE_CHECKING:
    import xgrammar as xgr

JSON_SEPARATORS = (", ", ": ")
CACHE_SIZE = 256  # compiled grammars kept (distinct schemas); a server fed endless new schemas stays bounded
# A string no text can spell (0xFF never occurs in UTF-8), so a grammar can name a special token by id while no
# JSON string or free text can contain it.
_SPECIAL_PREFIX = b"\xff"


class GrammarError(ValueError):
    """A grammar that cannot be compiled (an unsupported or malformed JSON schema); the server answers 400."""


def call_schema(name: str, parameters: dict) -> dict:
    """The JSON of one tool call: the function's name fixed, its arguments matching its parameters schema."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters or {"type": "object"}},
        "required": ["name", "arguments"],
    }


class Grammars:
    """The xgrammar compiler for one tokenizer and model vocabulary; compiled grammars are cached by constraint."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = [tokenizer.eos_token_id]
        self._lock = threading.Lock()
        self._compiler = None
        self._cache: OrderedDict[GrammarConstraint, xgr.CompiledGrammar] = OrderedDict()  # least recently used first

    def _xgr_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                self._compiler = xgr.GrammarCompiler(tokenizer_info(self.tokenizer, self.vocab_size))
            return self._compiler

    def compile(self, grammar: GrammarConstraint) -> xgr.CompiledGrammar:
        """The compiled grammar of `grammar` (cached); raises GrammarError for a schema xgrammar cannot take."""
        with self._lock:
            cached = self._cache.get(grammar)
            if cached is not None:
                self._cache.move_to_end(grammar)
                return cached
        compiler = self._xgr_compiler()
        try:
            compiled = _compile(compiler, grammar)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with the converter's message
            raise GrammarError(_short(exc)) from None
        with self._lock:
            self._cache[grammar] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, grammar: GrammarConstraint, max_rows: int) -> "GrammarMatcher":
        """A fresh matcher for one sequence; `max_rows` rows per step (1 plain, G+1 under block speculation)."""
        return GrammarMatcher(self.compile(grammar), self.vocab_size, max_rows, self.stop_token_ids)


def _compile(compiler: xgr.GrammarCompiler, grammar: GrammarConstraint) -> xgr.CompiledGrammar:
    import xgrammar as xgr

    payload = json.loads(grammar.payload)
    if grammar.kind == "json":
        schema = payload if payload is not None else {"type": "object"}
        return compiler.compile_json_schema(
            json.dumps(schema),
            any_whitespace=False,
            separators=JSON_SEPARATORS,
            strict_mode=False if payload is None else True,
        )
    if grammar.kind == "tool_calls":
        one_of = []
        for name, parameters in payload["calls"]:
            ebnf = str(
                xgr.Grammar.from_json_schema(
                    json.dumps(call_schema(name, parameters)), any_whitespace=False, separators=JSON_SEPARATORS
                )
            )
            one_of.append(
                {
                    "type": "sequence",
                    "elements": [{"type": "token", "token": payload["marker"]}, {"type": "grammar", "grammar": ebnf}],
                }
            )
        call = one_of[0] if len(one_of) == 1 else {"type": "or", "elements": one_of}
        fmt = {"type": "plus", "content": call} if payload["parallel"] else call
        return compiler.compile_structural_tag(json.dumps({"type": "structural_tag", "format": fmt}))
    if grammar.kind == "forbid":
        fmt = {"type": "any_tokens", "exclude_tokens": payload}
        return compiler.compile_structural_tag(json.dumps({"type": "structural_tag", "format": fmt}))
    raise GrammarError(f"unknown grammar kind {grammar.kind!r}")


def _short(exc: Exception) -> str:
    """xgrammar's message without its C++ source location prefix ("[time] /path/file.cc:123: ")."""
    text = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
        if ".cc:" in text.split(": ", 1)[0]:
            text = text.split(": ", 1)[-1]
    return text


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary: the bytes of every id. For the byte tokenizer, bytes are themselves,
    specials a grammar refers to by id (the tool-call marker) get a string no text can spell, and every other
    special or reserved id is empty (xgrammar never allows those, except the stop token)."""
    import xgrammar as xgr

    if isinstance(tokenizer, HFTokenizer):
        return xgr.TokenizerInfo.from_huggingface(
            tokenizer.hf_tokenizer, vocab_size=vocab_size, stop_token_ids=[tokenizer.eos_token_id]
        )
    named = {tokenizer.tool_call_token_id}
    special = set(tokenizer.special_token_ids)
    vocab = []
    for i in range(vocab_size):
        if i in named:
            vocab.append(_SPECIAL_PREFIX + tokenizer.token_text(i).encode())
        elif i in special or i >= tokenizer.vocab_size:
            vocab.append(b"")
        else:
            vocab.append(tokenizer.token_bytes(i))
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[tokenizer.eos_token_id])


class GrammarViolation(RuntimeError):
    """A committed token the grammar refuses: a bug in the masking (exact acceptance never commits one)."""


class GrammarMatcher:
    """One sequence's grammar matcher, stepped with exactly the tokens the engine commits."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int, max_rows: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)  # rollback is unlimited
        self._bitmask = xgr.allocate_token_bitmask(max_rows, vocab_size)
        self._shifts = torch.arange(32, dtype=torch.int32)
        self._tentative: list[int] = []

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def mask(self, logits: torch.Tensor, drafts: list[int] = ()) -> torch.Tensor:
        """A copy of `logits` ([len(drafts) + 1, V]) with the tokens the grammar forbids at each row set to -inf.
        Drafts the grammar accepts are accepted tentatively, up to the first it refuses; `commit` settles them."""
        if self._tentative:
            raise RuntimeError("mask called twice without commit")
        rows = logits.shape[0]
        filled = 0
        for i in range(rows):
            if self.matcher.is_terminated():
                break  # after the stop token nothing more is emitted: the engine ends the sequence there
            self.matcher.fill_next_token_bitmask(self._bitmask, i)
            filled += 1
            if i >= len(drafts) or not self._allowed(i, int(drafts[i])):
                break
            if not self.matcher.accept_token(int(drafts[i])):
                break
            self._tentative.append(int(drafts[i]))
        masked = logits.float().clone()
        if filled:
            bits = (self._bitmask[:filled].unsqueeze(-1) >> self._shifts) & 1
            allowed = bits.bool().view(filled, -1)[:, : masked.shape[-1]].to(masked.device)
            masked[:filled].masked_fill_(~allowed, float("-inf"))
        return masked

    def _allowed(self, row: int, token: int) -> bool:
        if not 0 <= token < self.vocab_size:
            return False
        return bool((int(self._bitmask[row, token // 32]) >> (token % 32)) & 1)

    def commit(self, tokens: list[int]) -> None:
        """Settle the step: keep the tentative drafts the decoder accepted, roll back the rest, accept what follows.
        Tokens after the stop token are ignored (the engine ends the sequence at it)."""
        kept = 0
        while kept < len(self._tentative) and kept < len(tokens) and tokens[kept] == self._tentative[kept]:
            kept += 1
        if kept < len(self._tentative):
            self.matcher.rollback(len(self._tentative) - kept)
        self._tentative = []
        for tok in tokens[kept:]:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(int(tok)):
                raise GrammarViolation(f"token {tok} was committed but the grammar does not allow it")
