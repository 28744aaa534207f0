"""/tokenize, /detokenize and /tokenizer_info: the served tokenizer, as vLLM and SGLang expose theirs.

lm-eval's `tokenizer_backend=remote` (and its auto-detection) reads /tokenizer_info's `bos_token`, `eos_token` and
`chat_template`, and encodes through /tokenize with `add_special_tokens: false`. Answers carry both servers' field
names where they differ: /tokenize gives `tokens`, `count` and `max_model_len` (plus `token_strs` on request); for
SGLang's list of prompts each is a list. /detokenize gives vLLM's `prompt` and SGLang's `text`.
"""

from __future__ import annotations

from evalpipe.server.errors import bad_request
from evalpipe.server.protocol import DetokenizeRequest, TokenizeRequest
from evalpipe.server.validation import template_message


def tokenize(state, req: TokenizeRequest) -> dict:
    tok = state.tokenizer
    if req.messages is not None:
        try:
            messages = [template_message(m) for m in req.messages]
        except ValueError as exc:
            raise bad_request(str(exc), param="messages") from None
        kwargs = dict(req.chat_template_kwargs or {})
        if req.tools:
            kwargs["tools"] = [t.model_dump(by_alias=True, exclude_unset=True) for t in req.tools]  # as chat sends them
        try:
            ids = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt, **kwargs)
        except Exception as exc:
            raise bad_request(f"chat template failed: {exc}", param="messages") from None
        if req.add_special_tokens:
            ids = [tok.bos_token_id] + ids
        return _answer(state, ids, req.return_token_strs)
    encode = tok.encode if req.add_special_tokens is False else tok.encode_prompt
    if isinstance(req.prompt, str):
        return _answer(state, encode(req.prompt), req.return_token_strs)
    answers = [_answer(state, encode(p), req.return_token_strs) for p in req.prompt]
    return {key: [a[key] for a in answers] for key in ("tokens", "count", "token_strs")} | {
        "max_model_len": state.max_seq_len
    }


def _answer(state, ids: list[int], strs: bool) -> dict:
    return {
        "tokens": ids,
        "count": len(ids),
        "max_model_len": state.max_seq_len,
        "token_strs": [state.tokenizer.token_text(t) for t in ids] if strs else None,
    }


def detokenize(state, req: DetokenizeRequest) -> dict:
    if not req.skip_special_tokens:
        raise bad_request(
            "skip_special_tokens: false is not supported (special tokens are always skipped)",
            param="skip_special_tokens",
        )
    vocab = state.vocab_size
    batches = req.tokens if req.tokens and isinstance(req.tokens[0], list) else [req.tokens]
    if any(not 0 <= t < vocab for ids in batches for t in ids):
        raise bad_request(f"token ids must be in [0, {vocab})", param="tokens")
    texts = [state.tokenizer.decode(ids) for ids in batches]
    if batches is req.tokens:
        return {"text": texts, "prompt": texts}
    return {"prompt": texts[0], "text": texts[0]}


def tokenizer_info(state) -> dict:
    """vLLM's /tokenizer_info: the tokenizer's configuration (as tokenizer_config.json holds it)."""
    return state.tokenizer.config() | {"model_max_length": state.max_seq_len}
