"""Scoring and the output-changing extension fields, through a real `evalpipe serve` of the default model and the
real `openai` client: echo + logprobs (the loglikelihood contract of lm-eval and other OpenAI-API harnesses),
vLLM's prompt_logprobs, min_tokens, include_stop_str_in_output, truncate_prompt_tokens, the tokenizer routes, and
every extension field that is not implemented refused by name.

Prompt logprobs are checked against the engine's model run in this process (one forward over the whole prompt),
while the server prefills in chunks of 32 rows, so chunk boundaries are crossed."""

from __future__ import annotations

import random

import httpx
import openai
import pytest
import torch

from evalpipe.engine.runner import ModelRunner
from evalpipe.engine.tokenizer import ByteTokenizer
from evalpipe.lanes import get_lane
from evalpipe.server.protocol import UNHONOURED_FIELDS
from tests.support.server_harness import ServerProcess

MODEL = "evalpipe-skills-dsv4"
TOK = ByteTokenizer()
ATOL = 2e-4  # float32 on the CPU: the server's chunked prefill against one whole-prompt forward


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-tokens-per-step", "32", "--max-seq-len", "1024", model=MODEL)
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference():
    """Each prompt token's logprob under the model, from one forward in this process: ids -> [len(ids) - 1] rows
    of log-softmax (row j scores ids[j + 1])."""
    runner = ModelRunner(MODEL, max_seqs=1, max_seq_len=1024)

    def logprobs(ids: list[int]) -> torch.Tensor:
        slot = runner.allocate()
        try:
            logits = runner.forward([slot], [ids], all_logits=True)
        finally:
            runner.free(slot)
        return torch.log_softmax(logits.float(), dim=-1)[:-1]

    return logprobs


@pytest.fixture(scope="module")
def arith_prompts():
    return [it.prompt for it in get_lane("arith").items()[:3]]


def test_echo_scores_every_prompt_token_as_the_model_does(client, reference, arith_prompts):
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    text = arith_prompts[0] + " On"
    token_prompts = [TOK.encode(arith_prompts[1])[: rng.randint(40, 120)], [rng.randrange(16, 272) for _ in range(3)]]
    r = client.completions.create(
        model=MODEL, prompt=text, max_tokens=1, logprobs=1, temperature=0, extra_body={"echo": True}
    )
    batch = client.completions.create(
        model=MODEL, prompt=token_prompts, max_tokens=1, logprobs=2, temperature=0, extra_body={"echo": True}
    )  # lm-eval's shape: a list of token-id lists
    cases = [(TOK.encode_prompt(text), r.choices[0], text)] + [
        (ids, batch.choices[i], TOK.decode(ids)) for i, ids in enumerate(token_prompts)
    ]
    for ids, choice, prompt_text in cases:
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + 1, seed  # the prompt, verbatim (token ids get no BOS), then one token
        assert lp.tokens[: len(ids)] == [TOK.token_text(t) for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing scores the first token
        assert choice.text.startswith(prompt_text) and lp.text_offset[0] == 0
        want = reference(ids)
        got = torch.tensor(lp.token_logprobs[1 : len(ids)], dtype=torch.float64)
        expected = want.gather(-1, torch.tensor(ids[1:]).view(-1, 1)).view(-1).double()
        assert torch.allclose(got, expected, atol=ATOL), (seed, (got - expected).abs().max())
        for j, top in enumerate(lp.top_logprobs[1 : len(ids)]):  # the top entry is the model's best next token
            assert abs(max(top.values()) - want[j].max().item()) < ATOL, seed
        generated = lp.token_logprobs[len(ids)]
        assert generated is not None and generated <= max(lp.top_logprobs[len(ids)].values()) + ATOL
    strings = client.completions.create(
        model=MODEL, prompt=[text, "Hi"], max_tokens=1, logprobs=1, temperature=0, extra_body={"echo": True}
    )  # a batch of strings: each scored as alone
    assert [c.text[: len(p)] for c, p in zip(strings.choices, [text, "Hi"])] == [text, "Hi"]
    alone = r.choices[0].logprobs.token_logprobs
    assert strings.choices[0].logprobs.tokens == r.choices[0].logprobs.tokens
    assert torch.allclose(
        torch.tensor(strings.choices[0].logprobs.token_logprobs[1:]), torch.tensor(alone[1:]), atol=ATOL
    )
    again = client.completions.create(
        model=MODEL, prompt=token_prompts, max_tokens=1, logprobs=2, temperature=0, extra_body={"echo": True}
    )  # its pages are cached now: scored all the same
    assert [c.logprobs.token_logprobs for c in again.choices] == [c.logprobs.token_logprobs for c in batch.choices]


def test_prompt_logprobs_in_vllms_shape_and_max_tokens_zero(server, reference, arith_prompts):
    ids = TOK.encode_prompt(arith_prompts[2])[:70]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0, "prompt_logprobs": 3}
    out = httpx.post(server.base + "/v1/completions", json=body, timeout=120).json()
    choice = out["choices"][0]
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == len(ids)
    assert choice["text"] == TOK.decode(ids) and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids)  # max_tokens 0: the prompt only
    assert all(top == {} for top in choice["logprobs"]["top_logprobs"][1:])  # logprobs 0: no alternatives
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    want = reference(ids)
    for j, entry in enumerate(scored[1:]):
        token = ids[j + 1]
        mine = entry[str(token)]
        assert abs(mine["logprob"] - want[j, token].item()) < ATOL
        assert mine["rank"] == int((want[j] > want[j, token]).sum()) + 1
        assert mine["decoded_token"] == TOK.token_text(token)
        ranked = sorted((v["rank"], k) for k, v in entry.items() if k != str(token) or v["rank"] <= 3)
        assert [rank for rank, _ in ranked][:3] == [1, 2, 3]
        assert int(ranked[0][1]) == int(want[j].argmax())
    plain = httpx.post(
        server.base + "/v1/completions",
        timeout=120,
        json={"model": MODEL, "prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 0},
    ).json()["choices"][0]
    assert plain["logprobs"] is None and len(plain["text"]) <= 2 * 4  # no echo: the completion alone
    assert [list(e) if e else None for e in plain["prompt_logprobs"]] == [None] + [
        [str(t)] for t in ids[1:]
    ]  # k = 0: the prompt token alone


def test_streamed_echo_and_chat_scoring_fields_are_refused(client):
    for kwargs, param in (
        ({"prompt": "x", "stream": True, "extra_body": {"echo": True}}, "echo"),
        ({"prompt": "x", "stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, **{"max_tokens": 2, **kwargs})
        assert err.value.body["param"] == param
    for field in ("echo", "prompt_logprobs", "add_special_tokens"):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
                extra_body={field: 1 if field == "prompt_logprobs" else True},
            )
        assert err.value.body["param"] == field


@pytest.fixture(scope="module")
def greedy(client, arith_prompts):
    """The default model's greedy worked answer to an arith prompt (ends at its EOS), with its token ids."""
    r = client.completions.create(
        model=MODEL, prompt=arith_prompts[0], max_tokens=400, temperature=0, extra_body={"return_token_ids": True}
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.matched_stop == TOK.eos_token_id, choice
    assert choice.text.count("has") >= 2
    return arith_prompts[0], choice


def test_min_tokens_holds_eos_and_stop_tokens_back(client, greedy):
    prompt, base = greedy
    answer_len = len(base.token_ids)  # the answer's tokens, EOS last
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=answer_len + 10,  # the minimum itself: an EOS let through would end it shorter
        temperature=0,
        extra_body={"min_tokens": answer_len + 10, "return_token_ids": True},
    )
    ids = r.choices[0].token_ids
    assert len(ids) >= answer_len + 10, len(ids)
    assert TOK.eos_token_id not in ids[: answer_len + 10]  # the EOS the model wanted was masked out
    assert ids[: answer_len - 1] == base.token_ids[: answer_len - 1]  # greedy until then
    first = base.token_ids[0]  # a stop token the model produces at once
    plain = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": [first], "return_token_ids": True},
    )
    assert plain.choices[0].token_ids == [first] and plain.choices[0].finish_reason == "stop"
    # both names on this short request: the protocol folds min_new_tokens (SGLang's name) into the one minimum
    # that masks EOS and stop tokens alike (protocol.py, min_output_tokens), so the long EOS request above runs
    # once, as min_tokens
    for field in ("min_tokens", "min_new_tokens"):
        held = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            extra_body={"stop_token_ids": [first], field: 5, "return_token_ids": True},
        )
        assert first not in held.choices[0].token_ids[:5] and len(held.choices[0].token_ids) >= 5, field


def test_min_tokens_delays_stop_strings_and_include_stop_str_keeps_them(client, greedy):
    prompt, base = greedy
    text = base.text
    name = text.split(" has ")[0].split()[-1]  # the story's name: on every worked line
    kw = dict(model=MODEL, prompt=prompt, max_tokens=400, temperature=0, stop=[name])
    assert client.completions.create(**kw).choices[0].text == text[: text.index(name)]
    r = client.completions.create(**kw, extra_body={"min_tokens": 30})
    assert r.choices[0].text == text[: text.index(name, 30)]  # only text after the first 30 tokens (bytes) matches
    for field in ("include_stop_str_in_output", "no_stop_trim"):
        kept = client.completions.create(**kw, extra_body={field: True})
        assert kept.choices[0].text == text[: text.index(name) + len(name)], field
        assert kept.choices[0].finish_reason == "stop"
        streamed = client.completions.create(**kw, stream=True, extra_body={field: True})
        assert "".join(c.choices[0].text for c in streamed if c.choices) == kept.choices[0].text


def test_min_tokens_refusals(client):
    cases = [({"min_tokens": 5}, 3, "min_tokens"), ({"min_tokens": 2, "min_new_tokens": 3}, 8, "min_new_tokens")]
    for extra, max_tokens, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="x", max_tokens=max_tokens, extra_body=extra)
        assert err.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            response_format={"type": "json_object"},
            extra_body={"min_tokens": 2},
        )
    assert err.value.body["param"] == "min_tokens"


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, arith_prompts):
    ids = TOK.encode_prompt(arith_prompts[1])
    keep = 50
    cut = client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=6,
        temperature=0,
        extra_body={"truncate_prompt_tokens": keep, "return_token_ids": True},
    )
    direct = client.completions.create(
        model=MODEL, prompt=ids[-keep:], max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
    )
    assert cut.usage.prompt_tokens == keep and cut.choices[0].token_ids == direct.choices[0].token_ids
    whole = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(ids)  # -1: as much as fits, here all of it
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x" * 80}],
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": keep},
    )
    assert chat.usage.prompt_tokens == keep
    for bad in (0, 5000):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt=ids, max_tokens=1, extra_body={"truncate_prompt_tokens": bad})
        assert err.value.body["param"] == "truncate_prompt_tokens"


NON_NEUTRAL = {
    "use_beam_search": True,
    "length_penalty": 0.5,
    "early_stopping": True,
    "allowed_token_ids": [5],
    "bad_words": ["x"],
    "logprob_token_ids": [5],
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "truncation_side": "right",
    "return_tokens_as_token_ids": True,
    "prompt_embeds": "AAAA",
    "stop_regex": ["a+"],
    "logits_processors": ["x"],
    "custom_logit_processor": "x",
    "continue_final_message": True,
    "chat_template": "{{ 1 }}",
    "return_hidden_states": True,
    "lora_path": "adapter",
    "documents": [{"text": "x"}],
    "vllm_xargs": {"k": 1},
}


def test_every_unimplemented_field_is_refused_by_name_and_neutral_values_pass(client):
    assert set(NON_NEUTRAL) == set(UNHONOURED_FIELDS)  # a field added there gets a case here
    for field, value in NON_NEUTRAL.items():
        for call in (
            lambda body: client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body=body),
            lambda body: client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1, extra_body=body
            ),
        ):
            with pytest.raises(openai.BadRequestError) as err:
                call({field: value})
            assert err.value.body["param"] == field and field in err.value.body["message"]
    neutral = {field: neutral[0] for field, (neutral, _) in UNHONOURED_FIELDS.items()}
    ok = client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body=neutral)
    assert ok.usage.completion_tokens == 1


def test_tokenize_detokenize_and_tokenizer_info(server, client):
    rng = random.Random()
    texts = ["".join(rng.choice("ab é日🙂<|end|>\n") for _ in range(rng.randint(0, 30))) for _ in range(5)]
    for text in texts:
        out = httpx.post(server.base + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()
        assert out["tokens"] == TOK.encode_prompt(text) and out["count"] == len(out["tokens"])
        assert out["max_model_len"] == 1024 and out["token_strs"] == [TOK.token_text(t) for t in out["tokens"]]
        raw = httpx.post(server.base + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
        assert raw["tokens"] == TOK.encode(text)  # what lm-eval's remote tokenizer asks for
        back = httpx.post(server.base + "/detokenize", json={"tokens": out["tokens"]}).json()
        assert back["prompt"] == back["text"] == TOK.decode(out["tokens"])
    many = httpx.post(server.base + "/tokenize", json={"prompt": texts[:2]}).json()  # SGLang's list of prompts
    assert many["tokens"] == [TOK.encode_prompt(t) for t in texts[:2]]
    messages = [{"role": "user", "content": "What is 2+2?"}]
    chat = httpx.post(server.base + "/tokenize", json={"messages": messages}).json()
    served = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert chat["tokens"] == TOK.apply_chat_template(messages) and served.usage.prompt_tokens == chat["count"]
    tools = [{"type": "function", "function": {"name": "count", "parameters": {"type": "object"}}}]
    turns = messages + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "count", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "4", "tool_call_id": "c1"},
    ]
    with_tools = httpx.post(server.base + "/tokenize", json={"messages": turns, "tools": tools}).json()
    served = client.chat.completions.create(model=MODEL, messages=turns, tools=tools, max_tokens=1)
    assert with_tools["count"] == served.usage.prompt_tokens  # the same template input as a chat request
    info = httpx.get(server.base + "/tokenizer_info").json()
    assert (info["bos_token"], info["eos_token"]) == ("<|bos|>", "<|eos|>") and "<|assistant|>" in info["chat_template"]
    for path, body in (
        ("/tokenize", {"prompt": "x", "messages": messages}),
        ("/tokenize", {}),
        ("/detokenize", {"tokens": [10**6]}),
        ("/detokenize", {"tokens": "x"}),
        ("/tokenize", {"prompt": "x", "model": "other"}),
    ):
        resp = httpx.post(server.base + path, json=body)
        assert resp.status_code in (400, 404) and set(resp.json()) == {"error"}, (path, body, resp.text)
