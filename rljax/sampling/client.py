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
retried with exponential backoff (`backoff`, doubling, capped at
`max_backoff`, at least a 503's Retry-After) for up to `retry_timeout`
seconds in all, long enough for a model server to restart; then
`SamplerUnavailableError` names the URL, the attempts and the last error. A
4xx raises `SamplerRequestError` with the server's message at once; a reply
that does not parse as completions raises `SamplerError`.

Start-up checks: `model_info()` is the server's `/v1/models` entry (vocab
size, context, parameter shapes, tokenizer fingerprint, weights version);
`check_compatible(model, tokenizer=...)` raises `SamplerIncompatibleError`
listing every mismatch, so a wrong server fails before the first step.

Admin: `update_weights` sends `Authorization: Bearer <admin_token>` (default
`$RLJAX_ADMIN_TOKEN`), the token `rljax serve` was started with.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from rljax.sampling.admin import ENV_TOKEN
from rljax.sampling.types import (Completion, SamplerError, SamplerIncompatibleError, SamplerRequestError,
                                  SamplerUnavailableError, SamplingParams, check_prompts)

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
    """`RemoteSampler(url, sync_dir=..., timeout=..., retry_timeout=...)`: the Sampler interface over HTTP.

    Args:
      url: server root, e.g. "http://127.0.0.1:8000" (a trailing "/v1" is accepted).
      sync_dir: directory (shared with the server, under its weights_root)
        where update_weights writes orbax checkpoints; needed only for it.
      timeout: seconds for one HTTP request (generation included).
      retry_timeout: seconds, in all, to keep retrying connection errors,
        timeouts and 5xx answers (default 120: a model server's restart).
      backoff: seconds before the first retry; doubles each time...
      max_backoff: ...up to this many seconds between attempts.
      retries: at most this many retries (None: as many as retry_timeout allows).
      tokenizer: only a fallback to recover ids from text, for servers that
        return neither `token_ids` nor `token_id:N` tokens.
      model: model name to request; default: the first of GET /v1/models.
      version: version of the weights the server starts with.
      admin_token: bearer token for /update_weights (default $RLJAX_ADMIN_TOKEN).
    """

    def __init__(self, url: str, *, sync_dir: str | os.PathLike | None = None, timeout: float = 600.0,
                 retry_timeout: float = 120.0, backoff: float = 0.5, max_backoff: float = 10.0,
                 retries: int | None = None, tokenizer=None, model: str | None = None, version: int = 0,
                 connect_timeout: float = 5.0, admin_token: str | None = None):
        import httpx

        for name, value in (("timeout", timeout), ("connect_timeout", connect_timeout)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"RemoteSampler {name} must be a positive number of seconds, got {value!r}")
        for name, value in (("retry_timeout", retry_timeout), ("backoff", backoff), ("max_backoff", max_backoff)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"RemoteSampler {name} must be a number of seconds >= 0, got {value!r}")
        if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int) or retries < 0):
            raise ValueError(f"RemoteSampler retries must be None or an int >= 0, got {retries!r}")
        url = url.rstrip("/")
        self.url = url[:-3] if url.endswith("/v1") else url
        self.sync_dir = None if sync_dir is None else os.path.abspath(os.fspath(sync_dir))
        self.retry_timeout, self.backoff, self.max_backoff = float(retry_timeout), float(backoff), float(max_backoff)
        self.retries = retries
        self.tokenizer = tokenizer
        self.model_name = model
        self.version = int(version)
        self.admin_token = os.environ.get(ENV_TOKEN, "") if admin_token is None else admin_token
        self._pushed = False  # the first push of a process may reset the server's version (a resume)
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

    def _delay(self, attempt: int, response=None) -> float:
        delay = min(self.max_backoff, self.backoff * 2 ** (attempt - 1))
        retry_after = response.headers.get("retry-after") if response is not None else None
        if retry_after and retry_after.isdigit():
            delay = max(delay, min(float(retry_after), self.max_backoff))
        return delay

    def request(self, method: str, path: str, body: dict | None = None, *, admin: bool = False) -> dict:
        """JSON request with retries (module docstring); returns the decoded JSON object."""
        headers = {"Authorization": f"Bearer {self.admin_token}"} if admin and self.admin_token else None
        start = time.monotonic()
        attempt, last = 0, ""
        while True:
            attempt += 1
            response = None
            try:
                response = self._client.request(method, path, json=body, headers=headers)
            except self._httpx.TransportError as e:  # refused, reset, timed out, server died mid-reply
                last = f"{type(e).__name__}: {e}"
            else:
                if response.status_code < 500:
                    return self._decode(method, path, response)
                last = f"HTTP {response.status_code}: {_error_message(response)}"
            delay = self._delay(attempt, response)
            elapsed = time.monotonic() - start
            if (self.retries is not None and attempt > self.retries) or elapsed + delay > self.retry_timeout:
                raise SamplerUnavailableError(
                    f"could not get an answer from the sampler at {self.url}{path} after {attempt} attempts over "
                    f"{elapsed:.1f}s (retry_timeout={self.retry_timeout:g}s); last error: {last}")
            log.warning("%s %s%s failed (attempt %d, retrying in %.1fs): %s", method, self.url, path, attempt,
                        delay, last)
            time.sleep(delay)

    def _decode(self, method: str, path: str, response) -> dict:
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

    def health(self) -> dict:
        return self.request("GET", "/health")

    def _model(self) -> str:
        if self.model_name is None:
            self.model_name = str(self.model_info()["id"])
        return self.model_name

    def model_info(self) -> dict:
        """The server's GET /v1/models entry for our model (the first one when none was named).

        From `rljax serve`: id, max_model_len, vocab_size, weights_version,
        model_config (shape fields), param_shapes ({path: [dtype, shape]}),
        tokenizer ({vocab_size, bos/eos/pad ids, fingerprint}). vLLM and
        SGLang report a subset (id, max_model_len).
        """
        data = self.request("GET", "/v1/models").get("data")
        if not isinstance(data, list) or not data or not all(isinstance(d, dict) and "id" in d for d in data):
            raise SamplerError(f"{self.url}/v1/models lists no model")
        if self.model_name is None:
            return data[0]
        for entry in data:
            if entry["id"] == self.model_name:
                return entry
        raise SamplerIncompatibleError(f"{self.url} does not serve model {self.model_name!r}; it serves "
                                       f"{[d['id'] for d in data]}")

    def check_compatible(self, model=None, *, tokenizer=None, max_total_tokens: int | None = None) -> dict:
        """Raises SamplerIncompatibleError unless the server can sample for `model` / `tokenizer`.

        Compares what the server reports (a field it does not report is not
        checked): vocabulary size, every parameter's path, dtype and shape
        (so `update_weights` will fit), the tokenizer's fingerprint and
        special ids, and `max_total_tokens` (longest prompt + completion the
        trainer will ask for) against the server's context. Returns
        `model_info()`.
        """
        info = self.model_info()
        problems: list[str] = []
        if model is not None:
            from rljax.sampling.weights import params_signature, signature_differences

            vocab = int(model.config.vocab_size)
            if info.get("vocab_size") is not None and int(info["vocab_size"]) != vocab:
                problems.append(f"vocab_size: the server's model has {info['vocab_size']}, the trainer's {vocab}")
            if isinstance(info.get("param_shapes"), dict):
                problems += signature_differences(params_signature(model), info["param_shapes"])
        if tokenizer is not None and isinstance(info.get("tokenizer"), dict):
            from rljax.models.tokenizer_export import tokenizer_fingerprint, tokenizer_summary

            theirs, ours = info["tokenizer"], tokenizer_summary(tokenizer)
            for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
                if key in theirs and theirs[key] != ours[key]:
                    problems.append(f"tokenizer {key}: the server's is {theirs[key]}, the trainer's {ours[key]}")
            if theirs.get("fingerprint") and theirs["fingerprint"] != tokenizer_fingerprint(tokenizer):
                problems.append("tokenizer: vocabulary, merges or chat template differ (fingerprints differ)")
        if max_total_tokens is not None and info.get("max_model_len") is not None and \
                int(max_total_tokens) > int(info["max_model_len"]):
            problems.append(f"context: the trainer needs {max_total_tokens} tokens per row, the server's "
                            f"max_model_len is {info['max_model_len']}")
        if problems:
            raise SamplerIncompatibleError(f"the sampler at {self.url} (model {info.get('id')!r}) does not match the "
                                           "trainer: " + "; ".join(problems))
        return info

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
        """Saves `state` as a fresh orbax step under sync_dir and has the server load it as `version`.

        Every push writes a new step number (one above the newest in
        sync_dir), never into an existing step: a resumed trainer re-pushing
        version v cannot collide with what an earlier process left there,
        and the server never reads a directory that is being replaced
        (orbax commits a step by an atomic rename). The newest two steps are
        kept. The first push of this sampler sends `reset: true`, so a
        restarted trainer may install an older version than the server
        holds; later pushes must increase it.
        """
        if self.sync_dir is None:
            raise ValueError("RemoteSampler.update_weights needs sync_dir=<a directory the server can read>")
        from rljax.sampling.weights import latest_step, save_params

        step = (latest_step(self.sync_dir) or 0) + 1
        save_params(state, self.sync_dir, step, keep=2)
        body = {"path": self.sync_dir, "step": step, "version": int(version)}
        if not self._pushed:
            body["reset"] = True
        reply = self.request("POST", "/update_weights", body, admin=True)
        self._pushed = True
        self.version = int(reply.get("version", version))
