"""The token-in-token-out gateway (rl/gateway.py, rl/gateway_app.py, ``glmport rl serve``):
consistent hashing, malformed requests refused by name without disturbing valid ones,
bearer auth, a concurrent load test on loopback over Ray workers (every request answered
exactly once, sessions pinned, answers equal to a fresh ``generate``), a worker killed and
restarted, and the CLI served once as a subprocess.

Every answer is checked against ``generate`` on the same weights in this process, never
against numbers the gateway produced.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from hang_guard import guard_s

from glmport.cli import main
from glmport.core.errors import ConfigError
from glmport.model import GlmMoeDsaForCausalLM
from glmport.model.generation import generate
from glmport.rl.gateway import HashRing, policy_source, running_server, start_local_pool
from glmport.rl.gateway_app import create_app

pytestmark = pytest.mark.usefixtures("one_thread")
VERSION = 3
TOKEN = "s3cret-token"
PROMPT = [5, 17, 3, 99, 42, 8, 61]


@pytest.fixture(scope="module")
def model():
    return GlmMoeDsaForCausalLM.from_config("tiny", seed=0).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def local_pool(model):
    pool = start_local_pool(model, VERSION, workers=2)
    yield pool
    pool.close()


def reference(model, input_ids, n, temperature=0.0, seed=None):
    """Output ids and log-probs of a fresh ``generate`` on the full input."""
    sampling = (
        dict(greedy=True) if temperature == 0 else dict(greedy=False, temperature=temperature)
    )
    result = generate(model, [input_ids], n, seed=seed, return_logprobs=True, **sampling)
    return result.output_ids[0], result.logprobs[0].tolist()


def assert_answer(reply: dict, model, body: dict) -> None:
    ids, logprobs = reference(
        model, body["input_ids"], body["max_new_tokens"], body["temperature"], body.get("seed")
    )
    assert reply["output_ids"] == ids
    assert reply["output_logprobs"] == pytest.approx(logprobs, abs=1e-5)
    assert reply["policy_version"] == VERSION
    assert reply["session_id"] == body["session_id"]
    assert reply["request_id"] == body.get("request_id")


def client_for(app, **kwargs) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://gateway",
        timeout=guard_s(5),
        **kwargs,
    )


# -- consistent hashing ----------------------------------------------------------------


def test_hash_ring_moves_only_the_removed_workers_sessions():
    keys = [f"session-{i}" for i in range(2000)]
    ring = HashRing(range(4))
    before = {k: ring.node_for(k) for k in keys}
    counts = Counter(before.values())
    assert set(counts) == {0, 1, 2, 3}
    assert max(counts.values()) < 2 * min(counts.values())  # roughly even
    ring.remove(2)
    after = {k: ring.node_for(k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == 2 for k in moved)  # only worker 2's sessions move
    assert all(after[k] != 2 for k in keys)
    ring.add(2)  # back as before: the ring depends only on its members
    assert {k: ring.node_for(k) for k in keys} == before
    ring.add(4)  # a new worker takes sessions only for itself
    grown = {k: ring.node_for(k) for k in keys}
    assert all(grown[k] in (before[k], 4) for k in keys) and 4 in grown.values()


def test_hash_ring_is_the_same_in_every_process():
    """Not Python's salted ``hash()`` (another process, another mapping): blake2b, so this
    mapping, pinned when it was written, holds in every process and run."""
    ring = HashRing(range(3))
    pinned = [2, 1, 0, 2, 1, 2, 1, 0, 1, 2, 0, 1, 1, 2, 1, 2, 1, 0, 0, 0, 2, 0, 1, 1]
    assert [ring.node_for(f"s{i}") for i in range(24)] == pinned


# -- malformed requests, in-process ----------------------------------------------------


def valid(session: str, **changes) -> dict:
    return {
        "input_ids": PROMPT,
        "session_id": session,
        "max_new_tokens": 4,
        "temperature": 0.0,
        **changes,
    }


MALFORMED = [
    # (raw body, status, text the detail must contain)
    (b'{"input_ids": [1, 2', 400, "invalid JSON"),
    (b"\xff\xfe not utf-8", 400, "invalid JSON"),
    (b"[1, 2, 3]", 422, "body: Input should be an object"),
    (valid("m", input_ids="1,2,3"), 422, "input_ids: Input should be a valid array"),
    (valid("m", input_ids=[1, "2"]), 422, "input_ids.1: Input should be a valid integer"),
    (valid("m", input_ids=[1, 2.0]), 422, "input_ids.1: Input should be a valid integer"),
    (valid("m", input_ids=[1, True]), 422, "input_ids.1: Input should be a valid integer"),
    (valid("m", input_ids=[]), 422, "input_ids: List should have at least 1 item"),
    (valid("m", input_ids=[1, 128, 7, 300]), 422, "outside [0, 128): [128, 300]"),
    (valid("m", input_ids=[4, -3]), 422, "outside [0, 128): [-3]"),
    (valid("m", stop_tokens=[999]), 422, "stop_tokens has token ids outside [0, 128): [999]"),
    (valid("m", max_new_tokens="4"), 422, "max_new_tokens: Input should be a valid integer"),
    (valid("m", max_new_tokens=4.0), 422, "max_new_tokens: Input should be a valid integer"),
    (valid("m", max_new_tokens=0), 422, "max_new_tokens: Input should be greater than"),
    (valid("m", max_new_tokens=5000), 422, "max_new_tokens: 5000 exceeds this gateway's limit"),
    (
        valid("m", input_ids=[1] * 4090, max_new_tokens=16),
        422,
        "input_ids (4090 tokens) + max_new_tokens 16 exceeds max_position_embeddings 4096",
    ),
    (valid("m", session_id=5), 422, "session_id: Input should be a valid string"),
    (valid("m", session_id=""), 422, "session_id: String should have at least 1 character"),
    (valid("m", temperature="hot"), 422, "temperature: Input should be a valid number"),
    (valid("m", temperature=-1.0), 422, "temperature must be a number in [1e-06, 1e+06]"),
    (valid("m", top_p=0.0), 422, "top_p must be a number in (0, 1]"),
    (valid("m", top_k=-1), 422, "top_k must be an int >= 0"),
    (valid("m", seed=1 << 64), 422, "seed must be an int from -2**63 to 2**64-1"),
    (valid("m", prompt="hello"), 422, "unknown field 'prompt'"),
    ({"input_ids": PROMPT, "max_new_tokens": 2}, 422, "session_id: required"),
]


JSON = {"Content-Type": "application/json"}


async def _post(client: httpx.AsyncClient, body) -> httpx.Response:
    if isinstance(body, bytes):
        return await client.post("/generate", content=body, headers=JSON)
    return await client.post("/generate", json=body)


async def _oversize_streamed(client: httpx.AsyncClient) -> httpx.Response:
    """A chunked body (no Content-Length) that grows past the limit."""

    async def chunks():
        yield b'{"input_ids": ['
        for _ in range(400):
            yield b"1, " * 20

    return await client.post("/generate", content=chunks(), headers=JSON)


def test_malformed_requests_get_4xx_and_valid_ones_interleaved_are_answered(model, local_pool):
    app = create_app(local_pool, max_body_bytes=16384)
    oversize = valid("m", input_ids=[100] * 5000)  # ~20 KB of JSON

    async def run():
        async with client_for(app) as client:
            goods = [valid(f"ok-{i}", input_ids=[*PROMPT, i], request_id=f"r{i}") for i in range(6)]
            goods += [valid("ok-seeded", temperature=0.8, seed=11, request_id="seeded")]
            tasks = []
            for i, (body, _, _) in enumerate(MALFORMED):
                tasks.append(_post(client, body))
                if i % 4 == 0 and goods:  # valid requests in between, concurrently
                    tasks.append(_post(client, goods.pop()))
            tasks += [_post(client, g) for g in goods]
            tasks += [_post(client, oversize), _oversize_streamed(client)]
            tasks += [client.get("/generate"), client.post("/nothing", json={})]
            return await asyncio.gather(*tasks)

    replies = asyncio.run(run())
    errors = [r for r in replies if r.status_code != 200]
    answers = [r.json() for r in replies if r.status_code == 200]
    assert len(answers) == 7 and len(errors) == len(MALFORMED) + 4
    by_request = {a["request_id"]: a for a in answers}
    for i in range(6):
        assert_answer(
            by_request[f"r{i}"], model, valid(f"ok-{i}", input_ids=[*PROMPT, i], request_id=f"r{i}")
        )
    assert_answer(
        by_request["seeded"],
        model,
        valid("ok-seeded", temperature=0.8, seed=11, request_id="seeded"),
    )
    details = [r.json()["detail"] for r in errors]
    checked = zip(MALFORMED, errors[: len(MALFORMED)], details, strict=False)
    for (_, status, text), reply, detail in checked:
        assert reply.status_code == status, (text, detail)
        assert text in detail, (text, detail)
    assert [r.status_code for r in errors[-4:]] == [413, 413, 405, 404]
    assert "exceeds 16384 bytes" in details[-4] and "exceeds 16384 bytes" in details[-3]


def test_a_session_continues_and_forks_over_http(model, local_pool):
    app = create_app(local_pool)

    async def run():
        async with client_for(app) as client:
            first = (await client.post("/generate", json=valid("chat"))).json()
            turn = valid("chat", input_ids=[*PROMPT, *first["output_ids"], 9, 10])
            second = (await client.post("/generate", json=turn)).json()
            fork = valid("chat", input_ids=[*PROMPT[:3], 77])
            forked = (await client.post("/generate", json=fork)).json()
            health = (await client.get("/health")).json()
            return first, (turn, second), (fork, forked), health

    first, (turn, second), (fork, forked), health = asyncio.run(run())
    assert_answer(first, model, valid("chat"))
    assert first["cached_tokens"] == 0
    assert_answer(second, model, turn)
    assert second["cached_tokens"] == len(PROMPT) + 3  # all the held tokens
    assert_answer(forked, model, fork)
    assert forked["cached_tokens"] == 3
    assert (
        first["worker"]
        == second["worker"]
        == forked["worker"]
        == HashRing(range(2)).node_for("chat")
    )
    assert health["status"] == "ok"
    assert [(w["worker"], w["alive"], w["policy_version"]) for w in health["workers"]] == [
        (0, True, VERSION),
        (1, True, VERSION),
    ]


def test_bearer_token_is_required_when_set(model, local_pool):
    app = create_app(local_pool, token=TOKEN)

    async def run():
        async with (
            client_for(app) as anon,
            client_for(app, headers={"Authorization": "Bearer wrong"}) as wrong,
            client_for(app, headers={"Authorization": f"Bearer {TOKEN}"}) as good,
        ):
            return await asyncio.gather(
                anon.post("/generate", json=valid("auth")),
                anon.get("/health"),
                wrong.post("/generate", json=valid("auth")),
                anon.post("/generate", json=valid("auth"), headers={"Authorization": TOKEN}),
                good.post("/generate", json=valid("auth", request_id="good")),
                good.get("/health"),
            )

    missing, health_missing, wrong, no_scheme, ok, health = asyncio.run(run())
    for reply in (missing, health_missing, no_scheme):
        assert reply.status_code == 401 and "missing bearer token" in reply.json()["detail"]
        assert reply.headers["www-authenticate"] == "Bearer"
    assert wrong.status_code == 401 and "wrong bearer token" in wrong.json()["detail"]
    assert ok.status_code == 200 and health.status_code == 200
    assert_answer(ok.json(), model, valid("auth", request_id="good"))


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        (None, 415),
        ("text/plain", 415),
        ("text/plain; charset=utf-8", 415),
        ("application/x-www-form-urlencoded", 415),
        ("multipart/form-data; boundary=x", 415),
        ("application/json; charset=latin-1", 415),
        ("application/jsonp", 415),
        ("application/json", 200),
        ("Application/JSON; charset=UTF-8", 200),
    ],
)
def test_only_application_json_is_served(local_pool, content_type, status):
    """text/plain, form and multipart bodies are what a browser may POST cross-origin
    without a preflight: the same JSON sent as any of them is refused (415)."""
    app = create_app(local_pool)
    headers = {} if content_type is None else {"Content-Type": content_type}
    body = json.dumps(valid("ct", max_new_tokens=1)).encode()

    async def run():
        async with client_for(app) as client:
            return await client.post("/generate", content=body, headers=headers)

    reply = asyncio.run(run())
    assert reply.status_code == status, reply.text
    if status == 415:
        assert reply.json()["detail"].startswith("Content-Type must be application/json, got ")


def test_openapi_schema_is_served_only_when_asked(local_pool):
    async def get(app):
        async with client_for(app) as client:
            return await client.get("/openapi.json")

    assert asyncio.run(get(create_app(local_pool))).status_code == 404
    schema = asyncio.run(get(create_app(local_pool, openapi=True)))
    assert schema.status_code == 200 and "/generate" in schema.json()["paths"]


@pytest.mark.parametrize("token", ["", " ", " padded", "tab\there", "caf\u00e9"])
def test_an_empty_or_unsendable_token_is_refused_not_no_auth(local_pool, token):
    with pytest.raises(ConfigError, match="create_app: token: the gateway token must"):
        create_app(local_pool, token=token)


@pytest.mark.parametrize(
    ("argv", "env", "source"),
    [
        (["--token", ""], None, "--token"),
        (["--token", " "], None, "--token"),
        ([], "", "GLMPORT_GATEWAY_TOKEN"),
    ],
)
def test_cli_serve_refuses_an_empty_token(monkeypatch, capsys, argv, env, source):
    """``--token ''`` (or an empty GLMPORT_GATEWAY_TOKEN) is an error before any work,
    never a gateway without authentication."""
    import glmport.rl.gateway

    served = []
    monkeypatch.setattr(glmport.rl.gateway, "serve_forever", lambda *a, **k: served.append(a))
    if env is None:
        monkeypatch.delenv("GLMPORT_GATEWAY_TOKEN", raising=False)
    else:
        monkeypatch.setenv("GLMPORT_GATEWAY_TOKEN", env)
    assert main(["rl", "serve", "--model", "tiny", "--local", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"glmport: error: {source}: the gateway token must"), err
    assert served == []


def test_cli_refuses_a_public_bind_without_a_token(capsys):
    assert main(["rl", "serve", "--model", "tiny", "--host", "0.0.0.0", "--local"]) == 2
    err = capsys.readouterr().err
    assert "0.0.0.0 is not a loopback address" in err and "bearer token" in err
    with pytest.raises(SystemExit):
        main(["rl", "serve", "--model", "tiny", "--local", "--ray-address", "auto"])
    assert "not allowed with argument" in capsys.readouterr().err


# -- the CLI as a subprocess -----------------------------------------------------------


def _read_line(stream, timeout_s: float) -> str:
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(stream.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout_s)
    except queue.Empty:
        return ""


def rl_checkpoint(model, folder: Path, version: int) -> Path:
    """An RL checkpoint folder as ``Trainer.save`` lays it out (policy/ + state.json)."""
    model.save_pretrained(folder / "policy")
    (folder / "state.json").write_text(json.dumps({"step": version, "policy_version": version}))
    return folder


def test_policy_source_reads_the_rl_checkpoints_version(model, tmp_path):
    ckpt = rl_checkpoint(model, tmp_path / "checkpoint", 7)
    assert policy_source(str(ckpt)) == (str(ckpt / "policy"), 7)
    assert policy_source(str(ckpt / "policy")) == (str(ckpt / "policy"), 7)
    model.save_pretrained(tmp_path / "plain")
    assert policy_source(str(tmp_path / "plain")) == (str(tmp_path / "plain"), 0)
    assert policy_source("tiny") == ("tiny", 0)
    (ckpt / "state.json").write_text(json.dumps({"policy_version": "7"}))
    with pytest.raises(ConfigError, match="policy_version must be an int"):
        policy_source(str(ckpt))


def test_glmport_rl_serve_runs_and_stops_on_ctrl_c(model, tmp_path):
    """The CLI serving an RL checkpoint (its policy version) until Ctrl-C."""
    ckpt = rl_checkpoint(model, tmp_path / "checkpoint", 7)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLMPORT_GATEWAY_TOKEN": TOKEN}
    cmd = [sys.executable, "-m", "glmport", "rl", "serve", "--model", str(ckpt), "--local"]
    proc = subprocess.Popen(
        [*cmd, "--port", "0", "--workers", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = _read_line(proc.stdout, guard_s(15))  # a fresh interpreter, torch, 2 models
        assert line.startswith("gateway on http://127.0.0.1:"), (line, proc.poll())
        assert "2 workers" in line and "policy version 7" in line
        url = line.split()[2]
        headers = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=url, timeout=guard_s(5), headers=headers) as client:
            health = client.get("/health").json()
            body = valid("cli", request_id="cli-1")
            reply = client.post("/generate", json=body)
            refused = client.post("/generate", json=body, headers={"Authorization": "Bearer no"})
        assert health["status"] == "ok" and len(health["workers"]) == 2
        assert reply.status_code == 200 and refused.status_code == 401
        ids, logprobs = reference(model, PROMPT, 4)
        assert reply.json()["output_ids"] == ids and reply.json()["policy_version"] == 7
        assert reply.json()["output_logprobs"] == pytest.approx(logprobs, abs=1e-5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=guard_s(5))
        assert proc.returncode == 0, err
        assert "gateway stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=guard_s(1))


# -- Ray workers behind a real server on loopback ----------------------------------------

CLIENTS, REQUESTS = 8, 8


@pytest.fixture(scope="module")
def ray_gateway(model, ray_local):
    """Local Ray (2 CPUs), 2 rollout-worker actors, uvicorn on a free loopback port."""
    from glmport.rl.gateway import start_ray_pool

    pool = start_ray_pool(model, VERSION, workers=2, max_restarts=2)
    try:
        with running_server(create_app(pool, token=TOKEN)) as url:
            yield url, pool
    finally:
        pool.close()


def test_load_every_request_answered_exactly_once(model, ray_gateway):
    url, _ = ray_gateway
    headers = {"Authorization": f"Bearer {TOKEN}"}

    async def client(c: int, http: httpx.AsyncClient) -> list[tuple[dict, dict, int]]:
        """Two sessions per client, each turn extending the session with its last output."""
        contexts = {f"c{c}-s{s}": [c + 1, s + 1, *PROMPT] for s in range(2)}
        done = []
        for r in range(REQUESTS):
            session = f"c{c}-s{r % 2}"
            body = valid(session, input_ids=contexts[session], request_id=f"c{c}-r{r}")
            reply = await http.post("/generate", json=body)
            data = reply.json()
            done.append((body, data, reply.status_code))
            if reply.status_code == 200:
                contexts[session] = [*contexts[session], *data["output_ids"], 1]
        return done

    async def garbage(http: httpx.AsyncClient) -> list[int]:
        bodies = [b"{", valid("g", input_ids=[500]), valid("g", extra=1)] * 3
        return [(await _post(http, b)).status_code for b in bodies]

    async def run():
        limits = httpx.Limits(max_connections=CLIENTS + 1)
        async with httpx.AsyncClient(
            base_url=url, headers=headers, timeout=guard_s(10), limits=limits
        ) as http:
            return await asyncio.gather(*(client(c, http) for c in range(CLIENTS)), garbage(http))

    start = time.perf_counter()
    *results, bad = asyncio.run(run())
    seconds = time.perf_counter() - start
    done = [x for per_client in results for x in per_client]
    sent = {f"c{c}-r{r}" for c in range(CLIENTS) for r in range(REQUESTS)}
    assert [status for _, _, status in done] == [200] * len(sent)
    echoed = [data["request_id"] for _, data, _ in done]
    assert len(echoed) == len(sent) and set(echoed) == sent  # none lost, none twice
    ring = HashRing(range(2))
    workers: dict[str, set[int]] = {}
    for body, data, _ in done:
        workers.setdefault(body["session_id"], set()).add(data["worker"])
        assert_answer(data, model, body)
    assert all(w == {ring.node_for(s)} for s, w in workers.items())  # pinned
    assert {ring.node_for(s) for s in workers} == {0, 1}  # both workers served
    # Every turn after the first reused the session's cache.
    assert all(
        data["cached_tokens"] > 0
        for body, data, _ in done
        if body["request_id"][-2:] not in ("r0", "r1")
    )
    assert bad == [400, 422, 422] * 3
    print(f"{len(done)} requests in {seconds:.2f} s ({len(done) / seconds:.1f} req/s)")


def test_killed_worker_is_503_then_restarted_with_the_weights(model, ray_gateway):
    import ray

    url, pool = ray_gateway
    ring = HashRing(range(2))
    session = next(f"k{i}" for i in range(100) if ring.node_for(f"k{i}") == 0)
    body = valid(session, request_id="after-kill")
    headers = {"Authorization": f"Bearer {TOKEN}"}
    ray.kill(pool.actors[0], no_restart=False)
    statuses = []
    with httpx.Client(base_url=url, headers=headers, timeout=guard_s(10)) as http:
        deadline = time.monotonic() + guard_s(15)  # Ray restarts the actor: a new process
        while time.monotonic() < deadline:
            reply = http.post("/generate", json=body)
            statuses.append(reply.status_code)
            if reply.status_code == 200:
                break
            assert reply.status_code == 503, reply.text
            assert "rollout worker 0 is unavailable" in reply.json()["detail"]
            time.sleep(0.5)
        health = http.get("/health").json()
    assert statuses[-1] == 200, statuses
    # The restarted actor came up with random weights: the pool loaded the policy again.
    assert_answer(reply.json(), model, body)
    assert reply.json()["worker"] == 0
    assert health["workers"][0]["alive"] is True
    assert health["workers"][0]["policy_version"] == VERSION
