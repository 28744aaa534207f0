"""A failed step and a lost device (engine/device_loss.py), through real `evalpipe serve` processes with the planted
`device-assert` fault (engine/faults.py: a step with a request seeded 4004 reads past a device tensor's end).

On the CPU that is an ordinary IndexError: the request gets a 500, and the engine keeps serving. On CUDA it is a
device-side assert, which breaks the process's CUDA context for good: the engine process exits, the request and
every later one get a 503 `engine_dead`, and `serve` exits 1 (not a server that fails every request while
/health says ok)."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from evalpipe.engine.faults import DEVICE_ASSERT_SEED
from tests.support.server_harness import ServerProcess


def completion(client: openai.OpenAI, seed: int | None = None):
    return client.completions.create(
        model="evalpipe-tiny-dsv4", prompt="two plus two", max_tokens=4, temperature=0, seed=seed
    )


def test_a_failed_step_on_the_cpu_fails_its_request_and_the_engine_keeps_serving():
    server = ServerProcess("--max-batch", "2", "--max-seq-len", "256", "--debug-fault", "device-assert")
    try:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=60)
        info = httpx.get(server.base + "/get_server_info", timeout=30).json()
        assert info["debug_faults"] == ["device-assert"]
        assert len(completion(client, seed=DEVICE_ASSERT_SEED - 1).choices[0].text) > 0  # another seed: untouched
        with pytest.raises(openai.InternalServerError) as failed:
            completion(client, seed=DEVICE_ASSERT_SEED)
        assert failed.value.status_code == 500 and "IndexError" in failed.value.message
        assert len(completion(client).choices[0].text) > 0  # the CPU is not lost: serving goes on
        assert httpx.get(server.base + "/health", timeout=30).status_code == 200
        assert server.proc.poll() is None
    finally:
        server.stop()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a sticky device error needs a CUDA device")
def test_a_lost_cuda_device_ends_the_engine_and_serve_exits_1():
    server = ServerProcess(
        "--device", "cuda", "--max-batch", "2", "--max-seq-len", "256", "--debug-fault", "device-assert"
    )
    try:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=60)
        assert len(completion(client).choices[0].text) > 0
        with pytest.raises(openai.APIStatusError) as failed:
            completion(client, seed=DEVICE_ASSERT_SEED)
        assert failed.value.status_code == 503 and failed.value.body["code"] == "engine_dead"
        assert "device is lost" in failed.value.message and "device-side assert" in failed.value.message
        try:
            completion(client)
            raise AssertionError("a request was served after the device was lost")
        except openai.APIStatusError as exc:  # the engine has told the server, which has not exited yet
            assert exc.status_code == 503 and exc.body["code"] == "engine_dead"
            assert "device is lost" in exc.message
        except openai.APIConnectionError:  # the server has exited already
            pass
        assert server.proc.wait(60) == 1
        out = server.output()
        assert "the engine's device is lost" in out and "device-side assert" in out, out[-3000:]
        assert "the engine process died (its device is lost" in out, out[-3000:]
    finally:
        server.stop()
