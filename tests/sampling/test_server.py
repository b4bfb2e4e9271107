"""`rljax serve` in a subprocess on a loopback port, driven through RemoteSampler and raw HTTP:
equality with the in-process sampler, weight updates, 4xx messages, batching, 503, a killed server."""

import concurrent.futures
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from flax import nnx

from rljax.sampling import (InProcessSampler, RemoteSampler, Sampler, SamplerError, SamplerRequestError,
                            SamplerUnavailableError, SamplingParams)
from rljax.sampling import server as server_lib

HTTP_TIMEOUT = 60.0
STARTUP_TIMEOUT = 120.0
PROMPTS = [[3, 4, 5, 40], [20, 21]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m rljax.cli serve --model tiny ...` on a free loopback port."""

    def __init__(self, *flags, cache_dir=None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        if cache_dir:  # the second server loads the first one's compiled programs instead of compiling
            env.update(JAX_COMPILATION_CACHE_DIR=str(cache_dir), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                       JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rljax.cli", "serve", "--model", "tiny", "--port", str(self.port),
             "--max-batch", "8", *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait_ready(self):
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server on port {self.port} not ready after {STARTUP_TIMEOUT}s")

    def health(self):
        return httpx.get(self.url + "/health", timeout=HTTP_TIMEOUT).json()

    def post(self, path, **kwargs):
        return httpx.post(self.url + path, timeout=HTTP_TIMEOUT, **kwargs)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(main server, a one-slot-queue server for the 503 and kill tests), sharing a compilation cache."""
    cache = tmp_path_factory.mktemp("jax_cache")
    started = []
    try:
        started.append(Server(cache_dir=cache).wait_ready())
        started.append(Server("--max-queue", "1", cache_dir=cache).wait_ready())
        yield tuple(started)
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def tiny():
    """The same model and tokenizer as `--model tiny`, and an in-process sampler with the server's settings."""
    model, tokenizer = server_lib.build_tiny(seed=0)
    return model, tokenizer, InProcessSampler(model, max_batch=8)


@pytest.fixture
def client(server):
    with RemoteSampler(server.url, timeout=HTTP_TIMEOUT, retries=1, backoff=0.1) as c:
        yield c


def _params(tokenizer, **kw):
    return SamplingParams(**{**dict(max_new_tokens=10, temperature=0.9, n=2, seed=5,
                                    stop_token_ids=(tokenizer.eos_token_id,)), **kw})


def _same(remote, local):
    assert [c.prompt_ids for c in remote] == [c.prompt_ids for c in local]
    assert [c.completion_ids for c in remote] == [c.completion_ids for c in local]
    assert [c.finish_reason for c in remote] == [c.finish_reason for c in local]
    for r, x in zip(remote, local):
        np.testing.assert_allclose(r.logprobs, x.logprobs, atol=1e-6)


def test_completions_equal_in_process_sampler(server, client, tiny):
    model, tokenizer, local = tiny
    # Every call has 4 rows: one compiled batch shape on each side.
    for params in (_params(tokenizer), _params(tokenizer, temperature=0.0, max_new_tokens=16),
                   _params(tokenizer, top_k=5, top_p=0.8, seed=9)):
        remote = client.generate(PROMPTS, params)
        assert len(remote) == len(PROMPTS) * params.n and all(c.version == 0 for c in remote)
        _same(remote, local.generate(PROMPTS, params))
    # A different seed gives different samples (the comparison above can fail).
    assert [c.completion_ids for c in client.generate(PROMPTS, _params(tokenizer, seed=6))] != \
        [c.completion_ids for c in local.generate(PROMPTS, _params(tokenizer))]


def test_text_prompt_and_vllm_shaped_logprobs(server, tiny):
    model, tokenizer, local = tiny
    texts = ["abc=", "hello world"]
    r = server.post("/v1/completions", json={"prompt": texts, "max_tokens": 10, "seed": 5, "n": 2,
                                             "temperature": 0.9, "logprobs": 2, "model": "tiny"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["weights_version"] == 0
    expected = local.generate([tokenizer.encode(t) for t in texts], _params(tokenizer))
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for choice, c in zip(body["choices"], expected):
        assert choice["prompt_token_ids"] == c.prompt_ids == tokenizer.encode(texts[choice["index"] // 2])
        assert choice["token_ids"] == c.completion_ids
        lp = choice["logprobs"]
        np.testing.assert_allclose(lp["token_logprobs"], c.logprobs, atol=1e-6)
        assert len(lp["tokens"]) == len(lp["top_logprobs"]) == len(c.completion_ids)
        assert all(2 <= len(top) <= 3 for top in lp["top_logprobs"])  # 2 alternatives + the sampled token
        # The EOS stop token is in token_ids (and log-probs) but not in the text.
        kept = c.completion_ids[:-1] if choice["finish_reason"] == "stop" else c.completion_ids
        assert choice["text"] == tokenizer.decode(kept)
    assert body["usage"]["completion_tokens"] == sum(len(c.completion_ids) for c in expected)


def test_stop_strings_cut_the_text(server):
    r = server.post("/v1/completions", json={"prompt": "abc=", "max_tokens": 16, "seed": 1, "ignore_eos": True})
    ids, text = r.json()["choices"][0]["token_ids"], r.json()["choices"][0]["text"]
    stop = text[5:7]  # a two-character stop string: matched on the text, after the row ended
    cut = server.post("/v1/completions", json={"prompt": "abc=", "max_tokens": 16, "seed": 1, "ignore_eos": True,
                                               "stop": ["@@", stop]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert cut["text"] == text[:text.index(stop)]
    assert cut["token_ids"] == ids[:len(cut["token_ids"])] and len(cut["token_ids"]) < len(ids)


@pytest.mark.parametrize("body,status,message", [
    (b'{"prompt": [1, 2', 400, "invalid JSON body"),
    ({"prompt": "abc", "max_tokens": -3}, 400, "max_tokens: Input should be greater than or equal to 1"),
    ({"prompt": "abc", "best_of_all": 2}, 400, "best_of_all: Extra inputs are not permitted"),
    ({"prompt": [3] * 250, "max_tokens": 10}, 400, "exceeds the model's context of 256 tokens"),
    ({"prompt": "ABC"}, 400, r"characters \['A', 'B', 'C'\] are not in the vocabulary"),
    ({"prompt": [[1, 2], []]}, 400, "prompt 1 is empty"),
    ({"prompt": "abc", "top_p": 0}, 400, "top_p: Input should be greater than 0"),
    ({"prompt": "abc", "model": "gpt-4"}, 404, "model 'gpt-4' does not exist"),
])
def test_malformed_requests_get_4xx_with_a_message(server, body, status, message):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else \
        {"json": body}
    r = server.post("/v1/completions", **kwargs)
    assert r.status_code == status
    assert re.search(message, r.json()["error"]["message"]), r.text


def test_client_raises_the_servers_message(client):
    with pytest.raises(SamplerRequestError, match="HTTP 400: .*exceeds the model's context"):
        client.generate([[3] * 250], SamplingParams(max_new_tokens=10))
    with pytest.raises(SamplerRequestError, match="no checkpoint directory"):
        client.request("POST", "/update_weights", {"path": "/nonexistent/ckpt", "step": 1})


def test_concurrent_requests_are_batched(server, client, tiny):
    _, tokenizer, local = tiny
    before = server.health()
    seeds = range(20, 26)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(client.generate, PROMPTS, _params(tokenizer, seed=s)) for s in seeds]
        results = [f.result(timeout=HTTP_TIMEOUT) for f in futures]
    after = server.health()
    assert after["requests"] - before["requests"] == 6
    assert after["batches"] - before["batches"] < 6
    # Each request's rows keep their own seed whatever they were batched with.
    for s, remote in zip(seeds, results):
        _same(remote, local.generate(PROMPTS, _params(tokenizer, seed=s)))


def test_update_weights_changes_outputs_and_version(server, tiny, tmp_path):
    model, tokenizer, local = tiny
    params = _params(tokenizer)
    with RemoteSampler(server.url, sync_dir=tmp_path / "sync", timeout=HTTP_TIMEOUT, retries=1) as client:
        before = client.generate(PROMPTS, params)
        new_model, _ = server_lib.build_tiny(seed=1)
        client.update_weights(nnx.state(new_model, nnx.Param), version=7)
        assert client.version == 7 and server.health()["version"] == 7
        after = client.generate(PROMPTS, params)
        assert all(c.version == 7 for c in after)
        assert [c.completion_ids for c in after] != [c.completion_ids for c in before]
        fresh = InProcessSampler(new_model, max_batch=8)
        _same(after, fresh.generate(PROMPTS, params))
        # Without a version the server bumps its own; a wrong-shaped checkpoint is refused.
        client.update_weights(nnx.state(model, nnx.Param), version=8)
        r = server.post("/update_weights", json={"path": str(tmp_path / "sync"), "step": 8})
        assert r.json()["version"] == 9
        _same(client.generate(PROMPTS, params), before)


def test_full_queue_answers_503(servers, tiny):
    _, small = servers
    _, tokenizer, _ = tiny
    body = {"prompt": [[3, 4, 5]] * 4, "max_tokens": 200, "ignore_eos": True, "seed": 0}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        first = pool.submit(small.post, "/v1/completions", json=body)
        _wait_for(lambda: small.health()["running_rows"] > 0)
        queued = pool.submit(small.post, "/v1/completions", json=body)
        _wait_for(lambda: small.health()["queued"] == 1)
        r = small.post("/v1/completions", json=body)
        assert r.status_code == 503 and "server busy" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "1"
        with RemoteSampler(small.url, retries=1, backoff=0.05, timeout=HTTP_TIMEOUT) as c:
            with pytest.raises(SamplerUnavailableError, match=r"after 2 attempts; last error: HTTP 503: server busy"):
                c.generate([[3, 4, 5]], SamplingParams(max_new_tokens=4))
        assert first.result(timeout=HTTP_TIMEOUT).status_code == 200
        assert queued.result(timeout=HTTP_TIMEOUT).status_code == 200


def test_killed_server_makes_the_client_retry_then_fail(servers):
    _, small = servers
    with RemoteSampler(small.url, retries=2, backoff=0.2, timeout=HTTP_TIMEOUT) as c:
        c._model()  # resolve the model name while the server is up
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            start = time.monotonic()
            future = pool.submit(c.generate, [[3, 4, 5]] * 8, SamplingParams(max_new_tokens=250))
            _wait_for(lambda: small.health()["running_rows"] > 0)
            small.proc.send_signal(signal.SIGKILL)
            with pytest.raises(SamplerUnavailableError,
                               match=r"could not get an answer from the sampler at .* after 3 attempts; "
                                     r"last error: ConnectError"):
                future.result(timeout=30)
            assert time.monotonic() - start < 30


def test_unreachable_server_fails_clearly():
    url = f"http://127.0.0.1:{_free_port()}"
    with RemoteSampler(url, retries=1, backoff=0.01, timeout=5) as c:
        assert isinstance(c, Sampler)
        with pytest.raises(SamplerUnavailableError, match=rf"sampler at {url}/v1/models after 2 attempts.*Connect"):
            c.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="needs sync_dir"):
        RemoteSampler(url).update_weights({}, 1)


def test_garbage_replies_raise_sampler_error():
    c = RemoteSampler("http://127.0.0.1:1", model="m")
    params = SamplingParams(max_new_tokens=2)
    good = {"index": 0, "token_ids": [5, 6], "finish_reason": "length", "logprobs": {"token_logprobs": [-1.0, -2.0]}}
    assert c._parse({"choices": [good], "weights_version": 3}, [[1]], params)[0].version == 3
    # vLLM without return_token_ids: ids from "token_id:N" tokens.
    vllm = {"index": 0, "finish_reason": "stop", "logprobs": {"token_logprobs": [-1.0], "tokens": ["token_id:9"]}}
    assert c._parse({"choices": [vllm]}, [[1]], params)[0].completion_ids == [9]
    with pytest.raises(SamplerError, match="returned 0 choices for 1 prompts x n=1"):
        c._parse({"choices": []}, [[1]], params)
    with pytest.raises(SamplerError, match="need one finite log-prob per token"):
        c._parse({"choices": [{**good, "logprobs": {"token_logprobs": [-1.0, None]}}]}, [[1]], params)
    with pytest.raises(SamplerError, match="finish_reason 'abort'"):
        c._parse({"choices": [{**good, "finish_reason": "abort"}]}, [[1]], params)
    c.close()


def test_config_file_rejects_unknown_keys(tmp_path):
    path = tmp_path / "serve.py"
    path.write_text("def get_config():\n    return {'model': 'tiny', 'port': 9, 'max_batchh': 4}\n")
    with pytest.raises(ValueError, match="unknown serve setting 'max_batchh'; valid: .*max_batch"):
        server_lib.load_config(str(path))
    path.write_text("def get_config():\n    return {'model': 'tiny', 'port': 9}\n")
    assert server_lib.load_config(str(path)).port == 9


def _wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.02)
