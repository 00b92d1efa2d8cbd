"""HTTP front end: SGLang's native `/generate`, OpenAI's `/v1/completions` and `/v1/models`,
health, metrics, state.

Request bodies are validated before anything reaches the engine, and every error, whatever its
cause, has one shape: `{"error": {"message": ..., "param": <field or null>, "code": <status>}}`.
A bad request gets a 4xx whose message and `param` name the field at fault, and never disturbs
other requests. Sampling: a temperature below `GREEDY_TEMPERATURE_EPS` (1e-5) is greedy.

A client that disconnects before its answer is ready has its request aborted in the engine.

`/openapi.json` describes what the server does: 400 (not FastAPI's 422) for bad input, the
prompt and new-token limits of the engine's config, `/metrics` as Prometheus text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from starlette.exceptions import HTTPException

from engine_stub.engine import Engine
from engine_stub.model import GREEDY_TEMPERATURE_EPS, VOCAB_SIZE, decode_text, encode_text
from engine_stub.req import Req, RequestRejected

__all__ = ["MAX_NEW_TOKENS_LIMIT", "MODEL_ID", "create_app"]

MAX_NEW_TOKENS_LIMIT = 4096
REQUEST_TIMEOUT_S = 600.0
MODEL_ID = "engine-stub"
# nginx's "client closed request": never read by anyone, it only marks what happened.
CLIENT_GONE_STATUS = 499

TEMPERATURE_DOC = (f"0 is greedy, and so is anything below {GREEDY_TEMPERATURE_EPS:g}; above it, "
                   "seeded sampling. Must be finite.")


def _valid_unicode(value: str) -> str:
    # JSON may carry a lone surrogate (`"\ud800"`), which has no UTF-8 encoding.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode: a lone surrogate at position {exc.start}") from None
    return value


def _integral(value: Any) -> Any:
    # JSON Schema's integer includes 140.0; strict validation then still refuses true and "140".
    return int(value) if isinstance(value, float) and value.is_integer() else value


Text = Annotated[str, AfterValidator(_valid_unicode)]
Int = Annotated[int, BeforeValidator(_integral)]
# The constraint before the validator: after it, pydantic leaves it out of the JSON Schema.
TokenId = Annotated[int, Field(ge=0, lt=VOCAB_SIZE), BeforeValidator(_integral)]
PromptText = Annotated[Text, Field(min_length=1, description="UTF-8 bytes are the tokens.")]
PromptIds = Annotated[list[TokenId], Field(min_length=1)]


class _Body(BaseModel):
    # Strict, as the schema says: "5" is not a number, 1 is not true, true is not a token id.
    model_config = ConfigDict(extra="forbid", strict=True)


class SamplingParams(_Body):
    max_new_tokens: Int = Field(16, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    temperature: float = Field(0.0, ge=0.0, le=10.0, allow_inf_nan=False, description=TEMPERATURE_DOC)


class GenerateRequest(_Body):
    """SGLang's native request: exactly one of `text` and `input_ids` (null counts as absent)."""

    model_config = ConfigDict(json_schema_extra={
        "oneOf": [{"required": ["text"], "properties": {"text": {"type": "string"}}},
                  {"required": ["input_ids"], "properties": {"input_ids": {"type": "array"}}}],
        "examples": [{"text": "hello", "sampling_params": {"max_new_tokens": 8}},
                     {"input_ids": [104, 105], "sampling_params": {"max_new_tokens": 4, "temperature": 0.7}}],
    })
    text: PromptText | None = None
    input_ids: PromptIds | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    rid: Annotated[Text, Field(min_length=1, max_length=128)] | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' and 'input_ids'")
        return self


def _json_equal(value: Any, neutral: Any) -> bool:
    # JSON equality: 1.0 is 1, but true is not 1 (Python's True == 1 would say it is).
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


def _unimplemented(*neutral: Any) -> Any:
    """A field the engine does not implement: accepted only at values that leave the answer as
    it would be without the field."""
    allowed = " or ".join(json.dumps(n) for n in neutral)

    def check(value: Any) -> Any:
        if not any(_json_equal(value, n) for n in neutral):
            raise ValueError(f"not supported by this engine (only {allowed} is accepted)")
        return value

    return Annotated[Any, AfterValidator(check),
                     WithJsonSchema({"enum": list(neutral), "description": "Not supported: only "
                                     f"{allowed}, which leaves the answer unchanged."})]


class CompletionRequest(_Body):
    """OpenAI's completions request. Fields the engine does not implement are accepted only at
    their neutral values; any other field is rejected, never ignored."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"model": MODEL_ID, "prompt": "hello", "max_tokens": 8},
        {"prompt": [104, 105], "max_tokens": 4, "echo": True},
    ]})

    model: Text = MODEL_ID
    prompt: PromptText | PromptIds
    max_tokens: Int = Field(16, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    temperature: float = Field(0.0, ge=0.0, le=10.0, allow_inf_nan=False, description=TEMPERATURE_DOC)
    n: Int = Field(1, ge=1, le=1)
    stream: _unimplemented(None, False) = None
    echo: bool = Field(False, description="Prepend the prompt to the completion's text.")
    user: Text | None = None
    suffix: _unimplemented(None, "") = None
    top_p: _unimplemented(None, 1) = None
    best_of: _unimplemented(None, 1) = None
    stop: _unimplemented(None, []) = None
    presence_penalty: _unimplemented(None, 0) = None
    frequency_penalty: _unimplemented(None, 0) = None
    logit_bias: _unimplemented(None, {}) = None
    # Even logprobs=0 asks for the chosen tokens' log probabilities, which the engine lacks.
    logprobs: _unimplemented(None) = None
    seed: _unimplemented(None) = None
    stream_options: _unimplemented(None) = None


# ---- responses -----------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """Every error the server answers, whatever its status."""

    error: ErrorDetail


class FinishReason(BaseModel):
    type: str
    length: int


class MetaInfo(BaseModel):
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: FinishReason
    admitted_step: int
    finished_step: int


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None
    finish_reason: str


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class GateHold(_Body):
    """The harness's driver holds `rid` back until `waits_for` is answered (a follow-up turn)."""

    rid: Annotated[Text, Field(min_length=1, max_length=128)]
    waits_for: Annotated[Text, Field(min_length=1, max_length=128)]


class GateSkip(_Body):
    """The harness's driver will never send `rid`."""

    rid: Annotated[Text, Field(min_length=1, max_length=128)]


class GateHangUp(_Body):
    """The harness's client for `rid` hangs up once `rid` has `after_tokens` output tokens."""

    rid: Annotated[Text, Field(min_length=1, max_length=128)]
    after_tokens: Int = Field(ge=1, le=MAX_NEW_TOKENS_LIMIT)


class GateHangUpWait(_Body):
    """Wait until the engine pauses for `rid`'s planned hang-up."""

    rid: Annotated[Text, Field(min_length=1, max_length=128)]
    timeout_s: Annotated[float, Field(gt=0, le=120)] = 60.0


class HealthResponse(BaseModel):
    status: Literal["ok"]


# ---- errors --------------------------------------------------------------------------------------


def _printable(text: str) -> str:
    # An error may quote the request (a field name), and a lone surrogate there cannot be sent.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _error(status: int, message: str, param: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    detail = {"message": _printable(message), "param": None if param is None else _printable(param),
              "code": status}
    return JSONResponse(status_code=status, content={"error": detail}, headers=headers)


def _field_path(loc: tuple | list) -> str | None:
    """`body.prompt.list[...].0` -> `prompt.0`: drop "body" and pydantic's union-branch labels."""
    parts = [str(p) for p in loc[1:] if not (isinstance(p, str) and ("[" in p or p == "str"))]
    return ".".join(parts) or None


def _validation_error(errors: list[dict], body_model: type[BaseModel] | None) -> JSONResponse:
    # The most specific error first: for a union (a prompt of text or ids) that is the branch
    # that got furthest, e.g. `prompt.0` out of range rather than `prompt` not a string.
    first = max(errors, key=lambda e: len(e.get("loc", ())), default={})
    kind, loc = first.get("type"), tuple(first.get("loc", ()))
    if kind == "json_invalid":
        return _error(400, "malformed JSON body")
    if loc == ("body",) and kind == "missing" and body_model is not None:
        # No body at all: say which fields are missing, as for `{}`.
        try:
            body_model.model_validate({})
        except ValidationError as exc:
            return _validation_error([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()], None)
    if loc == ("body",) and kind in ("model_type", "model_attributes_type"):
        return _error(400, "the request body must be a JSON object (Content-Type: application/json)")
    field = _field_path(loc)
    reason = first.get("msg", "invalid request").removeprefix("Value error, ")
    if kind in ("too_short", "string_too_short") and first.get("ctx", {}).get("min_length") == 1:
        reason = "must not be empty"
    if kind == "string_unicode" and field is None:
        reason = "a field name is not valid Unicode (a lone surrogate)"
    return _error(400, f"{field}: {reason}" if field else reason, field)


def _rejected(exc: RequestRejected, fields: dict[str, str]) -> JSONResponse:
    """The engine's rejection, in this endpoint's field names (`fields`: engine name -> ours)."""
    if exc.param not in fields:  # e.g. rid: the same name everywhere
        return _error(400, f"{exc.param}: {exc}", exc.param)
    param = fields[exc.param]
    message = str(exc).replace("max_new_tokens", fields["max_new_tokens"])
    return _error(400, f"{param}: {message}", param)


def _largest(fits: Callable[[int], bool], hi: int) -> int:
    """The largest n in [1, hi] with fits(n) (monotone: true up to some n), or 0."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _fits(engine: Engine, prompt_len: int, max_new_tokens: int) -> bool:
    try:
        engine.scheduler.check_fits(prompt_len, max_new_tokens)
    except RequestRejected:
        return False
    return True


def _document_limits(doc: dict, engine: Engine) -> None:
    """Write the limits of the engine's config into the OpenAPI document, in place."""
    cfg = engine.config
    max_prompt = _largest(lambda n: _fits(engine, n, 1), cfg.max_context_len)
    max_new = _largest(lambda n: _fits(engine, 1, n), MAX_NEW_TOKENS_LIMIT)
    rule = (f" This engine: a prompt of at most {max_prompt} tokens (text: its UTF-8 bytes), and "
            f"prompt tokens + {{}} <= max_context_len={cfg.max_context_len}; a request beyond "
            "either limit gets a 400 naming the field.")
    schemas = doc["components"]["schemas"]
    limits = {"GenerateRequest": {"text": max_prompt, "input_ids": max_prompt},
              "SamplingParams": {"max_new_tokens": max_new},
              "CompletionRequest": {"prompt": max_prompt, "max_tokens": max_new}}
    bound = {"string": "maxLength", "array": "maxItems", "integer": "maximum"}
    for name, props in limits.items():
        for prop, limit in props.items():
            schema = schemas[name]["properties"][prop]
            for branch in schema.get("anyOf", [schema]):  # e.g. text or ids, or null
                if branch.get("type") in bound:
                    branch[bound[branch["type"]]] = limit
    schemas["GenerateRequest"]["description"] += rule.format("sampling_params.max_new_tokens")
    schemas["CompletionRequest"]["description"] += rule.format("max_tokens")


# ---- the app -------------------------------------------------------------------------------------


def create_app(engine: Engine) -> FastAPI:
    """The FastAPI app over a started `engine`; stops the engine (draining) on shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)

    error_doc = {"model": ErrorResponse, "description": "An error, in the one error shape."}
    app = FastAPI(title="engine_stub", lifespan=lifespan, responses={"default": error_doc})
    bad_request = {400: {"model": ErrorResponse, "description": "Bad input: the message and "
                         "`param` name the field."}}
    body_models = {"/generate": GenerateRequest, "/v1/completions": CompletionRequest}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            _document_limits(FastAPI.openapi(app), engine)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(RequestValidationError)
    async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(list(exc.errors()), body_models.get(request.url.path))

    @app.exception_handler(HTTPException)
    async def _on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = str(exc.detail)
        if isinstance(exc.__cause__, UnicodeDecodeError):
            message = "the request body is not valid UTF-8"
        return _error(exc.status_code, message, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _on_server_error(request: Request, exc: Exception) -> JSONResponse:
        return _error(500, f"internal error: {type(exc).__name__}")

    async def _client_gone(request: Request) -> None:
        """Return when the client disconnects. The body has been read by now, so the next
        message is the disconnect (or, after the response, its end)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def _run(request: Request, input_ids: list[int], max_new_tokens: int, temperature: float,
                   rid: str | None, fields: dict[str, str]) -> Req | JSONResponse:
        """Submit and await the result; abort the request if its client goes away first."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Req] = loop.create_future()

        def on_finish(req: Req) -> None:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(req))

        try:
            req = engine.submit(input_ids, max_new_tokens, temperature=temperature, rid=rid,
                                on_finish=on_finish)
        except RequestRejected as exc:
            return _rejected(exc, fields)
        except RuntimeError as exc:
            return _error(503, str(exc))
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({done, gone}, timeout=REQUEST_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            client_left = gone.done()
            gone.cancel()
            if not done.done():  # the client left, the wait timed out, or this handler was cancelled
                engine.abort(req.rid)
        if not done.done():
            if client_left:
                return _error(CLIENT_GONE_STATUS, "the client disconnected; the request was aborted")
            return _error(504, f"no result within {REQUEST_TIMEOUT_S:.0f}s; the request was aborted")
        req = done.result()
        if req.finish_reason == "engine_crashed":
            return _error(500, "the engine crashed while serving this request")
        if req.finish_reason == "abort":
            return _error(503, "the request was aborted by the engine")
        return req

    @app.post("/generate", response_model=GenerateResponse, responses=bad_request)
    async def generate(body: GenerateRequest, request: Request) -> Any:
        """SGLang's native generation: `text` or `input_ids`, and `sampling_params`."""
        prompt_field = "text" if body.text is not None else "input_ids"
        ids = encode_text(body.text) if body.text is not None else list(body.input_ids or ())
        params = body.sampling_params
        fields = {"prompt": prompt_field, "max_new_tokens": "sampling_params.max_new_tokens"}
        req = await _run(request, ids, params.max_new_tokens, params.temperature, body.rid, fields)
        if isinstance(req, JSONResponse):
            return req
        return {
            "text": decode_text(req.output_ids),
            "output_ids": req.output_ids,
            "meta_info": {
                "id": req.rid,
                "prompt_tokens": req.prompt_len,
                "completion_tokens": len(req.output_ids),
                "cached_tokens": req.cache_protected_len,
                "finish_reason": {"type": req.finish_reason, "length": len(req.output_ids)},
                "admitted_step": req.admitted_step,
                "finished_step": req.finished_step,
            },
        }

    @app.post("/v1/completions", response_model=CompletionResponse, responses=bad_request)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        """OpenAI's completions (no streaming, one choice)."""
        ids = encode_text(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        fields = {"prompt": "prompt", "max_new_tokens": "max_tokens"}
        req = await _run(request, ids, body.max_tokens, body.temperature, None, fields)
        if isinstance(req, JSONResponse):
            return req
        # Decoded together, so a UTF-8 character split across the boundary comes out whole.
        text = decode_text(ids + req.output_ids if body.echo else req.output_ids)
        return {
            "id": f"cmpl-{req.rid}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": req.finish_reason}],
            "usage": {"prompt_tokens": req.prompt_len, "completion_tokens": len(req.output_ids),
                      "total_tokens": req.prompt_len + len(req.output_ids)},
        }

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> Any:
        """OpenAI's model list: the one model this engine serves."""
        return {"object": "list", "data": [{"id": MODEL_ID, "object": "model", "created": 0,
                                            "owned_by": "engine_stub"}]}

    @app.get("/health", response_model=HealthResponse, responses={503: error_doc})
    async def health() -> Any:
        """200 while the engine serves; 503 once it crashed."""
        if engine.crash is not None:
            return _error(503, f"engine crashed: {engine.crash['cause']}")
        return {"status": "ok"}

    @app.post("/gate/hold", status_code=204, responses=bad_request)
    async def gate_hold(body: GateHold) -> None:
        """Lockstep gate (harness only): count `rid` as in flight until `waits_for` is answered."""
        engine.hold(body.rid, body.waits_for)

    @app.post("/gate/skip", status_code=204, responses=bad_request)
    async def gate_skip(body: GateSkip) -> None:
        """Lockstep gate (harness only): `rid` will never be sent; stop counting it as owed."""
        engine.skip(body.rid)

    @app.post("/gate/hang_up", status_code=204, responses=bad_request)
    async def gate_hang_up(body: GateHangUp) -> None:
        """Lockstep gate (harness only): pause once `rid` has `after_tokens` tokens, until its
        client has hung up."""
        engine.hang_up_at(body.rid, body.after_tokens)

    @app.post("/gate/hang_up/wait", response_model=dict[str, bool], responses=bad_request)
    async def gate_hang_up_wait(body: GateHangUpWait) -> Any:
        """Lockstep gate (harness only): `{"ready": true}` once the engine waits for `rid`'s
        client to hang up; false if `rid` finished first or the engine stopped."""
        ready = await asyncio.get_running_loop().run_in_executor(
            None, engine.wait_hang_up, body.rid, body.timeout_s)
        return {"ready": ready}

    @app.get("/progress", response_model=dict[str, int])
    async def progress() -> Any:
        """Steps, generated tokens, received and completed requests: lock-free and sync-free
        (a harness's watchdog polls it to tell a slow engine from a stalled one)."""
        return engine.progress()

    @app.get("/state", response_model=dict[str, Any])
    async def state() -> Any:
        """Pools, idle ledgers, invariant hits, canary counters, exercise stats, config."""
        return await asyncio.get_running_loop().run_in_executor(None, engine.state)

    # Spelled out: with a plain-text route, FastAPI would document its JSON errors as text/plain.
    json_error = {"description": error_doc["description"], "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition format 0.0.4."},
                        "default": json_error})
    async def metrics() -> PlainTextResponse:
        """Prometheus metrics (text/plain)."""
        snapshot = await asyncio.get_running_loop().run_in_executor(None, engine.state)
        return PlainTextResponse(_prometheus(snapshot), media_type="text/plain; version=0.0.4")

    return app


def _prometheus(state: dict) -> str:
    lines = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> None:
        lines.append(f"# HELP engine_stub_{name} {help_text}")
        lines.append(f"# TYPE engine_stub_{name} {kind}")
        for labels, value in samples:
            label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
            lines.append(f"engine_stub_{name}{{{label_text}}} {value}" if label_text else f"engine_stub_{name} {value}")

    pools = state["pools"]
    metric("pool_size_tokens", "gauge", "Slots per pool.",
           [({"pool": p}, pools[p]["size"]) for p in ("full", "swa", "req_rows")])
    metric("pool_available_tokens", "gauge", "Free slots per pool.",
           [({"pool": p}, pools[p]["available"]) for p in ("full", "swa", "req_rows")])
    metric("invariant_hits_total", "counter", "Invariant firings by name.",
           [({"invariant": k}, v) for k, v in sorted(state["invariant_hits"].items())])
    metric("kv_canary_violations_total", "counter", "KV canary violations.",
           [({}, state["kv_canary"]["violations"])])
    metric("steps_total", "counter", "Engine steps.", [({}, state["step"])])
    metric("generated_tokens_total", "counter", "Tokens generated.", [({}, state["stats"]["generated_tokens"])])
    metric("prompt_tokens_total", "counter", "Prompt tokens admitted.", [({}, state["stats"]["prompt_tokens"])])
    metric("requests_running", "gauge", "Requests running.", [({}, state["running"])])
    metric("requests_waiting", "gauge", "Requests waiting.", [({}, state["waiting"])])
    return "\n".join(lines) + "\n"
