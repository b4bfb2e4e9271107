"""`rljax serve`: the in-process sampler behind an OpenAI-compatible HTTP API (FastAPI + uvicorn).

    rljax serve                                  # SmolLM2-135M-Instruct (the embedded default)
    rljax serve --model tiny --port 8123         # a tiny random model, character tokenizer (tests)
    rljax serve --config my_serve.py             # get_config() -> fields of default_config()

Endpoints:

- `POST /v1/completions`: OpenAI's legacy completions with vLLM's extensions
  (`top_k`, `stop_token_ids`, `ignore_eos`, `return_token_ids`,
  `return_tokens_as_token_ids`, ...). Every choice carries `token_ids`,
  `prompt_token_ids` and, with `logprobs=N`, vLLM's `logprobs` object
  (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`); the response
  carries `weights_version`. Log-probs are behavior log-probs (after
  temperature and top-k/top-p renormalisation; see `rljax.sampling.types`).
  `return_routing: true` adds the MoE routing of each choice. Unknown fields,
  bad values, unparseable JSON and prompts that do not fit the context are a
  400 with a message.
- `GET /v1/models`, `GET /health`.
- `POST /update_weights {"path", "step", "version"?}`: restores the orbax
  checkpoint written by `rljax.sampling.weights.save_params` and bumps the
  version (to `version` when given).

Requests that arrive while a batch is running are queued and sampled together
as the next batch (each row keeps its own settings and seed); when
`max_queue` requests are waiting, new ones get a 503.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import runpy
import secrets
import time
import uuid
from typing import Any

import ml_collections
import pydantic

from rljax.sampling.sampler import InProcessSampler, Row, RowResult
from rljax.sampling.weights import load_params

log = logging.getLogger("rljax.serve")

# Characters of the `--model tiny` tokenizer (plus pad, bos, eos).
TINY_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 =+-*/().,:;?!"


def default_config() -> ml_collections.ConfigDict:
    """Every `rljax serve` setting; a `--config` file's get_config() overrides any of them."""
    c = ml_collections.ConfigDict()
    c.model = "smollm2-135m-instruct"  # "tiny", a load_pretrained source, or a path (.gguf / HF directory)
    c.served_model_name = ""  # name in /v1/models and the `model` field; default: `model`
    c.host = "127.0.0.1"
    c.port = 8000
    c.seed = 0  # initialisation of the tiny random model
    c.max_batch = 32  # rows per compiled batch
    c.max_queue = 64  # waiting requests before 503
    c.batch_wait_ms = 2.0  # after the first request of a batch, wait this long for others
    c.top_logprobs = 5  # the largest `logprobs=N` served (a static shape of the sampler)
    c.prompt_buckets = ()  # () = powers of two from 16 to the context
    c.completion_buckets = ()
    c.max_n = 64  # largest `n` per request
    c.lock()
    return c


def build_tiny(seed: int = 0):
    """The `--model tiny` pair: a tiny random Decoder over a CharTokenizer's vocabulary."""
    from flax import nnx

    from rljax.models.config import get_preset
    from rljax.models.transformer import Decoder
    from rljax.tasks.toy import CharTokenizer

    tokenizer = CharTokenizer(TINY_CHARS)
    model = Decoder(get_preset("tiny", vocab_size=tokenizer.vocab_size), rngs=nnx.Rngs(seed))
    return model, tokenizer


def load_model_and_tokenizer(config: ml_collections.ConfigDict):
    if config.model == "tiny":
        return build_tiny(config.seed)
    from rljax.models.loading import load_pretrained
    return load_pretrained(config.model)


# ----------------------------------------------------------------------------
# Batching.


class QueueFullError(RuntimeError):
    pass


@dataclasses.dataclass
class _Pending:
    rows: list[Row]
    future: asyncio.Future


class Batcher:
    """Runs sampler work on one thread; requests waiting meanwhile form the next batch.

    The single worker thread also serialises weight updates with generation,
    so a batch is never sampled with half-swapped weights.
    """

    def __init__(self, sampler: InProcessSampler, *, max_queue: int, max_rows: int, wait_s: float):
        self.sampler = sampler
        self.max_queue, self.max_rows, self.wait_s = max_queue, max_rows, wait_s
        self._pending: collections.deque[_Pending] = collections.deque()
        self._wakeup: asyncio.Event | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sampler")
        self._task: asyncio.Task | None = None
        # Counters for /health: batches run, requests answered, rows being sampled now.
        self.batches = self.requests = self.running_rows = 0

    @property
    def queued(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def generate(self, rows: list[Row]) -> list[RowResult]:
        if len(self._pending) >= self.max_queue:
            raise QueueFullError(f"server busy: {len(self._pending)} requests are queued (max_queue="
                                 f"{self.max_queue}); retry later")
        item = _Pending(rows, asyncio.get_running_loop().create_future())
        self._pending.append(item)
        self._wakeup.set()
        return await item.future

    async def run_exclusive(self, fn, *args):
        """fn(*args) on the sampler thread, between batches."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _run(self):
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if self.wait_s:
                await asyncio.sleep(self.wait_s)
            while self._pending:
                batch, n_rows = [], 0
                while self._pending and (not batch or n_rows + len(self._pending[0].rows) <= self.max_rows):
                    item = self._pending.popleft()
                    if not item.future.done():  # a disconnected client's future is cancelled
                        batch.append(item)
                        n_rows += len(item.rows)
                if not batch:
                    continue
                rows = [r for item in batch for r in item.rows]
                self.running_rows = len(rows)
                try:
                    results = await self.run_exclusive(self.sampler.generate_rows, rows)
                except Exception as e:  # noqa: BLE001 - handed to every waiting request
                    self.running_rows = 0
                    log.exception("sampling failed")
                    for item in batch:
                        if not item.future.done():
                            item.future.set_exception(e)
                    continue
                self.running_rows = 0
                self.batches += 1
                self.requests += len(batch)
                start = 0
                for item in batch:
                    if not item.future.done():
                        item.future.set_result(results[start:start + len(item.rows)])
                    start += len(item.rows)


# ----------------------------------------------------------------------------
# The app.


class CompletionRequest(pydantic.BaseModel):
    """POST /v1/completions: OpenAI's fields and vLLM's extensions; anything else is a 400."""

    model_config = pydantic.ConfigDict(extra="forbid")

    prompt: str | list[str] | list[list[int]] | list[int]
    model: str | None = None
    max_tokens: int = pydantic.Field(16, ge=1)
    temperature: float = pydantic.Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = pydantic.Field(1.0, gt=0.0, le=1.0)
    top_k: int = pydantic.Field(0, ge=-1)  # vLLM's -1 and 0 both mean off
    n: int = pydantic.Field(1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[pydantic.NonNegativeInt] | None = None
    seed: int | None = None  # None: a fresh random seed
    logprobs: int | None = pydantic.Field(None, ge=0)
    echo: bool = False
    stream: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool = False
    return_routing: bool = False
    user: str | None = None


class UpdateWeightsRequest(pydantic.BaseModel):
    """POST /update_weights: an orbax checkpoint directory written by weights.save_params."""

    model_config = pydantic.ConfigDict(extra="forbid")

    path: str
    step: int | None = None  # None: the latest step
    version: int | None = None  # None: current version + 1




def create_app(sampler: InProcessSampler, tokenizer, model_name: str, *, max_queue: int = 64,
               max_rows: int | None = None, batch_wait_s: float = 0.002, max_n: int = 64):
    """The FastAPI app around `sampler`; `tokenizer` needs encode / decode / eos_token_id."""
    import fastapi
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    batcher = Batcher(sampler, max_queue=max_queue, max_rows=max_rows or sampler.max_batch, wait_s=batch_wait_s)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        batcher.start()
        yield
        await batcher.stop()

    app = fastapi.FastAPI(title="rljax sampler", lifespan=lifespan)

    def error(status: int, message: str, kind: str = "invalid_request_error", headers=None):
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status,
                            headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        parts = []
        for e in exc.errors():
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            if e.get("type") == "json_invalid":
                parts.append(f"invalid JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}")
            else:
                parts.append(f"{loc or 'body'}: {e.get('msg')}")
        return error(400, "; ".join(parts) or "invalid request")

    @app.exception_handler(ValueError)
    async def _value_error(request, exc: ValueError):
        return error(400, str(exc))

    @app.get("/health")
    async def health():
        return {"status": "ok", "version": sampler.version, "queued": batcher.queued,
                "running_rows": batcher.running_rows, "batches": batcher.batches, "requests": batcher.requests}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "rljax",
            "max_model_len": sampler.config.max_seq_len, "weights_version": sampler.version}]}

    @app.post("/update_weights")
    async def update_weights(req: UpdateWeightsRequest):
        def load_and_swap():
            params = load_params(req.path, req.step, sampler.params)
            version = sampler.version + 1 if req.version is None else req.version
            sampler.update_weights(params, version)
            return version

        version = await batcher.run_exclusive(load_and_swap)
        log.info("weights from %s step %s are version %d", req.path, req.step, version)
        return {"version": version, "path": req.path, "step": req.step}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        if req.model is not None and req.model != model_name:
            return error(404, f"model {req.model!r} does not exist; this server serves {model_name!r}",
                         "NotFoundError")
        if req.stream or req.echo:
            raise ValueError("stream and echo are not supported")
        if req.n > max_n:
            raise ValueError(f"n: {req.n} is more than this server's max_n={max_n}")
        if req.logprobs is not None and req.logprobs > sampler.top_logprobs:
            raise ValueError(f"logprobs: at most {sampler.top_logprobs} alternatives per token, got {req.logprobs}")
        prompts = _prompt_ids(req.prompt, tokenizer)
        stop_strings = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        stop_ids = set(req.stop_token_ids or [])
        if not req.ignore_eos and getattr(tokenizer, "eos_token_id", None) is not None:
            stop_ids.add(int(tokenizer.eos_token_id))
        for s in stop_strings:  # one-token stop strings also end the row inside the decode loop
            try:
                ids = tokenizer.encode(s)
            except ValueError:  # not encodable (CharTokenizer): still matched on the text
                ids = []
            if len(ids) == 1:
                stop_ids.add(ids[0])
        seed = secrets.randbits(31) if req.seed is None else req.seed
        rows = [Row(tuple(p), req.max_tokens, req.temperature, req.top_p, max(req.top_k, 0),
                    tuple(sorted(stop_ids)), seed, i * req.n + j)
                for i, p in enumerate(prompts) for j in range(req.n)]
        for i, row in enumerate(rows[::req.n]):
            try:
                sampler.check_row(row)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        try:
            results = await batcher.generate(rows)
        except QueueFullError as e:
            return error(503, str(e), "ServiceUnavailableError", headers={"Retry-After": "1"})
        version = results[0].completion.version
        choices = [_choice(k, r, req, tokenizer, stop_strings, stop_ids) for k, r in enumerate(results)]
        n_prompt = sum(len(p) for p in prompts)
        n_completion = sum(len(c["token_ids"]) for c in choices)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name, "choices": choices, "weights_version": version,
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
                          "total_tokens": n_prompt + n_completion}}

    app.state.batcher = batcher
    return app


def _prompt_ids(prompt, tokenizer) -> list[list[int]]:
    """OpenAI's four prompt forms (text, texts, ids, list of ids) as lists of ids."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise ValueError("prompt is empty")
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    out = []
    for i, p in enumerate(prompt):
        ids = tokenizer.encode(p) if isinstance(p, str) else list(p)
        if not ids:
            raise ValueError(f"prompt {i} is empty; a prompt needs at least one token")
        out.append(ids)
    return out


def _decode(tokenizer, ids, skip_special_tokens: bool) -> str:
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def _choice(index: int, result: RowResult, req, tokenizer, stop_strings, stop_ids) -> dict[str, Any]:
    """One OpenAI / vLLM completion choice; stop strings cut the row where its text first contains one."""
    c = result.completion
    ids, logps, finish, stop_reason = list(c.completion_ids), list(c.logprobs), c.finish_reason, None
    text_end = None
    if stop_strings:
        for k in range(1, len(ids) + 1):
            text = _decode(tokenizer, ids[:k], req.skip_special_tokens)
            hits = [(text.find(s), s) for s in stop_strings if s in text]
            if hits:
                pos, s = min(hits)
                ids, logps, finish, stop_reason = ids[:k], logps[:k], "stop", s
                text_end = pos + len(s) if req.include_stop_str_in_output else pos
                break
    if stop_reason is None and finish == "stop" and ids and ids[-1] in stop_ids:
        stop_reason = ids[-1]
        text = _decode(tokenizer, ids if req.include_stop_str_in_output else ids[:-1], req.skip_special_tokens)
    else:
        text = _decode(tokenizer, ids, req.skip_special_tokens)
    if text_end is not None:
        text = text[:text_end]
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason,
              "token_ids": ids, "prompt_token_ids": list(c.prompt_ids)}
    if req.logprobs is not None:
        choice["logprobs"] = _logprobs_object(ids, logps, result, req, tokenizer)
    if req.return_routing and c.routing is not None:
        choice["routing"] = c.routing[:len(ids)].tolist()
        choice["prompt_routing"] = c.prompt_routing.tolist()
    return choice


def _logprobs_object(ids, logps, result: RowResult, req, tokenizer) -> dict[str, Any]:
    """vLLM's completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""

    def name(token_id):
        if req.return_tokens_as_token_ids:
            return f"token_id:{int(token_id)}"
        return _decode(tokenizer, [token_id], False)

    tokens = [name(t) for t in ids]
    top = []
    for j, (t, lp) in enumerate(zip(ids, logps)):
        alternatives = {}
        if req.logprobs and result.top_ids is not None:
            for a, alp in zip(result.top_ids[j, :req.logprobs], result.top_logprobs[j, :req.logprobs]):
                if math.isfinite(float(alp)):  # truncated tokens have -inf: not JSON, and not alternatives
                    alternatives[name(a)] = float(alp)
        alternatives[name(t)] = float(lp)
        top.append(alternatives)
    offsets, offset = [], 0
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [float(x) for x in logps], "top_logprobs": top,
            "text_offset": offsets}


# ----------------------------------------------------------------------------
# Command line.


def load_config(path: str | None) -> ml_collections.ConfigDict:
    """default_config() updated from `path`'s get_config() (a ConfigDict or dict); unknown keys fail."""
    config = default_config()
    if path:
        module = runpy.run_path(path)
        if "get_config" not in module:
            raise ValueError(f"{path} has no get_config()")
        overrides = module["get_config"]()
        items = overrides.items() if hasattr(overrides, "items") else ()
        for key, value in items:
            if key not in config:
                raise ValueError(f"{path}: unknown serve setting {key!r}; valid: {', '.join(sorted(config))}")
            setattr(config, key, value)
    return config


def build_server(config: ml_collections.ConfigDict):
    """(app, sampler) for `config`: loads the model, compiles nothing until the first request."""
    model, tokenizer = load_model_and_tokenizer(config)
    sampler = InProcessSampler(model, prompt_buckets=tuple(config.prompt_buckets) or None,
                               completion_buckets=tuple(config.completion_buckets) or None,
                               max_batch=config.max_batch, top_logprobs=config.top_logprobs)
    app = create_app(sampler, tokenizer, config.served_model_name or config.model, max_queue=config.max_queue,
                     batch_wait_s=config.batch_wait_ms / 1000, max_n=config.max_n)
    return app, sampler


def cli_main(argv: list[str]) -> None:
    """`rljax serve [--config PATH] [--port N] [--host H] [--model NAME]`; argv[0] is the program name."""
    parser = argparse.ArgumentParser(prog="rljax serve", description="Serve the sampler over HTTP.")
    parser.add_argument("--config", help="python file whose get_config() overrides default_config()")
    parser.add_argument("--port", type=int)
    parser.add_argument("--host")
    parser.add_argument("--model", help='"tiny", "smollm2-135m-instruct", a .gguf file or a HF directory')
    parser.add_argument("--max-batch", type=int)
    parser.add_argument("--max-queue", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv[1:])
    config = load_config(args.config)
    for key in ("port", "host", "model", "max_batch", "max_queue", "seed"):
        if getattr(args, key) is not None:
            setattr(config, key, getattr(args, key))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")

    import uvicorn

    app, sampler = build_server(config)
    print(f"rljax serve: {config.served_model_name or config.model} (weights version {sampler.version}) on "
          f"http://{config.host}:{config.port}", flush=True)
    uvicorn.run(app, host=config.host, port=config.port, log_level=args.log_level)
