"""Request bodies of `rljax serve`, and their translation into sampler rows.

Every model is strict (a boolean is not a number, `1.0` is not a count) and
forbids unknown fields, and every number is bounded by what the sampler can
represent, so a bad value is a 400 naming the field before any work starts,
never an overflow inside a shared batch:

    max_tokens   1 .. the context (int32 on the device)
    temperature  0 (greedy) or [1e-5, 1e3]; finite
    top_p        (0, 1]
    top_k        -1 or 0 (off) .. 2^31 - 1 (more than the vocabulary is off)
    n            1 .. max_n;  prompts x n <= max_rows_per_request
    seed         0 .. 2^32 - 1 (the sampler's key width: never wrapped)
    logprobs     0 .. the server's top_logprobs
    token ids    0 .. vocab_size - 1

vLLM's sampling extensions that rljax does not implement (penalties, min_p,
min_tokens, logit_bias, ...) are accepted only at their neutral value, so a
client sending the defaults works and one asking for the feature gets a 400
instead of silently different sampling.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Annotated, Any, Literal

import pydantic

from rljax.sampling.admin import MAX_VERSION
from rljax.sampling.sampler import Row

INT32_MAX = 2**31 - 1
SEED_MAX = 2**32 - 1
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-5, 1e3
MAX_STOP_STRINGS, MAX_STOP_LENGTH = 16, 256

Count = Annotated[int, pydantic.Field(ge=1, le=INT32_MAX)]
TokenId = Annotated[int, pydantic.Field(ge=0, le=INT32_MAX)]
Version = Annotated[int, pydantic.Field(ge=0, le=MAX_VERSION)]
Finite = Annotated[float, pydantic.Field(allow_inf_nan=False)]

# Field -> the only value accepted (what rljax's sampler always does).
NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0,
           "min_tokens": 0, "best_of": 1, "prompt_logprobs": 0, "echo": False, "continue_final_message": False}


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)


class Sampling(_Strict):
    """Fields shared by completions, chat and generate (OpenAI's, plus vLLM's extensions)."""

    temperature: Annotated[float, pydantic.Field(ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, pydantic.Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, pydantic.Field(ge=-1, le=INT32_MAX)] = 0
    n: Count = 1
    seed: Annotated[int, pydantic.Field(ge=0, le=SEED_MAX)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # rljax's decode never inserts spaces; accepted either way
    include_stop_str_in_output: bool = False
    presence_penalty: Finite | None = None
    frequency_penalty: Finite | None = None
    repetition_penalty: Finite | None = None
    min_p: Finite | None = None
    min_tokens: Annotated[int, pydantic.Field(ge=0, le=INT32_MAX)] | None = None
    logit_bias: dict[str, Finite] | None = None
    user: str | None = None

    @pydantic.field_validator("temperature")
    @classmethod
    def _temperature(cls, t: float) -> float:
        if 0.0 < t < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {t}")
        return t


class CompletionRequest(Sampling):
    """POST /v1/completions."""

    prompt: Any
    model: str | None = None
    max_tokens: Count = 16
    logprobs: Annotated[int, pydantic.Field(ge=0, le=INT32_MAX)] | None = None
    echo: bool = False
    stream: bool = False
    best_of: Count | None = None
    return_token_ids: bool | None = None  # ids are always returned
    return_tokens_as_token_ids: bool = False
    return_routing: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(pydantic.BaseModel):
    """One message; fields other than role and content (name, tool_calls, ...) reach the chat template."""

    model_config = pydantic.ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):  # vLLM's "string" content format: text parts joined by newlines
            content = "\n".join(p.text for p in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ChatCompletionRequest(Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], pydantic.Field(min_length=1)]
    model: str | None = None
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, pydantic.Field(ge=0, le=INT32_MAX)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None  # ids are always returned
    return_tokens_as_token_ids: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None


class GenerateSampling(Sampling):
    """vLLM's SamplingParams as `/inference/v1/generate` takes them."""

    max_tokens: Count | None = None
    logprobs: Annotated[int, pydantic.Field(ge=0, le=INT32_MAX)] | None = None
    prompt_logprobs: Annotated[int, pydantic.Field(ge=0, le=INT32_MAX)] | None = None
    detokenize: bool = True  # no text is returned either way
    flat_logprobs: bool = False  # a storage layout inside vLLM; the reply is the same JSON
    extra_args: dict[str, Any] | None = None  # extensions of other servers (e.g. compact logprobs): ignored


class GenerateRequest(_Strict):
    """POST /inference/v1/generate: vLLM's token-in, token-out endpoint."""

    token_ids: Annotated[list[TokenId], pydantic.Field(min_length=1)]
    sampling_params: GenerateSampling = pydantic.Field(default_factory=GenerateSampling)
    model: str | None = None
    request_id: Annotated[str, pydantic.Field(max_length=256)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None  # no prefix cache here, so nothing to salt
    priority: int = 0
    return_token_ids: bool | None = None


class UpdateWeightsRequest(_Strict):
    """POST /update_weights: an orbax checkpoint directory under the weights root."""

    path: Annotated[str, pydantic.Field(min_length=1, max_length=4096)]
    step: Version | None = None  # None: the latest step
    version: Version | None = None  # None: current version + 1
    reset: bool = False  # allow a version at or below the served one (a restarted trainer)


# ----------------------------------------------------------------------------
# Requests -> rows.


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the served model and the server's config allow."""

    vocab_size: int
    context: int
    max_completion: int  # the largest completion bucket
    top_logprobs: int
    max_n: int
    max_rows: int
    max_stop_ids: int
    eos_token_id: int | None


@dataclasses.dataclass(frozen=True)
class Plan:
    """One request's rows and how to cut and name their outputs."""

    rows: list[Row]
    stop_strings: tuple[str, ...]
    stop_ids: frozenset[int]
    skip_special_tokens: bool
    include_stop_str: bool


def check_neutral(req: pydantic.BaseModel, *names: str) -> None:
    """ValueError for an unsupported vLLM feature asked for with a non-neutral value."""
    for name in names or NEUTRAL:
        if name not in type(req).model_fields:
            continue
        value = getattr(req, name)
        if value is not None and value != NEUTRAL[name]:
            raise ValueError(f"{name}: {value!r} is not supported by rljax serve (only {NEUTRAL[name]!r})")
    if getattr(req, "logit_bias", None):
        raise ValueError("logit_bias: not supported by rljax serve (only an empty map)")


def check_ids(ids, limits: Limits, what: str) -> None:
    bad = [t for t in ids if t >= limits.vocab_size]
    if bad:
        raise ValueError(f"{what}: token ids outside the vocabulary [0, {limits.vocab_size}): {bad[:5]}")


def plan_rows(prompts: list[list[int]], req: Sampling, max_tokens: int | None, limits: Limits, tokenizer,
              what: str = "prompt") -> Plan:
    """The sampler rows of `prompts` x req.n with req's settings; ValueError naming the field otherwise.

    `max_tokens` None means "the rest of the context" (chat and generate's
    default), capped by the largest completion bucket.
    """
    check_neutral(req)
    if req.n > limits.max_n:
        raise ValueError(f"n: {req.n} is more than this server's max_n={limits.max_n}")
    if len(prompts) * req.n > limits.max_rows:
        raise ValueError(f"{len(prompts)} prompts x n={req.n} = {len(prompts) * req.n} rows is more than this "
                         f"server's max_rows_per_request={limits.max_rows}")
    for i, ids in enumerate(prompts):
        label = what if len(prompts) == 1 else f"{what} {i}"
        if not ids:
            raise ValueError(f"{label} is empty; a prompt needs at least one token")
        check_ids(ids, limits, label)
        room = limits.context - len(ids)
        wanted = min(room, limits.max_completion) if max_tokens is None else max_tokens
        if room < 1 or len(ids) + wanted > limits.context:
            raise ValueError(f"{label} of {len(ids)} tokens + max_tokens {wanted} = {len(ids) + wanted} exceeds "
                             f"the model's context length of {limits.context} tokens")
    stop_strings = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop_strings) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_LENGTH for s in stop_strings):
        raise ValueError(f"stop: at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_LENGTH} "
                         "characters")
    stop_ids = set(req.stop_token_ids or ())
    check_ids(stop_ids, limits, "stop_token_ids")
    if not req.ignore_eos and limits.eos_token_id is not None:
        stop_ids.add(int(limits.eos_token_id))
    for s in stop_strings:  # one-token stop strings also end the row inside the decode loop
        try:
            ids = tokenizer.encode(s)
        except ValueError:  # not encodable (CharTokenizer): still matched on the text
            ids = []
        if len(ids) == 1:
            stop_ids.add(int(ids[0]))
    if len(stop_ids) > limits.max_stop_ids:
        raise ValueError(f"stop_token_ids: {len(stop_ids)} stop tokens (EOS and one-token stop strings included); "
                         f"at most {limits.max_stop_ids}")
    top_k = 0 if req.top_k <= 0 or req.top_k >= limits.vocab_size else req.top_k
    seed = secrets.randbits(32) if req.seed is None else req.seed
    rows = []
    for i, ids in enumerate(prompts):
        m = min(limits.context - len(ids), limits.max_completion) if max_tokens is None else max_tokens
        for j in range(req.n):
            rows.append(Row(tuple(ids), int(m), float(req.temperature), float(req.top_p), int(top_k),
                            tuple(sorted(stop_ids)), int(seed), i * req.n + j))
    return Plan(rows, stop_strings, frozenset(stop_ids), req.skip_special_tokens, req.include_stop_str_in_output)


def completion_prompts(prompt: Any, tokenizer) -> list[list[int]]:
    """OpenAI's four prompt forms (text, texts, ids, list of ids) as lists of ids."""
    def is_id(x):
        return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= INT32_MAX

    form = ("prompt: must be a string, a list of strings, a list of token ids (ints in [0, 2^31)) or a list of "
            "such lists")
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(form if not isinstance(prompt, list) else "prompt is empty")
    if all(is_id(p) for p in prompt):
        prompt = [prompt]
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append(list(tokenizer.encode(p)))
        elif isinstance(p, list) and all(is_id(t) for t in p):
            out.append(list(p))
        else:
            raise ValueError(form)
    return out
