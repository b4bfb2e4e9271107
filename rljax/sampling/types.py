"""The sampler contract the trainer codes against: SamplingParams, Completion, Sampler.

Two implementations share it: `InProcessSampler` (a jitted KV-cache decode
loop in this process) and `RemoteSampler` (an OpenAI-compatible HTTP server:
`rljax serve`, vLLM or SGLang).

Log-probs are *behavior* log-probs: `Completion.logprobs[j]` is the log of the
probability with which `completion_ids[j]` was drawn, i.e. under
softmax(logits / temperature) restricted to the top-k / top-p set and
renormalised. With `top_p=1, top_k=0` this is exactly what
`rljax.models.logprobs.sequence_logprobs(model, prompt + completion,
temperature=temperature)` computes on the trainer side, so the importance
ratio of an unchanged policy is 1. With truncation the recorded value is
larger than the trainer's (the kept mass is renormalised to one); that is the
probability the behavior policy really had. `temperature=0` is greedy decoding
(argmax); its log-probs are then those of the untempered, untruncated
softmax(logits), since the point mass it was "drawn" from carries no signal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample; one value for every prompt of a `generate` call.

    Attributes:
      max_new_tokens: completion tokens per row at most (finish_reason "length").
      temperature: divides the logits; 0 means greedy (argmax).
      top_p: nucleus sampling: keep the smallest set of most likely tokens whose
        probability (after temperature and top-k) reaches top_p; 1 = off.
      top_k: keep the k most likely tokens; 0 = off.
      stop_token_ids: a row stops after sampling one of these (finish_reason
        "stop"); the stop token is the last completion token.
      n: samples per prompt.
      seed: with the same seed, prompts and params, runs give the same tokens
        (so pass a new one each step, e.g. the step number). Row r of a call
        draws from fold_in(key(seed), r), independently of the other rows and
        of how rows are batched.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if int(self.max_new_tokens) < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not float(self.temperature) >= 0.0:  # also rejects NaN
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if int(self.top_k) < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if int(self.n) < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be non-negative, got {self.stop_token_ids}")

    def replace(self, **overrides) -> SamplingParams:
        return dataclasses.replace(self, **overrides)


@dataclasses.dataclass
class Completion:
    """One sampled row.

    Attributes:
      prompt_ids: the prompt's token ids.
      completion_ids: sampled ids; when a stop token was hit it is the last one.
      logprobs: one float per completion token, the behavior log-prob (module
        docstring).
      finish_reason: "stop" (a stop token or stop string) or "length".
      version: version of the weights that sampled this row.
      routing: MoE only, int32 [len(completion_ids), n_layers, k]: `routing[j]`
        are the experts of the forward pass that produced `logprobs[j]`, i.e.
        of the input token just before completion token j (the last prompt
        token for j = 0). On the [T] grid of `prompt + completion` (the
        trainer's `routing_BxTxLxK`, indexed by input token), it belongs at
        position `len(prompt_ids) - 1 + j`. None for dense models.
      prompt_routing: MoE only, int32 [len(prompt_ids), n_layers, k]: the
        prefill's experts for every prompt token (its last row equals
        routing[0]); with it the whole grid can be replayed. None otherwise
        (and from servers that do not report routing).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int
    routing: np.ndarray | None = None
    prompt_routing: np.ndarray | None = None


@runtime_checkable
class Sampler(Protocol):
    """What the trainer needs from a sampler, in process or behind HTTP."""

    version: int

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        """len(prompts) * n completions, prompt-major: the n samples of prompt i are
        rows i*n .. i*n+n-1 (the trainer's groups)."""
        ...

    def update_weights(self, state: Any, version: int) -> None:
        """Install new policy parameters (an nnx.State of the model's params) as `version`."""
        ...


class SamplerError(RuntimeError):
    """A sampler could not produce completions (server unreachable, bad reply)."""


class SamplerUnavailableError(SamplerError):
    """The server could not be reached, or kept failing, after every retry."""


class SamplerIncompatibleError(SamplerError, ValueError):
    """The server serves another model than the trainer's (vocabulary, parameter shapes, tokenizer, context)."""


class SamplerRequestError(SamplerError, ValueError):
    """The server rejected the request (HTTP 4xx); the message is the server's."""

    def __init__(self, message: str, status_code: int | None = None):
        super().__init__(message)
        self.status_code = status_code


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int | None = None) -> list[list[int]]:
    """Prompts as lists of python ints; ValueError on empty batches, empty prompts, bad ids."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) and not isinstance(prompts, np.ndarray):
        raise ValueError(f"prompts must be a sequence of token-id sequences, got {type(prompts).__name__}")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)):
            raise ValueError(f"prompt {i} is text; encode it to token ids first")
        ids = [int(t) for t in p]
        if not ids:
            raise ValueError(f"prompt {i} is empty; a prompt needs at least one token to condition on")
        bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size}): {bad[:5]}")
        out.append(ids)
    if not out:
        raise ValueError("generate() needs at least one prompt")
    return out
