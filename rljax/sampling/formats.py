"""Reply bodies of `rljax serve`: sampled rows -> OpenAI / vLLM JSON (completions, chat, generate, SSE).

Log-probs are the sampler's behavior log-probs (after temperature and
top-k / top-p; see `rljax.sampling.types`); alternatives outside the kept
set have probability 0 and are reported as -9999.0 (vLLM's floor), since
JSON has no -inf.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from collections.abc import Iterator
from typing import Any

from rljax.sampling.protocol import Plan
from rljax.sampling.sampler import RowResult

LOGPROB_FLOOR = -9999.0


def _floor(x) -> float:
    x = float(x)
    return LOGPROB_FLOOR if not math.isfinite(x) else max(x, LOGPROB_FLOOR)


def decode(tokenizer, ids, skip_special_tokens: bool) -> str:
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


@dataclasses.dataclass
class Output:
    """One row after stop handling: the ids / log-probs kept, its text and why it ended."""

    result: RowResult
    ids: list[int]
    logps: list[float]
    text: str
    finish_reason: str
    stop_reason: int | str | None

    @property
    def prompt_ids(self) -> list[int]:
        return list(self.result.completion.prompt_ids)


def finish(result: RowResult, plan: Plan, tokenizer) -> Output:
    """Cuts a row at the first stop string in its text; names its stop token otherwise.

    The row ends at the first token whose text prefix contains a stop string
    (found by bisection over prefixes: a prefix that contains one stays
    containing it), and its text ends before the string (or after it, with
    include_stop_str_in_output). A row that ended on a stop token keeps the
    token in its ids and log-probs, but not in its text.
    """
    c = result.completion
    ids, logps, reason, stop_reason = list(c.completion_ids), list(c.logprobs), c.finish_reason, None
    skip = plan.skip_special_tokens
    if plan.stop_strings and any(s in decode(tokenizer, ids, skip) for s in plan.stop_strings):
        lo, hi = 1, len(ids)  # the smallest k whose prefix text holds a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in decode(tokenizer, ids[:mid], skip) for s in plan.stop_strings):
                hi = mid
            else:
                lo = mid + 1
        text = decode(tokenizer, ids[:lo], skip)
        pos, s = min((text.find(s), s) for s in plan.stop_strings if s in text)
        return Output(result, ids[:lo], logps[:lo], text[:pos + len(s) if plan.include_stop_str else pos], "stop", s)
    if reason == "stop" and ids and ids[-1] in plan.stop_ids:
        stop_reason = ids[-1]
        text = decode(tokenizer, ids if plan.include_stop_str else ids[:-1], skip)
    else:
        text = decode(tokenizer, ids, skip)
    return Output(result, ids, logps, text, reason, stop_reason)


def _namer(tokenizer, as_ids: bool):
    def name(token_id) -> str:
        return f"token_id:{int(token_id)}" if as_ids else decode(tokenizer, [token_id], False)
    return name


def _alternatives(out: Output, j: int, n: int):
    """(id, logprob) of the n most likely tokens of step j under the sampling distribution."""
    r = out.result
    if not n or r.top_ids is None:
        return []
    return [(int(a), float(lp)) for a, lp in zip(r.top_ids[j, :n], r.top_logprobs[j, :n])]


def usage(outputs: list[Output], prompts: list[list[int]]) -> dict[str, int]:
    n_prompt = sum(len(p) for p in prompts)
    n_completion = sum(len(o.ids) for o in outputs)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


# ----------------------------------------------------------------------------
# /v1/completions


def completion_choice(index: int, out: Output, tokenizer, *, logprobs: int | None, as_ids: bool,
                      routing: bool) -> dict[str, Any]:
    """One OpenAI / vLLM completion choice, with vLLM's token_ids and prompt_token_ids."""
    choice = {"index": index, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason,
              "stop_reason": out.stop_reason, "token_ids": out.ids, "prompt_token_ids": out.prompt_ids}
    if logprobs is not None:
        name = _namer(tokenizer, as_ids)
        tokens = [name(t) for t in out.ids]
        top = []
        for j, (t, lp) in enumerate(zip(out.ids, out.logps)):
            alternatives = {name(a): alp for a, alp in _alternatives(out, j, logprobs) if math.isfinite(alp)}
            alternatives[name(t)] = float(lp)
            top.append(alternatives)
        offsets, offset = [], 0
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        choice["logprobs"] = {"tokens": tokens, "token_logprobs": [float(x) for x in out.logps], "top_logprobs": top,
                              "text_offset": offsets}
    c = out.result.completion
    if routing and c.routing is not None:
        choice["routing"] = c.routing[:len(out.ids)].tolist()
        choice["prompt_routing"] = c.prompt_routing.tolist()
    return choice


# ----------------------------------------------------------------------------
# /v1/chat/completions and /inference/v1/generate: OpenAI's chat logprobs shape.


def _entry(token: str, logprob: float, as_ids: bool) -> dict[str, Any]:
    return {"token": token, "logprob": _floor(logprob),
            "bytes": None if as_ids else list(token.encode("utf-8", errors="replace"))}


def chat_logprobs(out: Output, tokenizer, *, top: int, as_ids: bool) -> list[dict[str, Any]]:
    """OpenAI's `logprobs.content`: per token, its log-prob and the `top` most likely alternatives."""
    name = _namer(tokenizer, as_ids)
    content = []
    for j, (t, lp) in enumerate(zip(out.ids, out.logps)):
        entry = _entry(name(t), lp, as_ids)
        entry["top_logprobs"] = [_entry(name(a), alp, as_ids) for a, alp in _alternatives(out, j, top)]
        content.append(entry)
    return content


def generate_logprobs(out: Output, top: int) -> dict[str, Any]:
    """vLLM generate's logprobs: `token_id:<id>` tokens; top_logprobs = the sampled token, then the `top`
    most likely others (vLLM's {sampled} | top-N dictionary, in that order)."""
    content = []
    for j, (t, lp) in enumerate(zip(out.ids, out.logps)):
        head = [(t, lp)] + [(a, alp) for a, alp in _alternatives(out, j, top) if a != t]
        content.append({"token": f"token_id:{t}", "logprob": _floor(lp), "bytes": None,
                        "top_logprobs": [_entry(f"token_id:{a}", alp, True) for a, alp in head]})
    return {"content": content}


def chat_response(model: str, outputs: list[Output], tokenizer, *, logprobs: bool, top: int, as_ids: bool,
                  version: int) -> dict[str, Any]:
    prompt = outputs[0].prompt_ids
    choices = []
    for i, out in enumerate(outputs):
        choices.append({
            "index": i, "message": {"role": "assistant", "content": out.text, "tool_calls": []},
            "logprobs": {"content": chat_logprobs(out, tokenizer, top=top, as_ids=as_ids)} if logprobs else None,
            "finish_reason": out.finish_reason, "stop_reason": out.stop_reason, "token_ids": out.ids})
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage(outputs, [prompt]), "prompt_token_ids": prompt,
            "weights_version": version}


def text_pieces(out: Output, tokenizer, skip_special_tokens: bool) -> list[str]:
    """One text piece per token that concatenates exactly to `out.text`.

    Each token's share is measured by decoding a short window before it (a
    byte-level token may be half a character, so whole-prefix decodes are
    not additive), then clamped so the pieces never overrun the final text,
    which stop strings may have cut mid-token.
    """
    offsets, total = [], 0
    for k in range(1, len(out.ids) + 1):
        s = max(0, k - 6)
        total += len(decode(tokenizer, out.ids[s:k], skip_special_tokens)) - \
            len(decode(tokenizer, out.ids[s:k - 1], skip_special_tokens))
        offsets.append(min(max(total, offsets[-1] if offsets else 0), len(out.text)))
    if offsets:
        offsets[-1] = len(out.text)
    starts = [0] + offsets[:-1]
    return [out.text[a:b] for a, b in zip(starts, offsets)]


def chat_stream(model: str, outputs: list[Output], tokenizer, *, logprobs: bool, top: int, as_ids: bool,
                include_usage: bool, skip_special_tokens: bool, version: int) -> Iterator[str]:
    """Server-sent events of a finished chat completion: role, one chunk per token, finish, usage, [DONE]."""
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model, "weights_version": version}
    if include_usage:
        base["usage"] = None

    def event(choices, **extra) -> str:
        return f"data: {json.dumps({**base, 'choices': choices, **extra})}\n\n"

    prompt = outputs[0].prompt_ids
    for i, out in enumerate(outputs):
        first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        yield event([first], prompt_token_ids=prompt) if i == 0 else event([first])
        entries = chat_logprobs(out, tokenizer, top=top, as_ids=as_ids) if logprobs else None
        for j, piece in enumerate(text_pieces(out, tokenizer, skip_special_tokens)):
            yield event([{"index": i, "delta": {"content": piece},
                          "logprobs": {"content": [entries[j]]} if logprobs else None,
                          "finish_reason": None, "token_ids": [out.ids[j]]}])
        yield event([{"index": i, "delta": {}, "logprobs": None, "finish_reason": out.finish_reason,
                      "stop_reason": out.stop_reason}])
    if include_usage:
        yield event([], usage=usage(outputs, [prompt]))
    yield "data: [DONE]\n\n"
