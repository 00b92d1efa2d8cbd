"""HTTP front end: SGLang's native `/generate`, OpenAI's `/v1/completions`, health, metrics, state.

Request bodies are validated before anything reaches the engine: a bad request gets a 4xx whose
body names the field and the reason, and never disturbs other requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine_stub.engine import Engine
from engine_stub.model import VOCAB_SIZE, decode_text, encode_text
from engine_stub.req import Req, RequestRejected

__all__ = ["create_app"]

MAX_NEW_TOKENS_LIMIT = 4096
REQUEST_TIMEOUT_S = 600.0

# Strict: JSON true or 1.0 is not a token id (lax mode would take them as 1).
TokenId = Annotated[int, Field(ge=0, lt=VOCAB_SIZE, strict=True)]


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int = Field(16, ge=1, le=MAX_NEW_TOKENS_LIMIT, strict=True)
    temperature: float = Field(0.0, ge=0.0, le=10.0)


class GenerateRequest(BaseModel):
    """SGLang's native request: exactly one of `text` and `input_ids`."""

    model_config = ConfigDict(extra="forbid")
    text: str | None = None
    input_ids: list[TokenId] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    rid: str | None = Field(None, min_length=1, max_length=128)

    @field_validator("text", "input_ids")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if value is not None and not value:
            raise ValueError("the prompt is empty")
        return value

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' and 'input_ids'")
        return self


class CompletionRequest(BaseModel):
    """OpenAI's completions request (the fields the engine honours; others are ignored)."""

    model_config = ConfigDict(extra="ignore")
    model: str = "engine-stub"
    prompt: str | list[TokenId]
    max_tokens: int = Field(16, ge=1, le=MAX_NEW_TOKENS_LIMIT, strict=True)
    temperature: float = Field(0.0, ge=0.0, le=10.0)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if not value:
            raise ValueError("the prompt is empty")
        return value

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, value: bool) -> bool:
        if value:
            raise ValueError("stream=true is not supported")
        return value


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "param": param,
                                                               "code": status}})


def create_app(engine: Engine) -> FastAPI:
    """The FastAPI app over a started `engine`; stops the engine (draining) on shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)

    app = FastAPI(title="engine_stub", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # The most specific error first: for a union (a prompt of text or ids) that is the branch
        # that got furthest, e.g. `prompt.0` out of range rather than `prompt` not a string.
        first = max(exc.errors(), key=lambda e: len(e.get("loc", ())), default={})
        # Drop "body" and pydantic's union-branch labels ("str", "list[...]") from the location.
        loc = ".".join(str(part) for part in first.get("loc", ())
                       if part not in ("body", "str") and not str(part).startswith("list["))
        reason = first.get("msg", "invalid request").removeprefix("Value error, ")
        if first.get("type") == "json_invalid":
            reason, loc = "malformed JSON body", None
        return _error(400, f"{loc}: {reason}" if loc else reason, loc or None)

    async def _run(input_ids: list[int], max_new_tokens: int, temperature: float, rid: str | None) -> Req | JSONResponse:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Req] = loop.create_future()

        def on_finish(req: Req) -> None:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(req))

        try:
            engine.submit(input_ids, max_new_tokens, temperature=temperature, rid=rid, on_finish=on_finish)
        except RequestRejected as exc:
            return _error(400, str(exc), exc.param)
        except RuntimeError as exc:
            return _error(503, str(exc))
        try:
            req = await asyncio.wait_for(done, REQUEST_TIMEOUT_S)
        except asyncio.TimeoutError:
            return _error(504, f"no result within {REQUEST_TIMEOUT_S:.0f}s")
        if req.finish_reason == "engine_crashed":
            return _error(500, "the engine crashed while serving this request")
        return req

    @app.post("/generate")
    async def generate(body: GenerateRequest) -> Any:
        ids = body.input_ids if body.input_ids is not None else encode_text(body.text or "")
        params = body.sampling_params
        req = await _run(ids, params.max_new_tokens, params.temperature, body.rid)
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

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        ids = encode_text(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        req = await _run(ids, body.max_tokens, body.temperature, None)
        if isinstance(req, JSONResponse):
            return req
        return {
            "id": f"cmpl-{req.rid}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model,
            "choices": [{"index": 0, "text": decode_text(req.output_ids), "logprobs": None,
                         "finish_reason": req.finish_reason}],
            "usage": {"prompt_tokens": req.prompt_len, "completion_tokens": len(req.output_ids),
                      "total_tokens": req.prompt_len + len(req.output_ids)},
        }

    @app.get("/health")
    async def health() -> Any:
        if engine.crash is not None:
            return _error(503, f"engine crashed: {engine.crash['cause']}")
        return {"status": "ok"}

    @app.get("/state")
    async def state() -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, engine.state)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
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
