"""Sampling: the in-process KV-cache sampler, the HTTP server around it, and a client for it.

The trainer codes against one interface, `Sampler`:

    sampler.generate(prompts, SamplingParams(max_new_tokens=64, n=8, seed=step))
        -> list[Completion]   # len(prompts) * n rows, prompt-major
    sampler.update_weights(nnx.state(model, nnx.Param), version=step)

`InProcessSampler(model)` runs it in this process (jitted prefill + decode
loop, length buckets, weight swaps without recompiling); `RemoteSampler(url)`
talks to `rljax serve`, vLLM or SGLang over the OpenAI completions API
(`check_compatible` at start-up, retries within a time budget, weight pushes
with the admin token). `rljax serve` (`rljax.sampling.server`) also speaks
OpenAI chat completions and vLLM's `/inference/v1/generate`.
`Completion.logprobs` are behavior log-probs: see `rljax.sampling.types`.
"""

from rljax.sampling.client import RemoteSampler
from rljax.sampling.sampler import InProcessSampler
from rljax.sampling.types import Completion
from rljax.sampling.types import Sampler
from rljax.sampling.types import SamplerError
from rljax.sampling.types import SamplerIncompatibleError
from rljax.sampling.types import SamplerRequestError
from rljax.sampling.types import SamplerUnavailableError
from rljax.sampling.types import SamplingParams

__all__ = [
    "Completion",
    "InProcessSampler",
    "RemoteSampler",
    "Sampler",
    "SamplerError",
    "SamplerIncompatibleError",
    "SamplerRequestError",
    "SamplerUnavailableError",
    "SamplingParams",
]
