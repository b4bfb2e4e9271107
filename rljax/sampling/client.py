"""RemoteSampler: the `Sampler` interface over an OpenAI-compatible completions server.

Works against `rljax serve`, vLLM and SGLang. Requests send token-id prompts
and ask for token ids and per-token log-probs (`logprobs=0`,
`return_token_ids`, `return_tokens_as_token_ids`), with `ignore_eos` so rows
stop only on the caller's `stop_token_ids`.

Behavior log-probs: our server records them after temperature and top-k/top-p
(see `rljax.sampling.types`). vLLM returns raw-model log-probs by default;
start it with `--logprobs-mode processed_logprobs` to get the sampling
distribution's. Weight pushes (`update_weights`) use our server's
`POST /update_weights`; vLLM and SGLang need their own weight sync.

Failures: connection errors, timeouts and 5xx answers (503 = queue full) are
retried `retries` times with exponential backoff, then raise
`SamplerUnavailableError` naming the URL and the last error; a 4xx raises
`SamplerRequestError` with the server's message at once; a reply that does not
parse as completions raises `SamplerError`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from rljax.sampling.types import (Completion, SamplerError, SamplerRequestError, SamplerUnavailableError,
                                  SamplingParams, check_prompts)

log = logging.getLogger(__name__)


def _error_message(response) -> str:
    """The server's message from OpenAI / vLLM / FastAPI error bodies, else the raw text."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "detail" in body:
            return str(body["detail"])
        if "message" in body:
            return str(body["message"])
    return str(body)[:500]


class RemoteSampler:
    """`RemoteSampler(url, sync_dir=..., timeout=..., retries=...)`: the Sampler interface over HTTP.

    Args:
      url: server root, e.g. "http://127.0.0.1:8000" (a trailing "/v1" is accepted).
      sync_dir: directory (shared with the server) where update_weights writes
        orbax checkpoints; required only for update_weights.
      timeout: seconds for one HTTP request (generation included).
      retries: extra attempts after a connection error, timeout or 5xx.
      backoff: seconds before the first retry; doubles each time.
      tokenizer: only a fallback to recover ids from text, for servers that
        return neither `token_ids` nor `token_id:N` tokens.
      model: model name to request; default: the first of GET /v1/models.
      version: version of the weights the server starts with.
    """

    def __init__(self, url: str, *, sync_dir: str | os.PathLike | None = None, timeout: float = 600.0,
                 retries: int = 3, backoff: float = 0.5, tokenizer=None, model: str | None = None,
                 version: int = 0, connect_timeout: float = 5.0):
        import httpx

        if retries < 0 or timeout <= 0 or backoff < 0:
            raise ValueError(f"need retries >= 0, timeout > 0, backoff >= 0; got {retries}, {timeout}, {backoff}")
        url = url.rstrip("/")
        self.url = url[:-3] if url.endswith("/v1") else url
        self.sync_dir = None if sync_dir is None else os.path.abspath(os.fspath(sync_dir))
        self.retries, self.backoff = int(retries), float(backoff)
        self.tokenizer = tokenizer
        self.model_name = model
        self.version = int(version)
        self._httpx = httpx
        self._client = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout, connect=min(connect_timeout,
                                                                                                  timeout)))

    def close(self) -> None:
        self._client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ HTTP

    def request(self, method: str, path: str, body: dict | None = None) -> dict:
        """JSON request with retries (module docstring); returns the decoded JSON object."""
        last: str = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = self._client.request(method, path, json=body)
            except self._httpx.TransportError as e:  # refused, reset, timed out, server died mid-reply
                last = f"{type(e).__name__}: {e}"
                log.warning("%s %s%s failed (attempt %d/%d): %s", method, self.url, path, attempt + 1,
                            self.retries + 1, last)
                continue
            if response.status_code >= 500:
                last = f"HTTP {response.status_code}: {_error_message(response)}"
                log.warning("%s %s%s: %s (attempt %d/%d)", method, self.url, path, last, attempt + 1,
                            self.retries + 1)
                continue
            if response.status_code >= 400:
                raise SamplerRequestError(f"{method} {self.url}{path} -> HTTP {response.status_code}: "
                                          f"{_error_message(response)}", response.status_code)
            try:
                result = response.json()
            except ValueError:
                raise SamplerError(f"{method} {self.url}{path} returned non-JSON: {response.text[:200]!r}") from None
            if not isinstance(result, dict):
                raise SamplerError(f"{method} {self.url}{path} returned {type(result).__name__}, not an object")
            return result
        raise SamplerUnavailableError(f"could not get an answer from the sampler at {self.url}{path} after "
                                      f"{self.retries + 1} attempts; last error: {last}")

    def health(self) -> dict:
        return self.request("GET", "/health")

    def _model(self) -> str:
        if self.model_name is None:
            data = self.request("GET", "/v1/models").get("data") or []
            if not data or "id" not in data[0]:
                raise SamplerError(f"{self.url}/v1/models lists no model")
            self.model_name = str(data[0]["id"])
        return self.model_name

    # ------------------------------------------------------------------ Sampler

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        """len(prompts) * n completions, prompt-major, from one POST /v1/completions."""
        prompts = check_prompts(prompts)
        body: dict[str, Any] = {
            "model": self._model(), "prompt": prompts, "n": params.n, "max_tokens": params.max_new_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "seed": params.seed, "logprobs": 0,
            "stop_token_ids": list(params.stop_token_ids), "ignore_eos": True, "skip_special_tokens": False,
            "return_token_ids": True, "return_tokens_as_token_ids": True,
        }
        if params.top_k:
            body["top_k"] = params.top_k
        reply = self.request("POST", "/v1/completions", body)
        return self._parse(reply, prompts, params)

    def _parse(self, reply: dict, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        choices = reply.get("choices")
        expected = len(prompts) * params.n
        if not isinstance(choices, list) or len(choices) != expected:
            got = len(choices) if isinstance(choices, list) else type(choices).__name__
            raise SamplerError(f"{self.url} returned {got} choices for {len(prompts)} prompts x n={params.n}")
        version = int(reply.get("weights_version", self.version))
        out = []
        for k, choice in enumerate(sorted(choices, key=lambda c: c.get("index", 0))):
            if choice.get("index", k) != k:
                raise SamplerError(f"{self.url} returned choice indices {[c.get('index') for c in choices]}")
            ids = self._token_ids(choice)
            lp = (choice.get("logprobs") or {}).get("token_logprobs")
            if lp is None or len(lp) != len(ids) or any(x is None or not math.isfinite(x) for x in lp):
                raise SamplerError(f"{self.url} choice {k}: need one finite log-prob per token, got {lp!r:.200} "
                                   f"for {len(ids)} tokens")
            finish = choice.get("finish_reason")
            if finish not in ("stop", "length"):
                raise SamplerError(f"{self.url} choice {k}: finish_reason {finish!r}")
            routing = choice.get("routing")
            prompt_routing = choice.get("prompt_routing")
            out.append(Completion(
                prompt_ids=list(prompts[k // params.n]), completion_ids=ids, logprobs=[float(x) for x in lp],
                finish_reason=finish, version=version,
                routing=None if routing is None else np.asarray(routing, np.int32),
                prompt_routing=None if prompt_routing is None else np.asarray(prompt_routing, np.int32)))
        return out

    def _token_ids(self, choice: dict) -> list[int]:
        if isinstance(choice.get("token_ids"), list):
            return [int(t) for t in choice["token_ids"]]
        tokens = (choice.get("logprobs") or {}).get("tokens")
        if tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
            return [int(t.split(":", 1)[1]) for t in tokens]
        if self.tokenizer is not None and "text" in choice:
            log.warning("server returned no token ids; re-encoding the text (log-probs may not align)")
            return list(self.tokenizer.encode(choice["text"]))
        raise SamplerError(f"{self.url} returned no token ids (need vLLM's return_token_ids or "
                           "return_tokens_as_token_ids, or a tokenizer)")

    def update_weights(self, state, version: int) -> None:
        """Saves `state` as orbax checkpoint `version` under sync_dir and has the server load it."""
        if self.sync_dir is None:
            raise ValueError("RemoteSampler.update_weights needs sync_dir=<a directory the server can read>")
        from rljax.sampling.weights import save_params

        save_params(state, self.sync_dir, int(version), keep=2)
        reply = self.request("POST", "/update_weights", {"path": self.sync_dir, "step": int(version),
                                                         "version": int(version)})
        self.version = int(reply.get("version", version))
