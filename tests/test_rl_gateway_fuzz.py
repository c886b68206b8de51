"""A bounded fuzz of the gateway's HTTP surface (rl/gateway_app.py) in-process: the app
over one in-process worker of the tiny model, driven through FastAPI's TestClient.

Three classes of request, drawn by hypothesis (derandomized, so every run sends the
same requests):

- ``valid``: well-formed bodies with every field inside its documented range, the
  sampling parameters at their edges included (temperature 0 / 1e-6 / 1e6, top_p down
  to 5e-324, top_k past the vocabulary, 64-bit seeds), sessions continued and forked.
- ``extreme``: a valid body with one field set to a value of the right JSON type but
  possibly outside its range (temperature 1e-300 / 5e-324 / 1e300, top_p 0 or 1e-300,
  a 2**64 seed, ids at and past the vocabulary, lengths past the context...).
- ``invalid``: a broken body or request (truncated or non-UTF-8 JSON, a non-object,
  a field of the wrong type, unknown or missing fields, a wrong Content-Type, no or a
  wrong bearer token, an oversized body, a wrong method or path).

Whether a request is acceptable is decided by this module's own reading of the
documented contract (docs/rl.md, "Bad requests"; docs/model.md for the sampling
ranges), not by the gateway. The only allowed outcomes: an acceptable request is
answered (200, output ids in the vocabulary, at most ``max_new_tokens`` of them,
ending at the first stop token, every log-prob finite and <= 0); any other gets a 4xx
whose JSON ``detail`` names what was wrong (the field, for a body). Never a 5xx, never
a traceback in the server's log. Counts per class, status and outcome
(:mod:`fuzz_counts`' outcomes) go, as JSON lines, to the file named by
``FUZZ_COUNTS`` when it is set (docs/reliability.md quotes them);
``GATEWAY_FUZZ_EXAMPLES`` sets the examples per class (default 60).
"""

from __future__ import annotations

import json
import logging
import math
import os

import pytest
from fuzz_counts import (
    ACCEPTED_INVALID,
    BAD_REFUSAL,
    CORRECT,
    REFUSED,
    SERVER_ERROR,
    SILENT_WRONG,
    TRACEBACK,
    Counts,
    Outcome,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from glmport.model import GlmMoeDsaForCausalLM
from glmport.rl.gateway import start_local_pool
from glmport.rl.gateway_app import create_app

pytestmark = pytest.mark.usefixtures("one_thread")

EXAMPLES = int(os.environ.get("GATEWAY_FUZZ_EXAMPLES", "60"))
TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
VOCAB, CONTEXT = 128, 4096  # the tiny model's
NEW_TOKENS_LIMIT = 1024  # the gateway's default max_new_tokens limit
MAX_STOP = 64
BODY_LIMIT = 12 * CONTEXT + (64 << 10)  # the default body limit
SESSIONS = ("a", "b", "c")
COUNTS = Counts("gateway")
_write_counts = COUNTS.writer()

# -- the documented contract, restated ---------------------------------------------------


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _ids(v, non_empty: bool) -> bool:
    return isinstance(v, list) and (v or not non_empty) and all(_int(t) for t in v)


def _in_vocab(v) -> bool:
    return all(0 <= t < VOCAB for t in v)


def problem(body) -> str | None:
    """The field a body breaks (``"body"`` for a non-object), or None when the
    documentation says the gateway must answer it."""
    if not isinstance(body, dict):
        return "body"
    known = {"input_ids", "session_id", "request_id", "max_new_tokens", "temperature"}
    known |= {"top_p", "top_k", "seed", "stop_tokens"}
    extra = set(body) - known
    if extra:
        return sorted(extra)[0]
    for field in ("input_ids", "session_id", "max_new_tokens"):
        if field not in body:
            return field
    ids, new = body["input_ids"], body["max_new_tokens"]
    stops = body.get("stop_tokens", [])
    sid, rid = body["session_id"], body.get("request_id")
    checks = [
        ("input_ids", _ids(ids, True) and _in_vocab(ids)),
        ("session_id", isinstance(sid, str) and 1 <= len(sid) <= 256),
        ("request_id", rid is None or (isinstance(rid, str) and len(rid) <= 256)),
        ("max_new_tokens", _int(new) and 1 <= new <= NEW_TOKENS_LIMIT),
        ("stop_tokens", _ids(stops, False) and len(stops) <= MAX_STOP and _in_vocab(stops)),
    ]
    temperature = body.get("temperature", 1.0)
    top_p, top_k, seed = body.get("top_p", 1.0), body.get("top_k", 0), body.get("seed")
    checks += [
        ("temperature", _number(temperature) and (temperature == 0 or 1e-6 <= temperature <= 1e6)),
        ("top_p", _number(top_p) and 0 < top_p <= 1),
        ("top_k", _int(top_k) and top_k >= 0),
        ("seed", seed is None or (_int(seed) and -(2**63) <= seed < 2**64)),
    ]
    for field, ok in checks:
        if not ok:
            return field
    if len(ids) + new > CONTEXT:
        return "input_ids"
    return None


# -- strategies ------------------------------------------------------------------------

# A plain valid body: every listed extreme value is also sent in it once (@example).
PLAIN = {"input_ids": [5, 17, 3], "session_id": "a", "max_new_tokens": 2, "temperature": 1.0}

ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24)
temperatures = st.one_of(
    st.sampled_from([0, 0.0, 1e-6, 1e-3, 1, 1.0, 7.5, 1e6]),
    st.floats(min_value=1e-6, max_value=1e6),
)
top_ps = st.one_of(
    st.sampled_from([5e-324, 1e-300, 1e-45, 1e-8, 0.5, 1, 1.0]),
    st.floats(min_value=5e-324, max_value=1.0),
)
top_ks = st.sampled_from([0, 1, 5, VOCAB, VOCAB + 1, 2**31, 2**63, 10**30])
seeds = st.one_of(
    st.none(),
    st.sampled_from([0, -1, -(2**63), 2**63, 2**64 - 1]),
    st.integers(-(2**63), 2**64 - 1),
)


@st.composite
def valid_bodies(draw) -> dict:
    body = {
        "input_ids": draw(ids),
        "session_id": draw(st.sampled_from(SESSIONS)),
        "max_new_tokens": draw(st.integers(1, 3)),
    }
    optional = {
        "request_id": st.one_of(st.none(), st.text(max_size=8)),
        "temperature": temperatures,
        "top_p": top_ps,
        "top_k": top_ks,
        "seed": seeds,
        "stop_tokens": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    }
    for name, strategy in optional.items():
        if draw(st.booleans()):
            body[name] = draw(strategy)
    return body


EXTREME_VALUES = {
    "temperature": [
        5e-324,
        1e-300,
        1e-30,
        math.nextafter(1e-6, 0),
        math.nextafter(1e6, math.inf),
        1e30,
        3.5e38,
        1e300,
        1.7e308,
        -0.0,
        -1e-300,
        -1,
        10**400,
    ],
    "top_p": [0, 0.0, -0.0, 1e-300, 5e-324, math.nextafter(1, 2), 2, -1, 1e300],
    "top_k": [-1, -(2**63), 10**30, 10**400],
    "seed": [2**64, -(2**63) - 1, 10**30, -(10**30)],
    "max_new_tokens": [0, -1, NEW_TOKENS_LIMIT + 1, 2**63, 10**30],
    "input_ids": [[VOCAB - 1], [VOCAB], [-1], [0, 2**63], [10**30], [1] * CONTEXT],
    "stop_tokens": [[VOCAB], [-1], [10**30], list(range(MAX_STOP)), [0] * (MAX_STOP + 1)],
    "session_id": ["", "x" * 256, "x" * 257, "\u00e9\u4e2d\U0001f600", "\x00"],
    "request_id": ["", "r" * 256, "r" * 257],
}


# Per field, the strategy of its extreme values: the listed ones, and for the sampling
# parameters any float (NaN and infinities too, sent as JSON's NaN / Infinity) or int.
EXTREME = {
    field: st.sampled_from(values)
    | {"temperature": st.floats(), "top_p": st.floats()}.get(field, st.nothing())
    | {"top_k": st.integers(), "seed": st.integers()}.get(field, st.nothing())
    for field, values in EXTREME_VALUES.items()
}


WRONG_TYPES = {
    "int": ["1", 1.5, 2.0, True, None, [1], {"v": 1}],
    "float": ["1", True, None, [1.0], {"v": 1.0}],
    "str": [5, True, None, [], {"s": "x"}],
    "ids": ["1,2", 5, None, {"i": 1}, [["1"]], [1.5], [True], ["3"], []],
}
FIELD_TYPES = {
    "input_ids": "ids",
    "session_id": "str",
    "max_new_tokens": "int",
    "temperature": "float",
    "top_p": "float",
    "top_k": "int",
    "seed": "int",
    "stop_tokens": "ids",
    "request_id": "str",
}


NOT_JSON = [
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/json; charset=utf-16",
    "application/xml",
    "",
]
# (method, path, what the 404 / 405 detail says)
ROUTES = [
    ("GET", "/generate", "Method Not Allowed"),
    ("POST", "/health", "Method Not Allowed"),
    ("GET", "/openapi.json", "Not Found"),
    ("GET", "/docs", "Not Found"),
]


INVALID_KINDS = [
    "truncated",
    "not-utf8",
    "not-object",
    *(f"wrong-type:{field}" for field in sorted(FIELD_TYPES)),
    "unknown-field",
    "missing",
    "content-type",
    "auth",
    "oversize",
    "route",
]


@st.composite
def invalid_requests(draw, kind: str) -> tuple[str, str, bytes, dict, object, str]:
    """One request of ``kind``: (method, path, body bytes, headers, the body as the
    predicate sees it (None: not a body), text the detail must contain ("": the field
    the predicate names))."""
    body = draw(valid_bodies())
    raw = json.dumps(body).encode()
    headers = dict(AUTH)
    if kind == "truncated":
        cut = raw[: draw(st.integers(0, len(raw) - 1))]
        return "POST", "/generate", cut, headers, None, "invalid JSON"
    if kind == "not-utf8":
        cut = draw(st.integers(0, len(raw) - 1))
        bad = raw[:cut] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80"])) + raw[cut:]
        return "POST", "/generate", bad, headers, None, "invalid JSON"
    if kind == "not-object":
        value = draw(st.sampled_from([[1, 2], 3, "text", None, True, [body]]))
        return "POST", "/generate", json.dumps(value).encode(), headers, None, "body"
    if kind == "content-type":
        headers["Content-Type"] = draw(st.sampled_from(NOT_JSON))
        return "POST", "/generate", raw, headers, None, "Content-Type must be application/json"
    if kind == "auth":
        value = draw(st.sampled_from([None, "Bearer nope", TOKEN, f"Basic {TOKEN}", "Bearer "]))
        headers.pop("Authorization")
        if value is not None:
            headers["Authorization"] = value
        return "POST", "/generate", raw, headers, None, "bearer token"
    if kind == "oversize":
        return "POST", "/generate", raw + b" " * BODY_LIMIT, headers, None, "exceeds"
    if kind == "route":
        method, path, must = draw(st.sampled_from(ROUTES))
        return method, path, raw, headers, None, must
    if kind.startswith("wrong-type:"):
        field = kind.split(":")[1]  # None for an optional field, [] stop tokens are valid
        wrong = [v for v in WRONG_TYPES[FIELD_TYPES[field]] if problem({**PLAIN, field: v})]
        body[field] = draw(st.sampled_from(wrong))
    elif kind == "unknown-field":
        body[draw(st.sampled_from(["prompt", "Temperature", "top-p", "n"]))] = 1
    else:
        del body[draw(st.sampled_from(["input_ids", "session_id", "max_new_tokens"]))]
    return "POST", "/generate", json.dumps(body).encode(), headers, body, ""


# -- the run ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    model = GlmMoeDsaForCausalLM.from_config("tiny", seed=0).eval().requires_grad_(False)
    pool = start_local_pool(model, 1)
    try:
        app = create_app(pool, token=TOKEN)
        with TestClient(app, raise_server_exceptions=False) as http:
            yield http
    finally:
        pool.close()


def _check_answer(body: dict, reply: dict) -> str | None:
    """What is wrong with a 200 answer to ``body``, or None."""
    out, logp = reply.get("output_ids"), reply.get("output_logprobs")
    if not (isinstance(out, list) and isinstance(logp, list) and len(out) == len(logp)):
        return f"malformed answer {reply}"
    stops = set(body.get("stop_tokens", []))
    if not 1 <= len(out) <= body["max_new_tokens"] or not _in_vocab(out):
        return f"output_ids {out} for max_new_tokens {body['max_new_tokens']}"
    if any(t in stops for t in out[:-1]) or (
        len(out) < body["max_new_tokens"] and out[-1] not in stops
    ):
        return f"output_ids {out} do not end at the first stop token of {sorted(stops)}"
    if not all(isinstance(x, float) and math.isfinite(x) and x <= 0 for x in logp):
        return f"log-probs {logp} are not all finite and <= 0"
    echo = (reply.get("session_id"), reply.get("request_id"))
    if echo != (body["session_id"], body.get("request_id")):
        return f"session / request id echoed as {echo}"
    return None


class Server:
    """Sends requests and classifies their outcomes, holding each session's tokens so
    that valid requests can continue a session as an agent would."""

    def __init__(self, http, caplog) -> None:
        self.http, self.caplog = http, caplog
        self.held: dict[str, list[int]] = {}

    def send(self, label: str, method: str, path: str, raw: bytes, headers: dict, body, must: str):
        records = len(self.caplog.records)
        reply = self.http.request(method, path, content=raw, headers=headers)
        logged = [
            r for r in self.caplog.records[records:] if r.exc_info or r.levelno >= logging.ERROR
        ]
        outcome = self._outcome(reply, body, must)
        if logged:
            outcome = Outcome(TRACEBACK, "in the server's log", logged[0].getMessage())
        COUNTS.add(outcome, **{"class": label, "status": reply.status_code})
        assert not outcome.failed, f"{label} {outcome}: {outcome.problem}; {raw[:300]!r}"
        if outcome.kind == CORRECT and body is not None:
            self.held[body["session_id"]] = body["input_ids"] + reply.json()["output_ids"]

    def _outcome(self, reply, body, must: str) -> Outcome:
        if reply.status_code >= 500:
            return Outcome(SERVER_ERROR, problem=f"{reply.status_code}: {reply.text[:300]}")
        broken = "request" if must else problem(body)
        try:
            data = reply.json()
        except ValueError:
            kind = ACCEPTED_INVALID if broken else SILENT_WRONG  # taken, if a 200
            kind = kind if reply.status_code == 200 else BAD_REFUSAL
            return Outcome(kind, "not JSON", reply.text[:300])
        if reply.status_code == 200:
            if broken:
                return Outcome(ACCEPTED_INVALID, problem=f"{broken} accepted")
            wrong = _check_answer(body, data)
            return Outcome(SILENT_WRONG, problem=wrong) if wrong else Outcome(CORRECT)
        detail = data.get("detail") if isinstance(data, dict) else None
        if not isinstance(detail, str) or not detail:
            return Outcome(BAD_REFUSAL, "4xx without a detail", reply.text[:300])
        if not broken:
            return Outcome(BAD_REFUSAL, "a valid request refused", detail)
        expected = must or broken
        if expected not in detail:
            why = f"{detail!r} does not name {expected!r}"
            return Outcome(BAD_REFUSAL, "refused without naming it", why)
        return Outcome(REFUSED)


FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def test_fuzz_valid(client, caplog):
    server = Server(client, caplog)

    @FUZZ
    @given(body=valid_bodies(), extend=st.booleans())
    def prop(body, extend):
        held = server.held.get(body["session_id"])
        if extend and held and len(held) + len(body["input_ids"]) < 200:
            body["input_ids"] = held + body["input_ids"]  # the next turn of the session
        raw = json.dumps(body).encode()
        server.send("valid", "POST", "/generate", raw, AUTH, body, "")

    prop()


@pytest.mark.parametrize("field", sorted(EXTREME))
def test_fuzz_valid_but_extreme(client, caplog, field):
    server = Server(client, caplog)

    @settings(FUZZ, max_examples=max(1, EXAMPLES // 3))
    @given(body=valid_bodies(), value=EXTREME[field])
    def prop(body, value):
        body = {**body, field: value}
        server.send("extreme", "POST", "/generate", json.dumps(body).encode(), AUTH, body, "")

    for value in EXTREME_VALUES[field]:
        prop = example(body=PLAIN, value=value)(prop)
    prop()


@pytest.mark.parametrize("kind", INVALID_KINDS)
def test_fuzz_invalid(client, caplog, kind):
    server = Server(client, caplog)

    @settings(FUZZ, max_examples=max(1, EXAMPLES // 6))
    @given(request=invalid_requests(kind))
    def prop(request):
        method, path, raw, headers, body, must = request
        server.send("invalid", method, path, raw, headers, body, must)

    prop()
