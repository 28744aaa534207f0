"""The native server through the real `openai` client and raw HTTP: agreement, usage, sampling knobs, errors.

One `evalpipe serve` subprocess (default tiny model, byte tokenizer) serves every test in this module.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time

import httpx
import openai
import pytest

from evalpipe.engine.tokenizer import ByteTokenizer
from tests.support.server_harness import ServerProcess, torch_loaded

MAX_SEQ_LEN = 256
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-seq-len", str(MAX_SEQ_LEN), "--max-batch", "8", "--max-tokens-per-step", "64")
    yield srv
    rc = srv.stop()
    assert rc == 0, srv.output()
    assert "ready at http://127.0.0.1:" in srv.output() and "speculation off" in srv.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def extra(**kw):
    return {"extra_body": kw}


def stream_chunks(client, **kw):
    return list(
        client.completions.create(stream=True, **kw)
        if "prompt" in kw
        else client.chat.completions.create(stream=True, **kw)
    )


# -- agreement and exact usage ---------------------------------------------------------------------------
def test_models_lists_the_served_model(server, client, model):
    listing = httpx.get(server.base + "/v1/models").json()
    assert listing["object"] == "list" and len(listing["data"]) == 1
    assert listing["data"][0]["object"] == "model" and listing["data"][0]["max_model_len"] == MAX_SEQ_LEN
    info = httpx.get(server.base + "/get_server_info").json()
    assert info["model"] == model == listing["data"][0]["id"]


def test_completion_stream_matches_non_stream_and_usage_is_exact(client, model):
    prompt = "The quick brown fox"
    kw = dict(model=model, prompt=prompt, max_tokens=12, temperature=0, **extra(return_token_ids=True))
    full = client.completions.create(**kw)
    choice = full.choices[0]
    assert choice.prompt_token_ids == TOK.encode_prompt(prompt)
    assert full.usage.prompt_tokens == len(TOK.encode_prompt(prompt))
    assert full.usage.completion_tokens == len(choice.token_ids)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert choice.spec is None and choice.finish_reason in ("stop", "length")

    chunks = stream_chunks(client, **kw, stream_options={"include_usage": True, "continuous_usage_stats": True})
    content = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].text for c in content)
    ids = [t for c in content for t in c.choices[0].token_ids]
    assert text == choice.text and ids == choice.token_ids
    assert content[-1].choices[0].finish_reason == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    # continuous usage: every chunk carries the exact cumulative count of tokens streamed so far
    seen = 0
    for c in content:
        seen += len(c.choices[0].token_ids)
        assert c.usage.completion_tokens == seen and c.usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_stream_matches_non_stream_and_prompt_count_is_template_length(client, model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    kw = dict(model=model, messages=messages, max_tokens=8, temperature=0)
    full = client.chat.completions.create(**kw, **extra(return_token_ids=True))
    expected_prompt = TOK.apply_chat_template(messages)
    assert full.usage.prompt_tokens == len(expected_prompt)
    assert full.choices[0].prompt_token_ids == expected_prompt
    assert full.usage.completion_tokens == len(full.choices[0].token_ids)
    assert full.choices[0].message.role == "assistant"

    chunks = stream_chunks(client, **kw, stream_options={"include_usage": True})
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])

    thinking = client.chat.completions.create(
        **{**kw, "max_tokens": 1},
        **extra(chat_template_kwargs={"thinking": True}, return_token_ids=True),
        reasoning_effort="low",
    )
    assert thinking.choices[0].prompt_token_ids == TOK.apply_chat_template(messages, thinking=True)


def test_token_id_prompt_equals_text_prompt(client, model):
    text = client.completions.create(model=model, prompt="abc", max_tokens=4, temperature=0)
    ids = client.completions.create(model=model, prompt=TOK.encode_prompt("abc"), max_tokens=4, temperature=0)
    assert ids.choices[0].text == text.choices[0].text
    assert ids.usage == text.usage


# -- sampling knobs --------------------------------------------------------------------------------------
def test_seed_reproducible_alone_and_under_load(client, model):
    kw = dict(
        model=model,
        prompt="Once upon a time",
        max_tokens=6,
        temperature=1.0,
        top_p=0.95,
        **extra(return_token_ids=True, ignore_eos=True, top_k=100),
    )

    def run(seed):
        return client.completions.create(seed=seed, **kw).choices[0].token_ids

    first = run(1234)
    assert run(1234) == first
    with cf.ThreadPoolExecutor(6) as pool:  # same seed among concurrent requests of other seeds
        futures = [pool.submit(run, s) for s in (1234, 1, 2, 3, 1234, 4)]
        results = [f.result() for f in futures]
    assert results[0] == first and results[4] == first
    assert len({tuple(r) for r in results}) > 1  # other seeds give other samples


def test_max_tokens_and_ignore_eos(client, model):
    r = client.completions.create(model=model, prompt="x", max_tokens=5, temperature=0, **extra(ignore_eos=True))
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


GREEDY_LEN = 16


@pytest.fixture(scope="module")
def greedy_base(client, model):
    """(prompt, choice) of a greedy 16-token output with visible text; several prompts in one batched request."""
    prompts = ["Hello", "Numbers: 1 2 3", "Question:", "abc", "zzz", "The end"]
    r = client.completions.create(
        model=model,
        prompt=prompts,
        max_tokens=GREEDY_LEN,
        temperature=0,
        **extra(return_token_ids=True, ignore_eos=True),
    )
    assert len(r.choices) == len(prompts)
    for choice in r.choices:
        if len(choice.text) >= 4:
            return prompts[choice.index], choice
    pytest.fail("no greedy output with visible text to pick a stop string from")


def test_stop_strings_cut_before_the_match(client, model, greedy_base):
    prompt, base = greedy_base
    stop = base.text[2:4]
    cut = base.text.index(stop)
    kw = dict(model=model, prompt=prompt, max_tokens=GREEDY_LEN, temperature=0)
    r = client.completions.create(**kw, stop=[stop, "\x00never"], **extra(ignore_eos=True))
    assert r.choices[0].text == base.text[:cut]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].matched_stop == stop
    chunks = stream_chunks(client, **kw, stop=stop, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == base.text[:cut]


def test_stop_token_ids(client, model, greedy_base):
    prompt, base = greedy_base
    stop_id = base.token_ids[3]
    first = base.token_ids.index(stop_id)
    r = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=GREEDY_LEN,
        temperature=0,
        **extra(return_token_ids=True, ignore_eos=True, stop_token_ids=[stop_id]),
    )
    assert r.choices[0].token_ids == base.token_ids[: first + 1]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].matched_stop == stop_id


def test_batched_prompts_give_one_choice_each(client, model):
    alone = client.completions.create(
        model=model, prompt="Hello", max_tokens=4, temperature=0, **extra(return_token_ids=True, ignore_eos=True)
    )
    batch = client.completions.create(
        model=model,
        prompt=["Hi", "Hello"],
        max_tokens=4,
        temperature=0,
        **extra(return_token_ids=True, ignore_eos=True),
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[1].token_ids == alone.choices[0].token_ids
    assert batch.usage.prompt_tokens == len(TOK.encode_prompt("Hi")) + len(TOK.encode_prompt("Hello"))


def test_n_choices(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=5,
        **extra(return_token_ids=True),
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices)
    assert len({tuple(c.token_ids) for c in r.choices}) > 1
    chunks = stream_chunks(
        client,
        model=model,
        prompt="hi",
        n=2,
        max_tokens=5,
        temperature=0,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1} and chunks[-1].usage.completion_tokens == 10


def test_logprobs_shapes(client, model):
    r = client.completions.create(
        model=model, prompt="Hi", max_tokens=5, temperature=0, logprobs=3, **extra(ignore_eos=True)
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the top token

    c = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        **extra(ignore_eos=True),
    )
    content = c.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    chunks = stream_chunks(
        client,
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)


# -- operations ----------------------------------------------------------------------------------------
def test_health_info_flush(server, model):
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}
    assert httpx.get(server.base + "/health_generate", timeout=30).status_code == 200
    info = httpx.get(server.base + "/get_server_info").json()
    assert info["speculative"]["mode"] == "off" and info["speculative"]["simulate_acc_len"] is None
    assert info["config"]["vocab_size"] >= 272 and info["dtype"] == "float32" and info["device"] == "cpu"
    assert info["engine"]["max_batch"] == 8 and info["engine"]["max_seq_len"] == MAX_SEQ_LEN
    assert "serve" in info["launch"]["argv"] and info["version"]
    assert httpx.post(server.base + "/flush_cache").status_code == 200
    model_info = httpx.get(server.base + "/get_model_info").json()
    assert model_info["is_generation"] is True and model_info["served_model_name"] == model
    assert info["internal_states"]["peak_rss_mb"] > 0
    # outside internal_states the info is configuration only: serving a request does not change it
    httpx.post(server.base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
    again = httpx.get(server.base + "/get_server_info").json()
    assert {k: v for k, v in again.items() if k != "internal_states"} == {
        k: v for k, v in info.items() if k != "internal_states"
    }
    assert again["internal_states"]["stats"]["requests"] > info["internal_states"]["stats"]["requests"]


def test_disconnect_mid_stream_frees_slots(server, model):
    def allocated():
        return httpx.get(server.base + "/get_server_info").json()["internal_states"]["allocated_slots"]

    before = httpx.get(server.base + "/get_server_info").json()["internal_states"]
    assert before["allocated_slots"] == 0
    prompt = "stream me"
    max_tokens = MAX_SEQ_LEN - len(TOK.encode_prompt(prompt))
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=60) as resp:
        got = 0
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                got += 1
                if got == 3:
                    break
    deadline = time.monotonic() + 20
    while allocated() != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    after = httpx.get(server.base + "/get_server_info").json()["internal_states"]
    assert after["allocated_slots"] == 0 and after["running"] == 0 and after["waiting"] == 0
    assert after["stats"]["aborted"] == before["stats"]["aborted"] + 1
    assert after["stats"]["generated_tokens"] - before["stats"]["generated_tokens"] < max_tokens
    # the runner's own pools agree: no live sequence, every page back in the free list
    assert after["runner"]["live_sequences"] == 0
    assert after["runner"]["pools"]["free_pages"] == after["runner"]["pools"]["num_pages"]


# -- errors --------------------------------------------------------------------------------------------
def post(server, path, body, **kw):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.base + path, content=data, headers={"content-type": "application/json"}, timeout=60, **kw)


def assert_error(resp, status, param=None, code=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": -5}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": 42}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, 2, 100000]}, "prompt"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "repetition_penalty": 1.3}, "repetition_penalty"),
        ({"prompt": "x", "logprobs": 50}, "logprobs"),
        ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"prompt": "x", "seed": 2**64}, "seed"),  # would wrap onto seed 0
        ({"prompt": "x", "seed": 2**70}, "seed"),
        ({"prompt": "x", "seed": -(2**63) - 1}, "seed"),
        ({"prompt": "x", "stop": ""}, "stop"),  # an empty stop string matches everywhere
        ({"prompt": "x", "stop": ["Q", ""]}, "stop"),
    ],
)
def test_bad_completion_params_are_400(server, model, body, param):
    assert_error(post(server, "/v1/completions", {"model": model, **body}), 400, param=param)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": []}, "messages"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "max_completion_tokens": 6},
            "max_completion_tokens",
        ),
    ],
)
def test_bad_chat_params_are_400(server, model, body, param):
    assert_error(post(server, "/v1/chat/completions", {"model": model, **body}), 400, param=param)


def test_neutral_penalties_are_accepted_and_change_nothing(client, model):
    plain = client.completions.create(model=model, prompt="Question: 3 + 4\nAnswer:", max_tokens=8, temperature=0)
    r = client.completions.create(
        model=model,
        prompt="Question: 3 + 4\nAnswer:",
        max_tokens=8,
        temperature=0,
        frequency_penalty=0,
        presence_penalty=0,
        **extra(repetition_penalty=1.0, return_token_ids=True),
    )
    assert r.usage.completion_tokens == plain.usage.completion_tokens >= 1
    assert r.choices[0].text == plain.choices[0].text


def test_the_edges_of_the_seed_range_and_one_output_limit_twice_are_accepted(server, model):
    for seed in (2**63 - 1, -(2**63), -1):
        body = {"model": model, "prompt": "x", "max_tokens": 3, "temperature": 1, "seed": seed}
        assert post(server, "/v1/completions", body).status_code == 200
    same = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    reply = post(server, "/v1/chat/completions", {**same, "max_completion_tokens": 3})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 3


def test_unknown_model_404(server, client):
    assert_error(
        post(server, "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404, param="model", code="model_not_found"
    )
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])


def test_over_long_prompt_is_context_length_exceeded(server, client, model):
    err = assert_error(
        post(server, "/v1/completions", {"model": model, "prompt": "a" * (MAX_SEQ_LEN + 10)}),
        400,
        code="context_length_exceeded",
    )
    assert str(MAX_SEQ_LEN) in err["message"]
    assert_error(
        post(server, "/v1/completions", {"model": model, "prompt": [5] * MAX_SEQ_LEN}),
        400,
        code="context_length_exceeded",
    )
    # a prompt that fits gets what the context leaves: max_tokens is capped, the finish reason says "length"
    capped = post(
        server,
        "/v1/completions",
        {"model": model, "prompt": [5] * (MAX_SEQ_LEN - 3), "max_tokens": 100, "temperature": 0, "ignore_eos": True},
    ).json()
    assert capped["usage"]["completion_tokens"] == 3 and capped["choices"][0]["finish_reason"] == "length"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "b" * 400}])
    assert exc.value.code == "context_length_exceeded"


def test_invalid_json_and_unknown_route(server):
    assert_error(post(server, "/v1/chat/completions", '{"messages": [}'), 400)
    assert_error(post(server, "/v1/completions", b"\xff\xfe not json"), 400)
    assert_error(httpx.get(server.base + "/v1/nope"), 404)


# -- prefix cache ------------------------------------------------------------------------------------------
def test_prefix_cache_reports_cached_tokens_and_flush_drops_them(server, client, model):
    """A prompt sharing two 64-token pages with an earlier one reports 128 cached tokens (non-stream and in the
    stream's usage chunk) and decodes what it decodes after a flush, where it reports 0."""
    info = httpx.get(server.base + "/get_server_info").json()
    assert info["prefix_cache"] == {"enabled": True, "page_tokens": 64}
    assert info["server_args"]["prefix_cache"] == "on"
    shared = "".join(chr(ord("a") + i % 26) for i in range(140))
    assert httpx.post(server.base + "/flush_cache").json()["flushed"] is True
    kw = dict(model=model, max_tokens=6, temperature=0.0, extra_body=extra(ignore_eos=True))
    first = client.completions.create(prompt=shared + " one", **kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    hit = client.completions.create(prompt=shared + " two", **kw)
    assert hit.usage.prompt_tokens_details.cached_tokens == 128
    chunks = list(
        client.completions.create(prompt=shared + " two", stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 128
    assert "".join(c.choices[0].text for c in chunks if c.choices) == hit.choices[0].text
    flushed = httpx.post(server.base + "/flush_cache").json()
    assert flushed["flushed"] is True and flushed["flushed_pages"] >= 2
    cold = client.completions.create(prompt=shared + " two", **kw)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0 and cold.choices[0].text == hit.choices[0].text
    internal = httpx.get(server.base + "/get_server_info").json()["internal_states"]
    assert internal["prefix_cache"]["flushes"] >= 2 and internal["stats"]["cached_tokens"] >= 256


def test_repeat_prefix_conditions_see_the_cache(server, model, tmp_path):
    """`evalpipe repeat`: prefix_fresh (flush before each request) reports cached_tokens 0, prefix_reused (after a
    priming request) > 0, with the same greedy completion."""
    from click.testing import CliRunner

    from evalpipe.commands.repeat import command as repeat_cmd

    res = CliRunner().invoke(
        repeat_cmd,
        [
            "--base-url",
            server.base + "/v1",
            "--repeats",
            "2",
            "--fixtures",
            "regex_date",
            "--conditions",
            "prefix_fresh,prefix_reused",
            "--out",
            str(tmp_path),
        ],
    )
    assert res.exit_code == 0, res.output
    run_dir = next((tmp_path / "repeat").iterdir())
    result = json.loads((run_dir / "repeat.json").read_text())
    assert result["server"]["reports_cached_tokens"] is True and not result["config"]["conditions_skipped"]
    recs = [json.loads(line) for line in (run_dir / "responses.jsonl").read_text().splitlines()]
    cached = {
        c: [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in recs if r["condition"] == c]
        for c in ("prefix_fresh", "prefix_reused")
    }
    assert cached["prefix_fresh"] == [0, 0] and all(n > 0 for n in cached["prefix_reused"]), cached
    assert len({tuple(r["output_token_ids"]) for r in recs if r["condition"].startswith("prefix_")}) == 1


def test_the_http_process_never_imports_torch(server):
    """After every request above, the HTTP process of `evalpipe serve` has not loaded torch (it would cost each start
    seconds); the same check sees torch in the engine process of that server."""
    assert torch_loaded(server.engine_pid())
    assert not torch_loaded(server.proc.pid), "the HTTP process imported torch (find where: python -X importtime)"
