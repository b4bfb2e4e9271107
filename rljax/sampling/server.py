"""`rljax serve`: the in-process sampler behind OpenAI- and vLLM-compatible HTTP APIs (FastAPI + uvicorn).

    rljax serve                                          # SmolLM2-135M-Instruct (the embedded default)
    rljax serve --config.model=tiny --config.port=8123   # a tiny random model, character tokenizer (tests)
    rljax serve --config my_serve.py                     # get_config() returning default_config(), edited

Endpoints (request and reply shapes: `rljax.sampling.protocol`, `.formats`):

- `POST /v1/completions`: OpenAI's legacy completions with vLLM's extensions;
  every choice carries `token_ids`, `prompt_token_ids` and, with
  `logprobs=N`, vLLM's `logprobs` object.
- `POST /v1/chat/completions`: the model's chat template; OpenAI's
  `logprobs` / `top_logprobs`; vLLM's `token_ids` / `prompt_token_ids`;
  `stream: true` as server-sent events (after sampling finishes: the
  sampler decodes whole rows), with `stream_options.include_usage` and a
  final `data: [DONE]`.
- `POST /inference/v1/generate`: vLLM's token-in / token-out endpoint
  (`{"token_ids", "sampling_params"}` -> `{"request_id", "prompt_token_ids",
  "choices": [{"token_ids", "finish_reason", "logprobs": {"content": ...}}]}`).
- `GET /v1/models` (max_model_len, vocab_size, parameter shapes, tokenizer
  fingerprint, weights_version), `GET /health` (queue and counters).
- `POST /update_weights {"path", "step"?, "version"?, "reset"?}` (admin):
  restores an orbax checkpoint written by `rljax.sampling.weights.save_params`.

Security: admin endpoints need `Authorization: Bearer <admin_token>` and read
only under `weights_root` (`rljax.sampling.admin`); without both they are
off. The server binds 127.0.0.1 by default; the sampling endpoints are
unauthenticated, so put it behind a proxy before binding another address.
Bodies over `max_request_bytes` are refused (413) before they are read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid

import fastapi
import ml_collections
import pydantic

from rljax.sampling import admin as admin_lib
from rljax.sampling import formats
from rljax.sampling import protocol as proto
from rljax.sampling.batching import Batcher, QueueFullError, SamplingFailed
from rljax.sampling.sampler import InProcessSampler
from rljax.sampling.weights import latest_step, load_params, params_signature

log = logging.getLogger("rljax.serve")

# Characters of the `model=tiny` tokenizer (plus pad, bos, eos).
TINY_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 =+-*/().,:;?!"


def default_config() -> ml_collections.ConfigDict:
    """Every `rljax serve` setting, field by field; `--config.FIELD=VALUE` overrides any of them."""
    c = ml_collections.ConfigDict()
    # What to serve.
    c.model = "smollm2-135m-instruct"  # "tiny", a load_pretrained source, or a path (.gguf / HF directory)
    c.served_model_name = ""  # the name in /v1/models and requests' `model`; "": `model`
    c.seed = 0  # initialisation of the tiny random model
    c.tokenizer_dir = ""  # if set, write the served tokenizer there as a Hugging Face directory at start-up
    # Where.
    c.host = "127.0.0.1"  # loopback only; the sampling endpoints have no authentication
    c.port = 8000
    c.log_level = "warning"  # python / uvicorn log level: debug, info, warning, error
    # Batching (static shapes of the compiled sampler).
    c.max_batch = 32  # rows per compiled batch (and per sampler call)
    c.prompt_buckets = ()  # padded prompt lengths; () = powers of two from 16 to the context
    c.completion_buckets = ()  # padded completion lengths; () = the same
    c.top_logprobs = 20  # the most alternatives per token a request may ask for (vLLM's max_logprobs)
    c.batch_wait_ms = 2.0  # after the first request of a batch, wait this long for others
    # Limits.
    c.max_queue = 64  # waiting requests before new ones get a 503
    c.max_n = 64  # largest `n` of one request
    c.max_rows_per_request = 1024  # prompts x n of one request
    c.max_request_bytes = 4 * 2**20  # larger bodies get a 413 before they are read
    # Admin (POST /update_weights): both are needed, or weight updates are refused.
    c.admin_token = ""  # bearer token; "": $RLJAX_ADMIN_TOKEN (prefer it: argv is visible to `ps`)
    c.weights_root = ""  # /update_weights reads only checkpoints under this directory
    c.lock()
    return c


_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def validate_config(config: ml_collections.ConfigDict) -> None:
    """ValueError naming the field and its valid range, for any setting `serve` cannot start with."""
    default = default_config()
    unknown = sorted(set(config) - set(default))
    missing = sorted(set(default) - set(config))
    if unknown or missing:
        raise ValueError(f"serve config: unknown settings {unknown}, missing settings {missing}; start from "
                         f"rljax.sampling.server.default_config() (valid: {', '.join(sorted(default))})")

    def integer(name, lo, hi=None):
        v = config[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
            raise ValueError(f"serve config {name}={v!r}: must be an integer in [{lo}, {hi if hi else 'inf'}]")

    integer("port", 0, 65535)
    integer("seed", 0, proto.SEED_MAX)
    integer("max_batch", 1, 4096)
    integer("top_logprobs", 0, 1024)
    integer("max_queue", 1)
    integer("max_n", 1, proto.INT32_MAX)
    integer("max_rows_per_request", 1, proto.INT32_MAX)
    integer("max_request_bytes", 1024)
    wait = config.batch_wait_ms
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not math.isfinite(wait) or not 0 <= wait <= 1e4:
        raise ValueError(f"serve config batch_wait_ms={wait!r}: must be a number of milliseconds in [0, 10000]")
    for name in ("prompt_buckets", "completion_buckets"):
        b = tuple(config[name])
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in b):
            raise ValueError(f"serve config {name}={b!r}: must be positive integer lengths (or () for the default)")
    if config.log_level.lower() not in _LOG_LEVELS:
        raise ValueError(f"serve config log_level={config.log_level!r}: choose one of {', '.join(_LOG_LEVELS)}")
    if not config.host or not config.model:
        raise ValueError("serve config: host and model must be non-empty")
    if config.weights_root:
        try:
            admin_lib.WeightsRoot(config.weights_root)
        except (OSError, ValueError):
            raise ValueError(f"serve config weights_root={config.weights_root!r}: not an existing directory") from None
        if not admin_lib.resolve_token(config.admin_token):
            raise ValueError(f"serve config weights_root needs an admin token: set admin_token or "
                             f"${admin_lib.ENV_TOKEN} (a long random string; the trainer sends the same)")


def build_tiny(seed: int = 0):
    """The `model=tiny` pair: a tiny random Decoder over a CharTokenizer's vocabulary."""
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


def build_server(config: ml_collections.ConfigDict):
    """(app, sampler) for a validated `config`: loads the model; compiles nothing until the first request."""
    model, tokenizer = load_model_and_tokenizer(config)
    if config.tokenizer_dir:
        from rljax.models.tokenizer_export import save_hf_tokenizer
        print(f"rljax serve: tokenizer written to {save_hf_tokenizer(tokenizer, config.tokenizer_dir)}", flush=True)
    sampler = InProcessSampler(model, prompt_buckets=tuple(config.prompt_buckets) or None,
                               completion_buckets=tuple(config.completion_buckets) or None,
                               max_batch=config.max_batch, top_logprobs=config.top_logprobs)
    return create_app(sampler, tokenizer, config), sampler


def serve(config: ml_collections.ConfigDict) -> None:
    """Validates `config`, builds the server and runs it with uvicorn until interrupted."""
    validate_config(config)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvicorn

    app, sampler = build_server(config)
    updates = "on" if config.weights_root else "off (no weights_root)"
    print(f"rljax serve: {config.served_model_name or config.model} (weights version {sampler.version}) on "
          f"http://{config.host}:{config.port}; weight updates {updates}", flush=True)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level.lower())


# ----------------------------------------------------------------------------
# The app.


class _TooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: a body over `max_bytes` is a 413, sent before the rest is read.

    A declared Content-Length is checked before reading anything; a chunked
    body is read only until it passes the limit. Accepted bodies are handed
    on whole, and later `receive()` calls reach the server's, so the app
    still hears a client disconnect.
    """

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, int(max_bytes)

    async def _refuse(self, send, status: int, message: str) -> None:
        import json
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": status}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        limit = f"request body is larger than this server's max_request_bytes={self.max_bytes}"
        if declared is not None:
            if not declared.isdigit():
                return await self._refuse(send, 400, "invalid Content-Length header")
            if int(declared) > self.max_bytes:
                return await self._refuse(send, 413, limit)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnected before the body ended
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send, 413, limit)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class _Disconnected(Exception):
    pass


async def _until_disconnected(request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _validation_message(e: pydantic.ValidationError) -> str:
    parts = []
    for err in e.errors()[:4]:
        if err.get("type") == "json_invalid":
            return f"invalid JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}"
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc or 'body'}: {err.get('msg', '').removeprefix('Value error, ')}")
    return "; ".join(parts) or "invalid request"


def create_app(sampler: InProcessSampler, tokenizer, config: ml_collections.ConfigDict):
    """The FastAPI app around `sampler` (a validated config); `tokenizer` needs encode / decode / eos_token_id
    and, for chat, apply_chat_template."""
    import jinja2
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    from rljax.models.tokenizer_export import tokenizer_summary

    model_name = config.served_model_name or config.model
    batcher = Batcher(sampler, max_queue=config.max_queue, max_rows=sampler.max_batch,
                      wait_s=config.batch_wait_ms / 1000)
    token = admin_lib.resolve_token(config.admin_token)
    root = admin_lib.WeightsRoot(config.weights_root) if config.weights_root else None
    versions = admin_lib.VersionState(sampler.version)
    limits = proto.Limits(vocab_size=sampler.config.vocab_size, context=sampler.config.max_seq_len,
                          max_completion=sampler.completion_buckets[-1], top_logprobs=sampler.top_logprobs,
                          max_n=config.max_n, max_rows=config.max_rows_per_request,
                          max_stop_ids=sampler.max_stop_ids, eos_token_id=getattr(tokenizer, "eos_token_id", None))
    shape_fields = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "n_experts",
                    "experts_per_token", "moe_mlp_dim", "tie_embeddings", "qkv_bias", "qk_norm", "rope_theta",
                    "rms_eps", "max_seq_len", "param_dtype")
    card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "rljax",
            "root": model_name, "parent": None, "max_model_len": limits.context, "vocab_size": limits.vocab_size,
            "model_config": {k: getattr(sampler.config, k) for k in shape_fields},
            "param_shapes": params_signature(sampler.params), "tokenizer": tokenizer_summary(tokenizer),
            "top_logprobs": limits.top_logprobs, "max_n": limits.max_n, "max_rows_per_request": limits.max_rows}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        batcher.start()
        yield
        await batcher.stop()

    app = fastapi.FastAPI(title="rljax sampler", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    app.state.batcher = batcher

    def error(status: int, message: str, kind: str = "invalid_request_error", headers=None):
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status,
                            headers=headers)

    @app.exception_handler(ValueError)
    async def _value_error(request, exc: ValueError):
        return error(400, str(exc))

    @app.exception_handler(admin_lib.AdminError)
    async def _admin_error(request, exc: admin_lib.AdminError):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return error(exc.status, exc.message, exc.kind, headers)

    @app.exception_handler(QueueFullError)
    async def _busy(request, exc):
        return error(503, str(exc), "ServiceUnavailableError", headers={"Retry-After": "1"})

    @app.exception_handler(SamplingFailed)
    async def _failed(request, exc):
        return error(500, f"sampling failed: {exc}", "InternalServerError")

    @app.exception_handler(_Disconnected)
    async def _gone(request, exc):
        return Response(status_code=499)  # nobody reads it: the client has left

    @app.exception_handler(Exception)
    async def _internal(request, exc):
        log.exception("internal error")
        return error(500, f"internal error ({type(exc).__name__}); see the server log", "InternalServerError")

    async def parse(request, model_cls):
        """The body as `model_cls` (400 naming the field otherwise); 404 when it names another model."""
        try:
            req = model_cls.model_validate_json(await request.body())
        except pydantic.ValidationError as e:
            raise ValueError(_validation_message(e)) from None
        name = getattr(req, "model", None)
        if name is not None and name != model_name:
            raise admin_lib.AdminError(404, f"model {name!r} does not exist; this server serves {model_name!r}",
                                       "NotFoundError")
        return req

    def check_top(n, field):
        if n is not None and n > limits.top_logprobs:
            raise ValueError(f"{field}: at most {limits.top_logprobs} alternatives per token (this server's "
                             f"top_logprobs), got {n}")

    async def sample(request, plan: proto.Plan) -> list[formats.Output]:
        """The plan's rows through the batcher; a disconnected client's rows stop being sampled."""
        seen = set()
        for row in plan.rows:  # buckets, ids, stop slots: one check per distinct prompt
            if row.prompt_ids not in seen:
                seen.add(row.prompt_ids)
                sampler.check_row(row)
        task = asyncio.ensure_future(batcher.generate(plan.rows))
        watch = asyncio.ensure_future(_until_disconnected(request))
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            log.info("client disconnected; %d rows dropped", len(plan.rows))
            raise _Disconnected
        watch.cancel()
        return [formats.finish(r, plan, tokenizer) for r in task.result()]

    @app.get("/health")
    async def health():
        counters = {k: v for k, v in vars(batcher.counters).items()}
        return {"status": "ok", "version": sampler.version, "queued": batcher.queued, **counters}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{**card, "weights_version": sampler.version}]}

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request):
        req = await parse(request, proto.CompletionRequest)
        if req.stream:
            raise ValueError("stream: not supported on /v1/completions; /v1/chat/completions streams")
        check_top(req.logprobs, "logprobs")
        prompts = proto.completion_prompts(req.prompt, tokenizer)
        plan = proto.plan_rows(prompts, req, req.max_tokens, limits, tokenizer)
        outputs = await sample(request, plan)
        choices = [formats.completion_choice(k, o, tokenizer, logprobs=req.logprobs,
                                             as_ids=req.return_tokens_as_token_ids, routing=req.return_routing)
                   for k, o in enumerate(outputs)]
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name, "choices": choices, "weights_version": outputs[0].result.completion.version,
                "usage": formats.usage(outputs, prompts)}

    def render(req: proto.ChatCompletionRequest) -> list[int]:
        messages = [m.for_template() for m in req.messages]
        kwargs = dict(req.chat_template_kwargs or {})
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt, **kwargs)
        except TypeError as e:
            raise ValueError(f"chat_template_kwargs: this model's chat template takes none ({e})") from None
        except jinja2.TemplateError as e:
            raise ValueError(f"messages: the chat template refused them: {e}") from None
        return list(tokenizer.encode(text))

    @app.post("/v1/chat/completions")
    async def chat(request: fastapi.Request):
        req = await parse(request, proto.ChatCompletionRequest)
        if req.tools:
            raise ValueError("tools: not supported by rljax serve (describe tools in the messages instead)")
        if req.tool_choice not in (None, "none", "auto"):
            raise ValueError(f"tool_choice: {req.tool_choice!r} needs tools, which rljax serve does not support")
        if req.response_format not in (None, {"type": "text"}):
            raise ValueError("response_format: only {'type': 'text'} is supported")
        if req.stream_options is not None and not req.stream:
            raise ValueError("stream_options: only allowed with stream: true")
        if req.stream_options is not None and req.stream_options.continuous_usage_stats:
            raise ValueError("stream_options.continuous_usage_stats: not supported (usage comes in the last chunk)")
        if None not in (req.max_tokens, req.max_completion_tokens) and req.max_tokens != req.max_completion_tokens:
            raise ValueError(f"max_tokens={req.max_tokens} and max_completion_tokens={req.max_completion_tokens} "
                             "disagree; send one")
        if req.top_logprobs and not req.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        check_top(req.top_logprobs, "top_logprobs")
        prompt = render(req)
        max_tokens = req.max_completion_tokens or req.max_tokens
        plan = proto.plan_rows([prompt], req, max_tokens, limits, tokenizer, what="messages (rendered)")
        outputs = await sample(request, plan)
        version = outputs[0].result.completion.version
        kw = dict(logprobs=req.logprobs, top=req.top_logprobs or 0, as_ids=req.return_tokens_as_token_ids)
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            events = formats.chat_stream(model_name, outputs, tokenizer, include_usage=include,
                                         skip_special_tokens=req.skip_special_tokens, version=version, **kw)
            return StreamingResponse(events, media_type="text/event-stream")
        return formats.chat_response(model_name, outputs, tokenizer, version=version, **kw)

    @app.post("/inference/v1/generate")
    async def generate(request: fastapi.Request):
        req = await parse(request, proto.GenerateRequest)
        sp = req.sampling_params
        if req.stream or req.stream_options is not None:
            raise ValueError("stream: not supported on /inference/v1/generate")
        if req.priority != 0:
            raise ValueError(f"priority: {req.priority} is not supported (no priority scheduling; only 0)")
        if sp.stop and not sp.detokenize:
            raise ValueError("stop: stop strings need detokenize: true (or use stop_token_ids)")
        check_top(sp.logprobs, "sampling_params.logprobs")
        plan = proto.plan_rows([list(req.token_ids)], sp, sp.max_tokens, limits, tokenizer, what="token_ids")
        outputs = await sample(request, plan)
        choices = [{"index": i, "token_ids": o.ids, "finish_reason": o.finish_reason, "stop_reason": o.stop_reason,
                    "logprobs": None if sp.logprobs is None else formats.generate_logprobs(o, sp.logprobs)}
                   for i, o in enumerate(outputs)]
        return {"request_id": req.request_id or f"generate-tokens-{uuid.uuid4().hex}",
                "prompt_token_ids": list(req.token_ids), "choices": choices,
                "usage": formats.usage(outputs, [list(req.token_ids)]), "prompt_logprobs": None,
                "kv_transfer_params": None, "weights_version": outputs[0].result.completion.version}

    @app.post("/update_weights")
    async def update_weights(request: fastapi.Request):
        # Authenticate before reading the body: an unauthenticated client learns nothing from validation.
        admin_lib.check_bearer(request.headers.get("authorization"), token)
        if root is None:
            raise admin_lib.AdminError(403, "weight updates are disabled on this server: start it with weights_root",
                                       "PermissionDeniedError")
        req = await parse(request, proto.UpdateWeightsRequest)
        directory = root.resolve(req.path)

        def load_and_swap():
            step = req.step if req.step is not None else latest_step(directory)
            if step is None:
                raise admin_lib.AdminError(404, f"path {req.path!r}: no finished checkpoint step", "NotFoundError")
            if (directory / str(step)).is_dir():  # (a missing step is load_params' 404)
                root.check_links(directory / str(step))
            source = (str(directory), int(step))
            version = versions.next(req.version, source, req.reset)
            try:
                params = load_params(directory, step, sampler.params)
                sampler.update_weights(params, version)
            except FileNotFoundError as e:
                raise admin_lib.AdminError(404, f"path {req.path!r}: {root.scrub(str(e))}", "NotFoundError") from None
            except ValueError as e:  # CheckpointError, or parameters the sampler refuses
                raise admin_lib.AdminError(422, f"path {req.path!r} step {step}: {root.scrub(str(e))}; the "
                                                f"served weights (version {versions.version}) are unchanged",
                                           "UnprocessableEntityError") from None
            versions.version, versions.source = version, source
            return version, step

        version, step = await batcher.exclusive(load_and_swap)
        log.info("weights from %s step %d are version %d", req.path, step, version)
        return {"version": version, "path": req.path, "step": step}

    return app
