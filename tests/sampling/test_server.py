"""`rljax serve` in a subprocess on a loopback port, driven through RemoteSampler and httpx: equality with
the in-process sampler, every numeric field's range, batching, and the admin endpoint (token, weights root,
versions, resumes, corrupted checkpoints)."""

import concurrent.futures
import glob
import os
import re
import shutil

import numpy as np
import pytest
from flax import nnx

from sampling_servers import ADMIN_TOKEN, HTTP_TIMEOUT
from rljax import cli
from rljax.sampling import InProcessSampler, RemoteSampler, SamplerError, SamplerRequestError, SamplingParams
from rljax.sampling import server as server_lib
from rljax.sampling import weights as weights_lib

PROMPTS = [[3, 4, 5, 40], [20, 21]]
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def server(served):
    return served


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
    body = {"prompt": ["abc=", "ab="], "n": 2, "max_tokens": 16, "seed": 1, "ignore_eos": True}  # 4 rows
    r = server.post("/v1/completions", json=body)
    ids, text = r.json()["choices"][0]["token_ids"], r.json()["choices"][0]["text"]
    stop = text[5:7]  # a two-character stop string: matched on the text, after the row ended
    cut = server.post("/v1/completions", json={**body, "stop": ["@@", stop]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert cut["text"] == text[:text.index(stop)]
    assert cut["token_ids"] == ids[:len(cut["token_ids"])] and len(cut["token_ids"]) < len(ids)


@pytest.mark.parametrize("body,status,message", [
    (b'{"prompt": [1, 2', 400, "invalid JSON body"),
    ({"prompt": "abc", "max_tokens": -3}, 400, "max_tokens: Input should be greater than or equal to 1"),
    ({"prompt": "abc", "best_of_all": 2}, 400, "best_of_all: Extra inputs are not permitted"),
    ({"prompt": [3] * 250, "max_tokens": 10}, 400, "exceeds the model's context length of 256 tokens"),
    ({"prompt": "ABC"}, 400, r"characters \['A', 'B', 'C'\] are not in the vocabulary"),
    ({"prompt": [[1, 2], []]}, 400, "prompt 1 is empty"),
    ({"prompt": "abc", "top_p": 0}, 400, "top_p: Input should be greater than 0"),
    ({"prompt": "abc", "model": "gpt-4"}, 404, "model 'gpt-4' does not exist"),
    # Booleans are not numbers, and every number fits what the sampler represents.
    ({"prompt": "abc", "max_tokens": True}, 400, "max_tokens: Input should be a valid integer"),
    ({"prompt": "abc", "n": True}, 400, "n: Input should be a valid integer"),
    ({"prompt": "abc", "temperature": True}, 400, "temperature: Input should be a valid number"),
    ({"prompt": "abc", "top_k": 2**63}, 400, "top_k: Input should be less than or equal to 2147483647"),
    ({"prompt": "abc", "max_tokens": 2**40}, 400, "max_tokens: Input should be less than or equal to 2147483647"),
    ({"prompt": "abc", "seed": 2**32}, 400, "seed: Input should be less than or equal to 4294967295"),
    ({"prompt": "abc", "seed": -1}, 400, "seed: Input should be greater than or equal to 0"),
    ({"prompt": "abc", "temperature": 1e-30}, 400, r"temperature: must be 0 \(greedy\) or in \[1e-05, 1000\]"),
    ({"prompt": "abc", "temperature": 1e300}, 400, "temperature: Input should be less than or equal to 1000"),
    (b'{"prompt": "abc", "top_p": NaN}', 400, "top_p: Input should be a finite number"),
    ({"prompt": "abc", "n": 65}, 400, "n: 65 is more than this server's max_n=64"),
    ({"prompt": ["abc"] * 40, "n": 30}, 400, r"40 prompts x n=30 = 1200 rows is more than this server's "
                                             r"max_rows_per_request=1024"),
    ({"prompt": "abc", "logprobs": 6}, 400, r"logprobs: at most 5 alternatives per token"),
    ({"prompt": "abc", "logprobs": True}, 400, "logprobs: Input should be a valid integer"),
    ({"prompt": [[3, 4, 99]]}, 400, r"token ids outside the vocabulary \[0, 53\): \[99\]"),
    ({"prompt": [3, True]}, 400, "prompt: must be a string, a list of strings, a list of token ids"),
    ({"prompt": [3, 2**40]}, 400, "prompt: must be a string, a list of strings, a list of token ids"),
    ({"prompt": "abc", "stop_token_ids": [True]}, 400, "stop_token_ids.0: Input should be a valid integer"),
    ({"prompt": "abc", "stop_token_ids": [60]}, 400, r"stop_token_ids: token ids outside the vocabulary"),
    ({"prompt": "abc", "stop": [""]}, 400, "stop: at most 16 non-empty strings"),
    ({"prompt": "abc", "presence_penalty": 0.5}, 400, "presence_penalty: 0.5 is not supported by rljax serve"),
    ({"prompt": "abc", "stream": True}, 400, "stream: not supported on /v1/completions"),
])
def test_malformed_requests_get_4xx_with_a_message(server, body, status, message):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else \
        {"json": body}
    r = server.post("/v1/completions", **kwargs)
    assert r.status_code == status, r.text
    assert re.search(message, r.json()["error"]["message"]), r.text


def test_neutral_values_of_unsupported_features_are_accepted(server):
    r = server.post("/v1/completions", json={"prompt": "abc", "n": 4, "max_tokens": 2, "seed": 0, "presence_penalty": 0.0,
                                             "frequency_penalty": 0, "repetition_penalty": 1.0, "min_p": 0.0,
                                             "min_tokens": 0, "best_of": 1, "logit_bias": {}})
    assert r.status_code == 200, r.text


def test_client_raises_the_servers_message(client):
    with pytest.raises(SamplerRequestError, match="HTTP 400: .*exceeds the model's context length"):
        client.generate([[3] * 250], SamplingParams(max_new_tokens=10))


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


# ----------------------------------------------------------------------------
# /update_weights: token, root, versions, corrupted checkpoints.


def test_update_weights_needs_the_admin_token(server):
    main = server
    body = {"path": "sync", "step": 1}
    r = main.post("/update_weights", json=body)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert "Authorization: Bearer" in r.json()["error"]["message"]
    r = main.post("/update_weights", json=body, headers={"Authorization": "Bearer not-the-token"})
    assert r.status_code == 401 and r.json()["error"]["message"] == "admin endpoint: wrong admin token"
    # Authentication comes first: an unauthenticated client gets no validation feedback.
    assert main.post("/update_weights", content=b"{not json").status_code == 401


def test_update_weights_reads_only_under_the_weights_root(server):
    root = server.root
    (root / "link_out").symlink_to("/etc")
    inner = root / "ckpt_with_link"
    weights_lib.save_params({"x": np.zeros(2, np.float32)}, inner, 1)
    os.symlink("/etc/passwd", inner / "1" / "stolen")
    cases = [({"path": "/proc"}, 403, "path '/proc' is outside this server's weights root"),
             ({"path": "/definitely/missing"}, 403, "is outside this server's weights root"),
             ({"path": "link_out"}, 403, "is outside this server's weights root"),
             ({"path": str(root / "sync" / ".." / ".." / "x")}, 400, r"'\.\.' is not allowed"),
             ({"path": "ckpt_with_link"}, 403, "contains a symlink that leads outside the weights root"),
             ({"path": "not_there"}, 404, "no checkpoint directory under the weights root"),
             ({"path": "sync", "version": 2**53}, 400, "version: Input should be less than or equal to"),
             ({"path": "sync", "version": -1}, 400, "version: Input should be greater than or equal to 0"),
             ({"path": "sync", "step": True}, 400, "step: Input should be a valid integer")]
    for body, status, message in cases:
        r = server.post("/update_weights", json=body, headers=AUTH)
        assert r.status_code == status, (body, r.text)
        text = r.json()["error"]["message"]
        assert re.search(message, text), (body, text)
        # No listing, no absolute path of the root, nothing about what exists outside it
        # (beyond echoing the client's own path).
        text = text.replace(body["path"], "")
        assert str(root) not in text and "passwd" not in text and not re.search(r"\b\d+/", text)


def test_update_weights_changes_outputs_and_version(server, tiny):
    model, tokenizer, local = tiny
    root = server.root
    params = _params(tokenizer)
    sync = root / "sync"
    with RemoteSampler(server.url, sync_dir=sync, timeout=HTTP_TIMEOUT, retries=1, admin_token=ADMIN_TOKEN) as c:
        before = c.generate(PROMPTS, params)
        new_model, _ = server_lib.build_tiny(seed=1)
        c.update_weights(nnx.state(new_model, nnx.Param), version=7)
        assert c.version == 7 and server.health()["version"] == 7
        after = c.generate(PROMPTS, params)
        assert all(x.version == 7 for x in after)
        assert [x.completion_ids for x in after] != [x.completion_ids for x in before]
        _same(after, InProcessSampler(new_model, max_batch=8, top_logprobs=5).generate(PROMPTS, params))
        # Versions only increase within a session...
        with pytest.raises(SamplerRequestError, match="HTTP 409: version 5 is not above the served version 7"):
            c.update_weights(nnx.state(model, nnx.Param), version=5)
        # ...re-sending the current version from the same checkpoint (a retried push) is a no-op success, from
        # another checkpoint it is not. (The refused push above still wrote its step: 2.)
        assert weights_lib.latest_step(sync) == 2
        r = server.post("/update_weights", json={"path": str(sync), "step": 1, "version": 7}, headers=AUTH)
        assert r.status_code == 200 and r.json()["version"] == 7
        r = server.post("/update_weights", json={"path": "sync", "step": 2, "version": 7}, headers=AUTH)
        assert r.status_code == 409, r.text
        r = server.post("/update_weights", json={"path": "sync", "step": 2}, headers=AUTH)
        assert r.json()["version"] == 8  # no version: the server's own + 1
    # A restarted trainer resumes at version 5 and re-pushes into the same, non-empty sync dir.
    assert weights_lib.latest_step(sync) is not None
    with RemoteSampler(server.url, sync_dir=sync, timeout=HTTP_TIMEOUT, retries=1, admin_token=ADMIN_TOKEN) as c:
        c.update_weights(nnx.state(model, nnx.Param), version=5)
        assert server.health()["version"] == 5
        _same(c.generate(PROMPTS, params), before)
        c.update_weights(nnx.state(model, nnx.Param), version=6)  # and keeps pushing fresh steps
        _same(c.generate(PROMPTS, params), before)  # the initial weights serve again (the server is shared)
    assert len(os.listdir(sync)) <= 3  # the newest two steps (+ orbax's own files) are kept


def _data_file(step_dir) -> str:
    return max(glob.glob(os.path.join(step_dir, "default", "ocdbt.process_0", "d", "*")), key=os.path.getsize)


def test_corrupted_checkpoint_is_a_4xx_and_the_old_weights_keep_serving(server, client, tiny):
    _, tokenizer, _ = tiny
    root = server.root
    params = _params(tokenizer)
    version = server.health()["version"]
    before = client.generate(PROMPTS, params)
    other, _ = server_lib.build_tiny(seed=2)
    third, _ = server_lib.build_tiny(seed=3)
    weights_lib.save_params(nnx.state(third, nnx.Param), root / "third", 1)
    for damage, cause in [("truncate", r"could not be read: ValueError: OUT_OF_RANGE"),
                          # zstd frames here carry no checksum: garbled bytes may decode "fine" (orbax alone
                          # would serve them), decode to NaN, or fail to decode; every outcome is a 422.
                          ("garble", r"could not be read|has non-finite values|does not match its checksum"),
                          ("mixed", r"does not match its checksum \(the checkpoint is corrupted\)"),
                          ("metadata", r"could not be read: ")]:
        directory = root / f"broken_{damage}"
        weights_lib.save_params(nnx.state(other, nnx.Param), directory, 1)
        path = _data_file(directory / "1")
        data = bytearray(open(path, "rb").read())
        if damage == "truncate":
            data = data[:len(data) // 2]
        elif damage == "garble":
            data[len(data) // 2:len(data) // 2 + 64] = bytes(range(64))
        elif damage == "mixed":  # another push's arrays under this step (finite, well-formed, wrong)
            shutil.rmtree(directory / "1" / "default")
            shutil.copytree(root / "third" / "1" / "default", directory / "1" / "default")
            data = None
        else:
            path = str(directory / "1" / "default" / "_METADATA")
            data = b"{ not json"
        if data is not None:
            open(path, "wb").write(data)
        r = server.post("/update_weights", json={"path": f"broken_{damage}", "step": 1}, headers=AUTH)
        assert r.status_code == 422, r.text
        message = r.json()["error"]["message"]
        assert re.search(cause, message), message
        assert f"the served weights (version {version}) are unchanged" in message and str(root) not in message
        assert server.health()["version"] == version
        _same(client.generate(PROMPTS, params), before)


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


def test_serve_config_is_validated_before_anything_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("RLJAX_ADMIN_TOKEN", raising=False)
    config = server_lib.default_config()
    with config.unlocked():
        config.max_batchh = 4
    with pytest.raises(ValueError, match=r"unknown settings \['max_batchh'\].*valid: .*max_batch"):
        server_lib.validate_config(config)
    for flag, message in [("--config.port=70000", r"port=70000: must be an integer in \[0, 65535\]"),
                          ("--config.max_request_bytes=10", r"max_request_bytes=10: must be an integer in \[1024"),
                          (f"--config.weights_root={tmp_path}", "weights_root needs an admin token"),
                          (f"--config.weights_root={tmp_path}/nope", "weights_root=.*not an existing directory"),
                          ("--config.portt=1", "unknown config key 'portt'; valid keys of config: .*port")]:
        assert cli.main(["rljax", "serve", flag]) == 2
        assert re.search(message, capsys.readouterr().err), flag
