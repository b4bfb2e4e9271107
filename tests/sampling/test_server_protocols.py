"""The protocols harnesses speak, against one `rljax serve` subprocess: /v1/chat/completions through the
official `openai` client (logprobs, token ids, SSE streaming, errors), vLLM's /inference/v1/generate exactly
as verifiers' renderer client sends it, /v1/models metadata, the exported Hugging Face tokenizer, and
RemoteSampler.check_compatible."""

import json
import math
import re

import httpx
import numpy as np
import openai
import pytest
import transformers
from flax import nnx

from sampling_servers import HTTP_TIMEOUT
from rljax.models.config import get_preset
from rljax.models.transformer import Decoder
from rljax.sampling import RemoteSampler, SamplingParams
from rljax.sampling import SamplerIncompatibleError
from rljax.sampling import server as server_lib
from rljax.tasks.toy import CharTokenizer

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abc="}]
N = 4  # every sampling request here is 4 rows of <= 16 tokens: one compiled shape, shared with test_server


@pytest.fixture(scope="module")
def server(served):
    return served


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT) as c:
        yield c


def _local(tiny, prompt, **kw):
    _, tokenizer, local = tiny
    params = dict(max_new_tokens=8, temperature=0.9, n=N, seed=5, stop_token_ids=(tokenizer.eos_token_id,))
    return local.generate([prompt], SamplingParams(**{**params, **kw}))


def _text(tokenizer, completion):
    ids = completion.completion_ids
    return tokenizer.decode(ids[:-1] if completion.finish_reason == "stop" else ids)


def test_chat_completions_apply_the_chat_template_and_return_vllm_token_ids(oai, tiny):
    _, tokenizer, _ = tiny
    resp = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0.9, n=N, seed=5,
                                       logprobs=True, top_logprobs=3, extra_body={"return_token_ids": True})
    prompt = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True))
    assert prompt == tokenizer.encode("be briefabc=")  # the tiny template concatenates contents
    assert resp.object == "chat.completion" and resp.model_extra["prompt_token_ids"] == prompt
    expected = _local(tiny, prompt)
    assert [c.model_extra["token_ids"] for c in resp.choices] == [e.completion_ids for e in expected]
    assert resp.usage.prompt_tokens == len(prompt)
    assert resp.usage.completion_tokens == sum(len(e.completion_ids) for e in expected)
    for choice, e in zip(resp.choices, expected):
        assert choice.message.role == "assistant" and choice.message.content == _text(tokenizer, e)
        assert choice.finish_reason == e.finish_reason
        content = choice.logprobs.content
        np.testing.assert_allclose([t.logprob for t in content], e.logprobs, atol=1e-6)
        assert [t.token for t in content] == [tokenizer.decode([i], skip_special_tokens=False)
                                             for i in e.completion_ids]
        for t in content:  # the 3 most likely tokens of the sampling distribution, best first
            top = [a.logprob for a in t.top_logprobs]
            assert len(top) == 3 and top == sorted(top, reverse=True) and t.logprob <= top[0] + 1e-6
    # A different seed samples differently (the comparison above can fail).
    other = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0.9, n=N, seed=6)
    assert [c.model_extra["token_ids"] for c in other.choices] != [e.completion_ids for e in expected]


def test_chat_stream_is_sse_with_usage_and_done(oai, server, tiny):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0.9, n=N, seed=5, logprobs=True)
    whole = oai.chat.completions.create(**kw)
    chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text, ids, logps, finish = [""] * N, [[] for _ in range(N)], [[] for _ in range(N)], [None] * N
    for chunk in chunks[:-1]:
        assert chunk.object == "chat.completion.chunk" and chunk.usage is None
        (choice,) = chunk.choices
        text[choice.index] += choice.delta.content or ""
        ids[choice.index] += choice.model_extra.get("token_ids") or []
        logps[choice.index] += [t.logprob for t in (choice.logprobs.content if choice.logprobs else [])]
        finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    for i, choice in enumerate(whole.choices):
        assert text[i] == choice.message.content and ids[i] == choice.model_extra["token_ids"]
        assert finish[i] == choice.finish_reason
        np.testing.assert_allclose(logps[i], [t.logprob for t in choice.logprobs.content], atol=1e-6)
    # The wire format: `data: {...}` events, the last one `data: [DONE]`.
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**kw, "stream": True},
                      timeout=HTTP_TIMEOUT) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[0][len("data: "):])["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]


def test_chat_stop_strings_and_max_completion_tokens(oai):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "abc="}], seed=1, temperature=1.0, n=N,
              extra_body={"ignore_eos": True})
    full = oai.chat.completions.create(**kw, max_completion_tokens=16).choices[0]
    assert full.finish_reason == "length" and len(full.model_extra["token_ids"]) == 16
    stop = full.message.content[5:7]
    cut = oai.chat.completions.create(**kw, max_completion_tokens=16, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.model_extra["stop_reason"] == stop
    assert cut.message.content == full.message.content[:full.message.content.index(stop)]


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(temperature=5000), openai.BadRequestError, "temperature: Input should be less than or equal to 1000"),
    (dict(n=0), openai.BadRequestError, "n: Input should be greater than or equal to 1"),
    (dict(messages=[]), openai.BadRequestError, "messages: List should have at least 1 item"),
    (dict(extra_body={"max_tokens": True}), openai.BadRequestError, "max_tokens: Input should be a valid integer"),
    (dict(top_logprobs=2), openai.BadRequestError, "top_logprobs: needs logprobs: true"),
    (dict(logprobs=True, top_logprobs=6), openai.BadRequestError, "top_logprobs: at most 5 alternatives"),
    (dict(max_tokens=300), openai.BadRequestError, "exceeds the model's context length of 256 tokens"),
    (dict(messages=[{"role": "robot", "content": "x"}]), openai.BadRequestError, "messages.0.role: Input should be"),
    (dict(messages=[{"role": "user", "content": "ABC"}]), openai.BadRequestError, "not in the vocabulary"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), openai.BadRequestError,
     "tools: not supported"),
    (dict(frequency_penalty=1.5), openai.BadRequestError, "frequency_penalty: 1.5 is not supported"),
    (dict(model="gpt-4o"), openai.NotFoundError, "model 'gpt-4o' does not exist"),
])
def test_chat_bad_input_is_a_4xx_the_openai_client_raises(oai, kwargs, error, message):
    request = {**dict(model="tiny", messages=MESSAGES, max_tokens=4), **kwargs}
    with pytest.raises(error, match=message):
        oai.chat.completions.create(**request)


def test_openai_client_completions_and_models(oai, tiny):
    _, tokenizer, _ = tiny
    resp = oai.completions.create(model="tiny", prompt="abc=", max_tokens=8, temperature=0.9, n=N, seed=5,
                                  logprobs=2)
    expected = _local(tiny, tokenizer.encode("abc="))
    assert [c.text for c in resp.choices] == [_text(tokenizer, e) for e in expected]
    for choice, e in zip(resp.choices, expected):
        np.testing.assert_allclose(choice.logprobs.token_logprobs, e.logprobs, atol=1e-6)
    (card,) = oai.models.list().data
    assert card.id == "tiny" and card.model_extra["max_model_len"] == 256 and card.model_extra["vocab_size"] == 53


def _renderer_body(prompt, **sampling):
    """The body verifiers' renderer client posts: its sampling args, stop ids from the renderer, logprobs k + 2
    for a head of k = 1, flat / compact logprob options it falls back from, detokenize off."""
    sp = {"temperature": 0.9, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "seed": 5, "n": N, "repetition_penalty": 1.0,
          "min_tokens": 0, "max_tokens": 8, "stop_token_ids": [2], "logprobs": 3, "flat_logprobs": True,
          "extra_args": {"prl_compact_logprobs": True}, "detokenize": False, "skip_special_tokens": False}
    return {"model": "tiny", "token_ids": prompt, "sampling_params": {**sp, **sampling}, "cache_salt": "s4lt"}


def test_generate_is_vllms_token_in_token_out(server, tiny):
    _, tokenizer, _ = tiny
    prompt = tokenizer.encode("be briefabc=")
    r = server.post("/inference/v1/generate", json=_renderer_body(prompt))
    assert r.status_code == 200, r.text
    body = r.json()
    expected = _local(tiny, prompt)
    assert isinstance(body["request_id"], str) and body["prompt_token_ids"] == prompt
    assert body["usage"]["completion_tokens"] == sum(len(e.completion_ids) for e in expected)
    assert [c["index"] for c in body["choices"]] == list(range(N))
    for choice, e in zip(body["choices"], expected):
        assert choice["token_ids"] == e.completion_ids and choice["finish_reason"] == e.finish_reason
        content = choice["logprobs"]["content"]
        # What the renderer client checks before it trusts a reply.
        assert len(content) == len(choice["token_ids"])
        assert [t["token"] for t in content] == [f"token_id:{i}" for i in choice["token_ids"]]
        np.testing.assert_allclose([t["logprob"] for t in content], e.logprobs, atol=1e-6)
        for t in content:
            head = {a["token"]: a["logprob"] for a in t["top_logprobs"]}
            assert len(head) >= 3 and t["top_logprobs"][0]["token"] == t["token"]  # sampled first, then top 3
            assert all(math.isfinite(x) and x <= 1e-6 for x in head.values())
            assert head[t["token"]] == t["logprob"] != -9999.0
    # Given a request id, it comes back; without logprobs there are none (vLLM's behaviour).
    r = server.post("/inference/v1/generate", json={"token_ids": prompt, "request_id": "abc",
                                                    "sampling_params": {"max_tokens": 3, "seed": 1, "n": N}}).json()
    assert r["request_id"] == "abc" and r["choices"][0]["logprobs"] is None and len(r["choices"][0]["token_ids"]) <= 3


@pytest.mark.parametrize("change,message", [
    ({"token_ids": []}, "token_ids: List should have at least 1 item"),
    ({"token_ids": [3, 99]}, r"token_ids: token ids outside the vocabulary \[0, 53\)"),
    ({"token_ids": [3, True]}, "token_ids.1: Input should be a valid integer"),
    ({"stream": True}, "stream: not supported on /inference/v1/generate"),
    ({"priority": 1}, "priority: 1 is not supported"),
    ({"sampling_params": {"logprobs": 6}}, "sampling_params.logprobs: at most 5 alternatives"),
    ({"sampling_params": {"max_tokens": True}}, "sampling_params.max_tokens: Input should be a valid integer"),
    ({"sampling_params": {"top_k": 2**63}}, "sampling_params.top_k: Input should be less than or equal to"),
    ({"sampling_params": {"prompt_logprobs": 1}}, "prompt_logprobs: 1 is not supported"),
    ({"sampling_params": {"stop": ["x"], "detokenize": False}}, "stop strings need detokenize: true"),
    ({"sampling_params": {"guided_json": {}}}, "sampling_params.guided_json: Extra inputs are not permitted"),
])
def test_generate_bad_input_is_a_400(server, change, message):
    body = {"token_ids": [3, 4, 5], "sampling_params": {"max_tokens": 2}, **change}
    r = server.post("/inference/v1/generate", json=body)
    assert r.status_code == 400 and re.search(message, r.json()["error"]["message"]), r.text


def test_exported_tokenizer_lets_a_harness_tokenize_on_its_side(server, tiny):
    _, tokenizer, _ = tiny
    hf = transformers.AutoTokenizer.from_pretrained(server.tokenizer_dir)
    rendered = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    prompt = hf.encode(rendered, add_special_tokens=False)
    assert prompt == tokenizer.encode(rendered) and hf.eos_token_id == tokenizer.eos_token_id
    # Harness-side tokens in, tokens out: the same completion the chat endpoint makes of the messages.
    gen = server.post("/inference/v1/generate", json=_renderer_body(prompt)).json()
    chat = server.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 8,
                                                     "temperature": 0.9, "n": N, "seed": 5}).json()
    for g, c in zip(gen["choices"], chat["choices"]):
        assert g["token_ids"] == c["token_ids"]
        ids = g["token_ids"][:-1] if g["finish_reason"] == "stop" else g["token_ids"]
        assert hf.decode(ids, skip_special_tokens=True) == c["message"]["content"]


def test_check_compatible_names_every_mismatch(server, tiny):
    model, tokenizer, _ = tiny
    with RemoteSampler(server.url, retries=0) as c:
        info = c.check_compatible(model, tokenizer=tokenizer, max_total_tokens=200)
        assert info["id"] == "tiny" and info["param_shapes"]["embed"] == ["float32", [53, 64]]
        other = Decoder(get_preset("tiny", vocab_size=60), rngs=nnx.Rngs(0))
        with pytest.raises(SamplerIncompatibleError, match=r"vocab_size: the server's model has 53, the trainer's "
                                                           r"60; embed: float32\[60, 64\] here, float32\[53, 64\] "
                                                           r"there"):
            c.check_compatible(other)
        with pytest.raises(SamplerIncompatibleError, match=r"tokenizer vocab_size: the server's is 53, the "
                                                           r"trainer's 52.*fingerprints differ"):
            c.check_compatible(tokenizer=CharTokenizer(server_lib.TINY_CHARS[:-1]))
        with pytest.raises(SamplerIncompatibleError, match="the trainer needs 1000 tokens per row, the server's "
                                                           "max_model_len is 256"):
            c.check_compatible(max_total_tokens=1000)
