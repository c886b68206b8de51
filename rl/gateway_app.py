"""The token-in-token-out gateway's HTTP app (FastAPI): ``POST /generate``, ``GET /health``.

Tokens in, tokens out, never text: training sees exactly the sampled actions and their
log-probabilities. A request names a ``session_id``; the session sticks to one worker
(:class:`~glmport.rl.gateway.HashRing`) whose cache continues or forks it
(:class:`~glmport.rl.sessions.SessionStore`).

Every request is checked before it reaches a worker: sent as ``application/json`` (415:
``text/plain``, form and multipart bodies are what a browser may POST cross-origin
without a preflight, so any web page could otherwise drive a loopback gateway), the body
bounded (413), JSON (400), an object with exactly the known fields of the right strict
types (422 naming the field: no ``"1"`` strings, floats or booleans for ints), token ids
inside the vocabulary, lengths inside the limits and sampling parameters inside
:mod:`glmport.model.sampling`'s ranges (422 naming them). Errors are JSON
``{"detail": "..."}``; a bad request touches no worker, so it never disturbs the others.
With a ``token`` every request needs ``Authorization: Bearer <token>`` (401). The OpenAPI
schema (``/openapi.json``) is served only when asked (``openapi=True``).

This module imports FastAPI; glmport imports it only to serve.
"""

from __future__ import annotations

import asyncio
import hmac
import logging

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from glmport.core.errors import ConfigError, GlmportError, check_int

from .gateway import HashRing, WorkerUnavailable
from .sessions import check_request, session_sampling

log = logging.getLogger(__name__)

# Body limit by default: room for a full context of ids (10 digits and a separator each)
# plus the other fields.
BYTES_PER_TOKEN, BODY_OVERHEAD_BYTES = 12, 64 << 10
MAX_NEW_TOKENS = 1024
MAX_STOP_TOKENS = 64
MAX_ID_CHARS = 256
REQUEST_TIMEOUT_S = 300.0
MAX_ERRORS_SHOWN = 5


class GenerateRequest(BaseModel):
    """``POST /generate``'s body. ``input_ids``: the session's whole token list so far.
    ``temperature`` 0: greedy (argmax, log-probabilities at temperature 1); else sampling
    at ``temperature`` in ``[1e-6, 1e6]`` with ``top_k`` (0: off), ``top_p`` in ``(0, 1]``
    (1: off) and ``seed`` (none: unseeded; else 64 bits), checked by
    :func:`~glmport.rl.sessions.session_sampling`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input_ids: list[int] = Field(min_length=1)
    session_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    request_id: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    max_new_tokens: int = Field(ge=1)
    # Types only: their ranges are check_sampling's (one rule for every caller).
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_tokens: list[int] = Field(default_factory=list, max_length=MAX_STOP_TOKENS)

    def sampling(self) -> dict:
        """The ``sampling`` dict of ``RolloutWorker.serve``."""
        return self.model_dump(
            include={"max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_tokens"}
        )


def _validation_message(err: ValidationError) -> tuple[int, str]:
    """(HTTP status, one line naming each problem's field) of a body that failed to parse."""
    errors = err.errors(include_url=False)
    if errors and errors[0]["type"] == "json_invalid":
        return 400, f"invalid JSON: {errors[0]['ctx']['error']}"
    parts = []
    for e in errors[:MAX_ERRORS_SHOWN]:
        field = ".".join(str(x) for x in e["loc"]) or "body"
        if e["type"] == "extra_forbidden":
            parts.append(f"unknown field {field!r}")
        elif e["type"] == "missing":
            parts.append(f"{field}: required")
        else:
            shown = repr(e["input"])
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            parts.append(f"{field}: {e['msg']} (got {shown})")
    more = len(errors) - MAX_ERRORS_SHOWN
    return 422, "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def check_token(token: str, source: str) -> str:
    """``token`` when it can be a bearer token: non-empty printable ASCII without spaces
    at its ends (what a client can send and the server compares). Anything else is a
    :class:`~glmport.core.errors.ConfigError` naming ``source``, never "no auth"."""
    if not isinstance(token, str) or not token:
        raise ConfigError(
            f"{source}: the gateway token must not be empty (an empty token would mean no "
            "authentication; to serve loopback without one, do not set it)"
        )
    if not (token.isascii() and token.isprintable()) or token != token.strip():
        raise ConfigError(
            f"{source}: the gateway token must be printable ASCII without spaces at its "
            "ends (it travels in an Authorization header)"
        )
    return token


def _is_json(content_type: str | None) -> bool:
    """Whether a Content-Type header is ``application/json`` (charset, if given, UTF-8)."""
    media, *params = (content_type or "").split(";")
    if media.strip().lower() != "application/json":
        return False
    for param in params:
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset" and value.strip().strip('"').lower() != "utf-8":
            return False
    return True


def create_app(
    pool,
    *,
    token: str | None = None,
    max_body_bytes: int | None = None,
    max_new_tokens_limit: int = MAX_NEW_TOKENS,
    request_timeout_s: float = REQUEST_TIMEOUT_S,
    openapi: bool = False,
) -> FastAPI:
    """The gateway app in front of ``pool`` (a :class:`~glmport.rl.gateway.LocalPool` or
    :class:`~glmport.rl.gateway.RayPool`).

    Args:
        pool: the workers; sessions map to them by consistent hashing on ``session_id``.
        token: when set, every request needs ``Authorization: Bearer <token>``
            (:func:`check_token`: an empty token is refused, never "no auth").
        max_body_bytes: larger request bodies get 413 (default: 12 bytes per position of
            the context, plus 64 KiB).
        max_new_tokens_limit: ``max_new_tokens`` above it gets 422 (the context limit
            ``input + max_new_tokens <= max_position_embeddings`` holds as well).
        request_timeout_s: a request a worker has not answered by then gets 504.
        openapi: serve the OpenAPI schema at ``/openapi.json`` (off: it describes the
            service to anyone who can reach it, and no client needs it).
    """
    if token is not None:
        check_token(token, "create_app: token")
    if max_body_bytes is None:
        max_body_bytes = BYTES_PER_TOKEN * pool.max_positions + BODY_OVERHEAD_BYTES
    for name, value in (
        ("max_body_bytes", max_body_bytes),
        ("max_new_tokens_limit", max_new_tokens_limit),
    ):
        check_int(f"create_app: {name}", value, 1)
    app = FastAPI(
        title="glmport token-in-token-out gateway",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json" if openapi else None,
    )
    ring = HashRing(range(pool.size))
    app.state.pool, app.state.ring = pool, ring
    expected = None if token is None else token.encode()

    @app.middleware("http")
    async def bearer_auth(request: Request, call_next):
        if expected is not None:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not given:
                return _error(401, "missing bearer token: send 'Authorization: Bearer <token>'")
            if not hmac.compare_digest(given.strip().encode(), expected):
                return _error(401, "wrong bearer token")
        return await call_next(request)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        return _error(err.status_code, str(err.detail))

    @app.get("/health")
    async def health() -> dict:
        workers = await pool.health()
        ok = all(w["alive"] is not False for w in workers)
        return {"status": "ok" if ok else "degraded", "workers": workers}

    @app.post("/generate")
    async def generate(request: Request):
        content_type = request.headers.get("content-type")
        if not _is_json(content_type):
            shown = "none" if content_type is None else repr(content_type[:60])
            return _error(415, f"Content-Type must be application/json, got {shown}")
        body = await _read_body(request, max_body_bytes)
        try:
            req = GenerateRequest.model_validate_json(body)
        except ValidationError as err:
            return _error(*_validation_message(err))
        problem = _check_limits(req, pool, max_new_tokens_limit)
        if problem:
            return _error(422, problem)
        worker = ring.node_for(req.session_id)
        try:
            out = await asyncio.wait_for(
                pool.serve(worker, req.session_id, req.input_ids, req.sampling()),
                request_timeout_s,
            )
        except WorkerUnavailable as err:
            return _error(503, str(err))
        except GlmportError as err:  # a worker refused what passed the checks here
            return _error(422, str(err))
        except asyncio.TimeoutError:
            return _error(504, f"worker {worker} did not answer within {request_timeout_s:g} s")
        except Exception as err:
            log.exception("gateway: request %s failed on worker %d", req.request_id, worker)
            return _error(500, f"internal error on worker {worker}: {type(err).__name__}")
        return {
            "output_ids": out["output_ids"],
            "output_logprobs": out["output_logprobs"],
            "policy_version": out["policy_version"],
            "request_id": req.request_id,
            "session_id": req.session_id,
            "worker": worker,
            "cached_tokens": out["cached_tokens"],
        }

    return app


def _error(status: int, detail: str) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past ``limit`` bytes without reading the rest."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise HTTPException(400, f"bad Content-Length header {length[:40]!r}")
        if int(length) > limit:
            raise HTTPException(413, f"request body of {length} bytes exceeds {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, f"request body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _check_limits(req: GenerateRequest, pool, max_new_tokens_limit: int) -> str | None:
    """The problem with a parsed request's ids, lengths and sampling parameters, or None."""
    if req.max_new_tokens > max_new_tokens_limit:
        return (
            f"max_new_tokens: {req.max_new_tokens} exceeds this gateway's limit "
            f"{max_new_tokens_limit}"
        )
    try:
        check_request(
            req.input_ids,
            req.max_new_tokens,
            req.stop_tokens,
            vocab_size=pool.vocab_size,
            max_positions=pool.max_positions,
        )
        session_sampling(req.temperature, req.top_p, req.top_k, req.seed)
    except ConfigError as err:
        return str(err)
    return None
