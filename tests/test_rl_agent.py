"""Tests of the toy agent environment (glmport.rl.agent_env), GLM-5's context strategies
(glmport.rl.context) and the episode driver / gateway client (glmport.rl.agent)."""

from __future__ import annotations

import json

import pytest
import torch

from glmport.core.errors import ConfigError
from glmport.rl.agent import (
    GatewayClient,
    GatewayError,
    episode_summary,
    mean_summary,
    run_episode,
)
from glmport.rl.agent_env import AgentEnv, AgentProblem, AgentVocab, Trajectory, Turn
from glmport.rl.context import (
    DiscardAll,
    FullContext,
    KeepRecent,
    hybrid,
    parse_context,
)

V = AgentVocab(10)
SEP, PLUS, ADD, LOOKUP, END, RESULT, ERROR, ANSWER, FOLD = range(10, 19)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def digits(value: int, width: int) -> list[int]:
    """Independent reference: Python's own base-10 formatting, zero-padded."""
    return [int(c) for c in str(value).zfill(width)]


# ---------------------------------------------------------------- vocabulary and problems


def test_vocab_layout():
    assert (V.sep, V.plus, V.add, V.lookup, V.end) == (SEP, PLUS, ADD, LOOKUP, END)
    assert (V.result, V.error, V.answer, V.fold, V.vocab_size) == (RESULT, ERROR, ANSWER, FOLD, 19)
    assert V.render([ADD, 4, 2, PLUS, 1, 7, END, 19, 127]) == "ADD 4 2 PLUS 1 7 END <19> <127>"
    assert AgentVocab(3).sep == 3 and AgentVocab(3).vocab_size == 12
    with pytest.raises(ConfigError, match="'base'"):
        AgentVocab(1)


def test_add_problems():
    env = AgentEnv("add", terms=3, digits=2)
    assert env.width == 3  # 3 * 99 = 297
    g = gen(1)
    for p in [env.sample(g) for _ in range(100)]:
        assert p.prompt[0] == ADD and p.prompt[-1] == SEP and len(p.prompt) == 10
        assert p.prompt[3] == PLUS and p.prompt[6] == PLUS and p.table is None
        numbers = [p.prompt[1] * 10 + p.prompt[2], p.prompt[4] * 10 + p.prompt[5]]
        numbers.append(p.prompt[7] * 10 + p.prompt[8])
        assert list(p.answer) == digits(sum(numbers), 3)
    assert env.sample(gen(5)) == env.sample(gen(5)) and env.sample(gen(5)) != env.sample(gen(6))


def test_lookup_problems():
    env = AgentEnv("lookup", terms=2, digits=2)
    g = gen(2)
    seen_tables = set()
    for _ in range(50):
        p = env.sample(g)
        assert len(p.prompt) == 5 and p.prompt[0] == LOOKUP and p.prompt[2] == PLUS
        assert p.prompt[4] == SEP and len(p.table) == 10
        assert all(0 <= v < 100 for v in p.table)
        assert list(p.answer) == digits(p.table[p.prompt[1]] + p.table[p.prompt[3]], 3)
        seen_tables.add(p.table)
    assert len(seen_tables) == 50  # a fresh hidden table per episode


def test_env_settings_errors():
    with pytest.raises(ConfigError, match="unknown agent task 'mul'"):
        AgentEnv("mul")
    with pytest.raises(ConfigError, match="'terms'"):
        AgentEnv(terms=1)
    with pytest.raises(ConfigError, match="'max_turns'"):
        AgentEnv(max_turns=0)
    with pytest.raises(ConfigError, match="'max_context'"):
        AgentEnv(max_context=10)  # prompt 5 + action 9 > 10
    assert AgentEnv(max_context=14).max_new_tokens == 9  # ADD 3 digits PLUS 3 digits END


# ---------------------------------------------------------------- tool calls and reward

LOOKUP_PROBLEM = AgentProblem(
    prompt=(LOOKUP, 3, PLUS, 5, SEP),
    answer=(0, 5, 9),
    table=(11, 22, 33, 42, 55, 17, 66, 77, 88, 99),
)


@pytest.mark.parametrize(
    ("action", "kind", "observation"),
    [
        ([LOOKUP, 3, END], "call", (RESULT, 0, 4, 2, END)),
        ([LOOKUP, 9, END], "call", (RESULT, 0, 9, 9, END)),
        ([ADD, 4, 2, PLUS, 1, 7, END], "call", (RESULT, 0, 5, 9, END)),
        ([ADD, 9, 9, 9, PLUS, 0, END], "call", (RESULT, 9, 9, 9, END)),
        ([ADD, 5, PLUS, 5, END], "call", (RESULT, 0, 1, 0, END)),
        ([ADD, 9, 9, 9, PLUS, 1, END], "error", (ERROR,)),  # overflows 3 digits
        ([ADD, 1, 2, 3, 4, PLUS, 1, END], "error", (ERROR,)),  # operand too long
        ([ADD, PLUS, 1, END], "error", (ERROR,)),  # empty operand
        ([ADD, 1, PLUS, 2, PLUS, 3, END], "error", (ERROR,)),
        ([ADD, 1, 2, END], "error", (ERROR,)),  # no PLUS
        ([ADD, 4, 2, PLUS, 1, 7], "error", (ERROR,)),  # ran out of tokens: no END
        ([LOOKUP, 3, 4, END], "error", (ERROR,)),
        ([LOOKUP, END], "error", (ERROR,)),
        ([LOOKUP, PLUS, END], "error", (ERROR,)),
        ([3, LOOKUP, 3, END], "error", (ERROR,)),  # junk before the call
        ([LOOKUP, 3, END, END], "error", (ERROR,)),
        ([END], "error", (ERROR,)),
        ([], "error", (ERROR,)),
        ([77, 100, 127], "error", (ERROR,)),  # ids past the environment's vocabulary
        ([ADD, 4, 19, PLUS, 1, END], "error", (ERROR,)),
    ],
)
def test_tool_calls(action, kind, observation):
    step = AgentEnv("lookup").step(LOOKUP_PROBLEM, action)
    assert (step.kind, step.observation, step.reward) == (kind, observation, None)


def test_lookup_is_refused_in_the_add_task():
    env = AgentEnv("add")
    problem = AgentProblem((ADD, 4, 2, PLUS, 1, 7, SEP), (0, 5, 9))
    assert env.step(problem, [LOOKUP, 3, END]).kind == "error"
    assert env.step(problem, [ADD, 4, 2, PLUS, 1, 7, END]).observation == (RESULT, 0, 5, 9, END)


@pytest.mark.parametrize(
    ("action", "reward"),
    [
        ([ANSWER, 0, 5, 9, END], 1.0),
        ([ANSWER, 0, 5, 8, END], 2 / 3),
        ([ANSWER, 1, 5, 8, END], 1 / 3),
        ([ANSWER, 1, 1, 1, END], 0.0),
        ([ANSWER, 0, 5, 9], 1.0),  # ran out of tokens: the digits given still count
        ([ANSWER, 0, 5, END], 2 / 3),  # short: the missing position is wrong
        ([ANSWER, 0, 5, 9, 9, END], 1.0),  # past the width: ignored
        ([ANSWER, END, 0, 5, 9], 0.0),  # nothing before END
        ([ANSWER, 0, PLUS, 9, END], 2 / 3),
        ([ANSWER], 0.0),
    ],
)
def test_answer_reward(action, reward):
    step = AgentEnv("lookup").step(LOOKUP_PROBLEM, action)
    assert step.kind == "answer" and step.observation == ()
    assert step.reward == pytest.approx(reward, abs=0)


# ---------------------------------------------------------------- context strategies

PROMPT = (LOOKUP, 3, PLUS, 5, SEP)
T1 = Turn(action=(LOOKUP, 3, END), observation=(RESULT, 0, 4, 2, END))
T2 = Turn(action=(LOOKUP, 5, END), observation=(RESULT, 0, 1, 7, END))
T3 = Turn(action=(7, 7), observation=(ERROR,), kind="error")
TURNS = [T1, T2, T3]


def full_len(turns) -> int:
    return len(PROMPT) + sum(len(t.action) + len(t.observation) for t in turns)


def check_accounting(view, turns):
    assert len(view.tokens) + view.folded + view.dropped == full_len(turns)


def test_full_context():
    view = FullContext()(PROMPT, TURNS, FOLD)
    assert list(view.tokens) == [
        *PROMPT, LOOKUP, 3, END, RESULT, 0, 4, 2, END, LOOKUP, 5, END, RESULT, 0, 1, 7, END,
        7, 7, ERROR,
    ]  # fmt: skip
    assert (view.folded, view.dropped) == (0, 0)
    assert FullContext()(PROMPT, [], FOLD).tokens == PROMPT


def test_keep_recent():
    one = KeepRecent(1)(PROMPT, TURNS, FOLD)
    assert list(one.tokens) == [*PROMPT, LOOKUP, 3, END, FOLD, LOOKUP, 5, END, FOLD, 7, 7, ERROR]
    assert one.folded == 4 + 4 and one.dropped == 0
    two = KeepRecent(2)(PROMPT, TURNS, FOLD)
    assert list(two.tokens) == [
        *PROMPT, LOOKUP, 3, END, FOLD, LOOKUP, 5, END, RESULT, 0, 1, 7, END, 7, 7, ERROR,
    ]  # fmt: skip
    assert two.folded == 4
    zero = KeepRecent(0)(PROMPT, TURNS, FOLD)  # k = 0: every observation folded
    assert list(zero.tokens) == [*PROMPT, LOOKUP, 3, END, FOLD, LOOKUP, 5, END, FOLD, 7, 7, FOLD]
    assert zero.folded == 8  # ERROR -> FOLD saves nothing
    for k in (3, 4, 100):  # k >= turns: nothing folded
        assert KeepRecent(k)(PROMPT, TURNS, FOLD) == FullContext()(PROMPT, TURNS, FOLD)
    assert KeepRecent(0)(PROMPT, [], FOLD).tokens == PROMPT
    for view, turns in ((one, TURNS), (two, TURNS), (zero, TURNS)):
        check_accounting(view, turns)


def test_discard_all_threshold_edges():
    # after T1 the full context is 5 + 8 = 13 tokens, after T2 21, after T3 24
    exactly = DiscardAll(13)(PROMPT, [T1], FOLD)
    assert exactly.tokens == PROMPT + T1.action + T1.observation and exactly.dropped == 0
    passed = DiscardAll(12)(PROMPT, [T1], FOLD)
    assert passed.tokens == PROMPT and passed.dropped == 8
    check_accounting(passed, [T1])
    # threshold 13: T1 kept (13), T1+T2 = 21 passes -> restart; then T3 alone: 5 + 3 = 8
    view = DiscardAll(13)(PROMPT, TURNS, FOLD)
    assert view.tokens == PROMPT + T3.action + T3.observation and view.dropped == 16
    check_accounting(view, TURNS)
    # threshold 20: T1+T2 = 21 passes -> restart after T2 -> T3 kept
    view = DiscardAll(20)(PROMPT, TURNS, FOLD)
    assert view.tokens == PROMPT + T3.action + T3.observation
    # the restart sticks: with T1, T2 only, the next request is the prompt alone
    assert DiscardAll(20)(PROMPT, [T1, T2], FOLD).tokens == PROMPT
    assert DiscardAll(24)(PROMPT, TURNS, FOLD) == FullContext()(PROMPT, TURNS, FOLD)
    # a threshold below the prompt: every turn is dropped, the prompt is always sent
    view = DiscardAll(1)(PROMPT, TURNS, FOLD)
    assert view.tokens == PROMPT and view.dropped == full_len(TURNS) - len(PROMPT)


def test_hybrid_folds_before_discarding():
    # folded (k=1): after T1 13 tokens, after T2 5 + 4 + 8 = 17, after T3 5+4+4+3 = 16
    strategy = hybrid(1, 17)
    assert strategy == DiscardAll(17, KeepRecent(1))
    view = strategy(PROMPT, TURNS, FOLD)
    assert list(view.tokens) == [*PROMPT, LOOKUP, 3, END, FOLD, LOOKUP, 5, END, FOLD, 7, 7, ERROR]
    assert (view.folded, view.dropped) == (8, 0)
    # plain discard-all at the same threshold has already restarted (21 > 17)
    assert DiscardAll(17)(PROMPT, TURNS, FOLD).tokens == PROMPT + T3.action + T3.observation
    # at 16 the folded context after T2 (17) passes: restart, then T3 in full
    view = hybrid(1, 16)(PROMPT, TURNS, FOLD)
    assert view.tokens == PROMPT + T3.action + T3.observation
    assert (view.folded, view.dropped) == (0, 16)
    check_accounting(view, TURNS)


def test_parse_context():
    assert parse_context("none") == FullContext()
    assert parse_context("keep-recent:0") == KeepRecent(0)
    assert parse_context("discard-all:64") == DiscardAll(64)
    assert parse_context("hybrid:2,64") == hybrid(2, 64)
    for spec in ("none", "keep-recent:3", "discard-all:9", "hybrid:1,40"):
        assert parse_context(spec).spec() == spec
    for bad in ("", "all", "none:1", "keep-recent", "keep-recent:x", "hybrid:2", "discard-all:1,2"):
        with pytest.raises(ConfigError, match="context strategy"):
            parse_context(bad)
    with pytest.raises(ConfigError, match="'k' must be an int >= 0, got -1"):
        parse_context("keep-recent:-1")
    with pytest.raises(ConfigError, match="'threshold' must be an int >= 1, got 0"):
        parse_context("hybrid:1,0")


# ---------------------------------------------------------------- the driver, scripted


class ScriptedClient:
    """Answers each request with the next scripted action; records the requests, and
    reports cached_tokens as a session cache would (common prefix with the tokens held:
    the previous input and output but its last token)."""

    def __init__(self, actions, version: int = 7):
        self.actions = list(actions)
        self.requests: list[dict] = []
        self.version = version
        self.held: dict[str, list[int]] = {}

    def generate(self, input_ids, session_id, **sampling):
        self.requests.append({"input_ids": list(input_ids), "session_id": session_id, **sampling})
        out = self.actions.pop(0)
        held = self.held.get(session_id, [])
        cached = 0
        while cached < min(len(held), len(input_ids) - 1) and held[cached] == input_ids[cached]:
            cached += 1
        self.held[session_id] = list(input_ids) + out[:-1]
        logprobs = [-0.5 - 0.01 * i for i in range(len(out))]
        return {
            "output_ids": out,
            "output_logprobs": logprobs,
            "policy_version": self.version,
            "cached_tokens": cached,
            "request_id": sampling.get("request_id"),
            "session_id": session_id,
            "worker": 0,
        }


SOLVE = [
    [LOOKUP, 3, END],
    [LOOKUP, 5, END],
    [ADD, 0, 4, 2, PLUS, 0, 1, 7, END],
    [ANSWER, 0, 5, 9, END],
]


def test_correct_agent_gets_reward_one_and_exact_record():
    env = AgentEnv("lookup")
    client = ScriptedClient(SOLVE)
    traj = run_episode(env, client, "ep0", problem=LOOKUP_PROBLEM, seed=100, temperature=0.7)
    assert (traj.reward, traj.end, len(traj.turns)) == (1.0, "answer", 4)
    assert [t.kind for t in traj.turns] == ["call", "call", "call", "answer"]
    obs = [
        [RESULT, 0, 4, 2, END],
        [RESULT, 0, 1, 7, END],
        [RESULT, 0, 5, 9, END],
        [],
    ]
    expected_tokens, expected_mask = list(PROMPT), [False] * 5
    for action, o in zip(SOLVE, obs, strict=True):
        expected_tokens += action + o
        expected_mask += [True] * len(action) + [False] * len(o)
    assert traj.tokens() == expected_tokens and traj.action_mask() == expected_mask
    lp = traj.logprobs()
    assert len(lp) == len(expected_tokens)
    assert [x for x, m in zip(lp, expected_mask, strict=True) if m] == [
        -0.5 - 0.01 * i for a in SOLVE for i in range(len(a))
    ]
    assert all(x == 0.0 for x, m in zip(lp, expected_mask, strict=True) if not m)
    assert {t.policy_version for t in traj.turns} == {7}
    # each request extends the previous one: the full record so far
    for i, request in enumerate(client.requests):
        before = [*PROMPT]
        for action, o in zip(SOLVE[:i], obs[:i], strict=True):
            before += action + o
        assert request["input_ids"] == before == list(traj.turns[i].context)
        assert request["session_id"] == "ep0" and request["request_id"] == f"ep0/{i}"
        assert request["seed"] == 100 + i and request["temperature"] == 0.7
        assert request["stop_tokens"] == [END] and request["max_new_tokens"] == 9
    # cached: the previous request's input + its action but the last token
    assert [t.cached_tokens for t in traj.turns] == [0, 5 + 2, 13 + 2, 21 + 8]
    summary = episode_summary(traj)
    assert summary["generated_tokens"] == 3 + 3 + 9 + 5
    assert summary["context_tokens"] == 5 + 13 + 21 + 35
    assert summary["cache_reuse"] == pytest.approx((7 + 15 + 29) / 74)


def test_wrong_agent_gets_the_exact_partial_reward():
    env = AgentEnv("lookup")
    wrong = [[LOOKUP, 3, END], [ADD, 0, 4, 2, PLUS, 0, 1, 8, END], [ANSWER, 0, 6, 0, END]]
    traj = run_episode(env, ScriptedClient(wrong), "ep1", problem=LOOKUP_PROBLEM)
    assert traj.reward == pytest.approx(1 / 3, abs=0) and traj.end == "answer"
    assert traj.turns[1].observation == (RESULT, 0, 6, 0, END)


def test_malformed_actions_get_error_and_the_episode_goes_on():
    env = AgentEnv("lookup", max_turns=3)
    junk = [[100, 3, 4], [LOOKUP, 3], [ANSWER, 0, 5, 9, END]]
    traj = run_episode(env, ScriptedClient(junk), "ep2", problem=LOOKUP_PROBLEM)
    assert [t.kind for t in traj.turns] == ["error", "error", "answer"]
    assert [t.observation for t in traj.turns[:2]] == [(ERROR,), (ERROR,)]
    assert traj.reward == 1.0
    # out of turns: reward 0
    traj = run_episode(env, ScriptedClient([[LOOKUP, 3, END]] * 3), "ep3", problem=LOOKUP_PROBLEM)
    assert (traj.reward, traj.end, len(traj.turns)) == (0.0, "max_turns", 3)


def test_max_context_ends_the_episode():
    # requests: 5 + 9 <= 30; 5 + 8 + 9 = 22 <= 30; 5 + 16 + 9 = 30 <= 30; 5 + 24 + 9 > 30
    env = AgentEnv("lookup", max_context=30)
    client = ScriptedClient([[LOOKUP, 3, END]] * 5)
    traj = run_episode(env, client, "ep4", problem=LOOKUP_PROBLEM)
    assert (traj.end, len(traj.turns), traj.reward) == ("max_context", 3, 0.0)
    # discard-all keeps it going: the context restarts before it overflows
    client = ScriptedClient([[LOOKUP, 3, END]] * 4 + [[ANSWER, 0, 5, 9, END]])
    traj = run_episode(env, client, "ep5", problem=LOOKUP_PROBLEM, context=DiscardAll(20))
    assert (traj.end, len(traj.turns), traj.reward) == ("answer", 5, 1.0)
    # contexts: 5, 13, (21 > 20: restart) 5, 13, 5
    assert [len(t.context) for t in traj.turns] == [5, 13, 5, 13, 5]
    assert [t.dropped for t in traj.turns] == [0, 0, 16, 16, 32]
    # the full record is kept
    assert len(traj.tokens()) == 5 + 4 * 8 + 5


def test_keep_recent_contexts_sent():
    env = AgentEnv("lookup")
    client = ScriptedClient(SOLVE)
    traj = run_episode(env, client, "ep6", problem=LOOKUP_PROBLEM, context=KeepRecent(1))
    assert traj.reward == 1.0
    sent = [r["input_ids"] for r in client.requests]
    assert sent[2] == [*PROMPT, LOOKUP, 3, END, FOLD, LOOKUP, 5, END, RESULT, 0, 1, 7, END]
    assert sent[3] == [
        *PROMPT, LOOKUP, 3, END, FOLD, LOOKUP, 5, END, FOLD, *SOLVE[2], RESULT, 0, 5, 9, END,
    ]  # fmt: skip
    assert [t.folded for t in traj.turns] == [0, 0, 4, 8]
    rows = traj.training_rows()
    assert len(rows) == 4
    for (tokens, mask, logprobs), request, action in zip(rows, sent, SOLVE, strict=True):
        assert tokens == request + action
        assert mask == [False] * len(request) + [True] * len(action)
        assert logprobs == [0.0] * len(request) + [-0.5 - 0.01 * i for i in range(len(action))]
    # a fold diverges from what the session holds: only the common prefix is reused
    assert traj.turns[2].cached_tokens == len(PROMPT) + 3
    # the record is still the full one, the same as without folding
    assert (
        traj.tokens()
        == run_episode(env, ScriptedClient(SOLVE), "ep7", problem=LOOKUP_PROBLEM).tokens()
    )


@pytest.mark.parametrize(
    ("reply", "match"),
    [
        ("nope", "not a JSON object"),
        ({"output_ids": [], "output_logprobs": []}, "1 .. 9 tokens"),
        ({"output_ids": [1] * 10, "output_logprobs": [-1.0] * 10}, "1 .. 9 tokens"),
        ({"output_ids": [1, "2"], "output_logprobs": [-1.0, -1.0]}, "'output_ids'"),
        ({"output_ids": [1, -2], "output_logprobs": [-1.0, -1.0]}, "'output_ids'"),
        ({"output_ids": [1, 2], "output_logprobs": [-1.0]}, "as long as"),
        ({"output_ids": [1], "output_logprobs": [float("nan")]}, "finite"),
        ({"output_ids": [1], "output_logprobs": [0.5]}, "finite numbers <= 0"),
        ({"output_ids": [1], "output_logprobs": [-1.0], "cached_tokens": 0}, "policy_version"),
        (
            {"output_ids": [1], "output_logprobs": [-1], "policy_version": 0, "cached_tokens": 6},
            r"'cached_tokens' must be an int in \[0, 5\]",
        ),
    ],
)
def test_bad_gateway_replies_are_refused(reply, match):
    class Bad:
        def generate(self, input_ids, session_id, **sampling):
            return reply

    with pytest.raises(GatewayError, match=match):
        run_episode(AgentEnv("lookup"), Bad(), "ep", problem=LOOKUP_PROBLEM)


def test_run_episode_arguments():
    with pytest.raises(ConfigError, match="'max_turns'"):
        run_episode(AgentEnv(), ScriptedClient([]), "e", problem=LOOKUP_PROBLEM, max_turns=0)


@pytest.mark.parametrize(
    ("sampling", "match"),
    [
        (dict(temperature=1e-300), r"temperature must be .*use temperature 0\)"),
        (dict(temperature="hot"), "temperature must be a number"),
        (dict(top_p=0.0), r"top_p must be a number in \(0, 1\]"),
        (dict(seed=1 << 64), "seed must be an int from -2\\*\\*63"),
    ],
)
def test_run_episode_refuses_bad_sampling_before_any_request(sampling, match):
    client = ScriptedClient(SOLVE)
    with pytest.raises(ConfigError, match=match):
        run_episode(AgentEnv(), client, "e", problem=LOOKUP_PROBLEM, **sampling)
    assert client.requests == []


def test_mean_summary():
    env = AgentEnv("lookup")
    solved = run_episode(env, ScriptedClient(SOLVE), "a", problem=LOOKUP_PROBLEM)
    wrong = run_episode(env, ScriptedClient([[ANSWER, 0, 5, 0, END]]), "b", problem=LOOKUP_PROBLEM)
    summary = mean_summary([episode_summary(solved), episode_summary(wrong)])
    assert summary == {
        "episodes": 2,
        "mean_reward": pytest.approx((1 + 2 / 3) / 2),
        "solved": 1,
        "turns": 5,
        "generated_tokens": 20 + 5,
        "folded_tokens": 0,
        "dropped_tokens": 0,
        "cache_reuse": pytest.approx((7 + 15 + 29) / (74 + 5)),
    }
    with pytest.raises(ConfigError, match="no episodes"):
        mean_summary([])


def test_trajectory_of_no_turns():
    traj = Trajectory(LOOKUP_PROBLEM)
    assert traj.tokens() == list(PROMPT) and traj.action_mask() == [False] * 5
    assert episode_summary(traj)["cache_reuse"] == 0.0


# ---------------------------------------------------------------- the HTTP client


def mock_client(handler, token=None) -> GatewayClient:
    import httpx

    return GatewayClient(
        "http://gw.test", token, http=httpx.Client(transport=httpx.MockTransport(handler))
    )


def test_gateway_client_request_and_errors():
    import httpx

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        body = json.loads(request.content)
        if body["input_ids"] == [1]:
            return httpx.Response(422, json={"detail": "input_ids: ids outside [0, 128)"})
        if body["input_ids"] == [2]:
            return httpx.Response(503, text="overloaded")
        if body["input_ids"] == [3]:
            raise httpx.ReadTimeout("slow", request=request)
        return httpx.Response(200, json={"output_ids": [3], "echo": body})

    client = mock_client(handler, token="s3cret")
    assert client.health() == {"status": "ok"}
    reply = client.generate([5, 6], "s", max_new_tokens=4, seed=None)
    assert reply["echo"] == {
        "input_ids": [5, 6],
        "session_id": "s",
        "max_new_tokens": 4,
        "seed": None,
    }
    assert seen[-1].headers["authorization"] == "Bearer s3cret" and seen[-1].method == "POST"
    with pytest.raises(GatewayError, match=r"HTTP 422: input_ids: ids outside \[0, 128\)"):
        client.generate([1], "s")
    with pytest.raises(GatewayError, match="HTTP 503: overloaded"):
        client.generate([2], "s")
    with pytest.raises(
        GatewayError, match=r"no answer from the gateway at http://gw.test within 60 s"
    ):
        client.generate([3], "s")
    mock_client(handler).health()
    assert "authorization" not in seen[-1].headers


def test_gateway_client_unreachable():
    import socket

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with GatewayClient(url, timeout=2.0) as client, pytest.raises(GatewayError) as err:
        client.health()
    assert f"cannot reach the gateway at {url}" in str(err.value)


# ---------------------------------------------------------------- through the real gateway


@pytest.fixture(scope="module")
def tiny():
    from glmport.model import GlmMoeDsaForCausalLM

    torch.manual_seed(0)
    return GlmMoeDsaForCausalLM.from_config("tiny", seed=0).eval()


@pytest.fixture(scope="module")
def gateway(tiny):
    from glmport.rl.agent import local_gateway

    with local_gateway(tiny, version=3) as client:
        yield client


def fresh(model, context, seed, max_new):
    """Independent reference: a fresh full generate of the request's context."""
    from glmport.model.generation import generate

    result = generate(
        model,
        [list(context)],
        max_new,
        greedy=False,
        temperature=1.0,
        seed=seed,
        stop_tokens=[END],
        return_logprobs=True,
    )
    return result.output_ids[0], result.logprobs[0].tolist()


def held_prefix(before: Turn, context) -> int:
    """Tokens a session cache reuses: the common prefix of what it holds after ``before``
    (its input and all its output but the last token) and the new input (never all of it)."""
    held = list(before.context) + list(before.action[:-1])
    n = 0
    while n < min(len(held), len(context) - 1) and held[n] == context[n]:
        n += 1
    return n


@pytest.mark.parametrize("context", [FullContext(), KeepRecent(0), KeepRecent(1), hybrid(1, 30)])
def test_episodes_through_the_gateway(gateway, tiny, context):
    env = AgentEnv("lookup", max_turns=4)
    problem = env.sample(gen(11))
    traj = run_episode(
        env, gateway, f"gw-{context.spec()}", problem=problem, context=context, seed=5
    )
    assert len(traj.turns) >= 2
    for i, turn in enumerate(traj.turns):
        assert turn.policy_version == 3
        expected = context(problem.prompt, traj.turns[:i], FOLD)
        assert turn.context == expected.tokens
        # the recorded action and log-probs are exactly those a fresh generate samples
        ids, logprobs = fresh(tiny, turn.context, 5 + i, env.max_new_tokens)
        assert list(turn.action) == ids
        assert list(turn.logprobs) == pytest.approx(logprobs, abs=1e-5)
        assert turn.cached_tokens == (held_prefix(traj.turns[i - 1], turn.context) if i else 0)
    # a request that extends the last continues the session (nothing recomputed); one the
    # strategy changed (an observation folded, the history dropped) forks it
    forks = 0
    for before, turn in zip(traj.turns, traj.turns[1:], strict=False):
        extends = turn.context[: len(before.context) + len(before.action)] == (
            before.context + before.action
        )
        continued = turn.cached_tokens == len(before.context) + len(before.action) - 1 > 0
        assert continued == extends
        forks += not extends
    # keep-recent-0 folds each observation before any request holds it: append-only too
    assert (forks == 0) == (context in (FullContext(), KeepRecent(0)))
    assert any(t.dropped for t in traj.turns) == isinstance(context, DiscardAll)


def test_gateway_refusal_is_a_clear_error(gateway):
    with pytest.raises(GatewayError, match="HTTP 4"):
        gateway.generate([500], "bad", max_new_tokens=1, temperature=1.0)


# ---------------------------------------------------------------- the command line


def test_cli_agent(capsys):
    from glmport.cli import main

    argv = ["rl", "agent", "--episodes", "2", "--max-turns", "3", "--context", "keep-recent:1"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["context"] == "keep-recent:1" and len(report["episodes"]) == 2
    for e in report["episodes"]:
        assert 1 <= e["turns"] <= 3
        assert e["calls"] + e["errors"] + (e["end"] == "answer") == e["turns"]
        assert 0 <= e["cached_tokens"] <= e["context_tokens"]
    summary = report["summary"]
    assert summary["episodes"] == 2
    assert summary["turns"] == sum(e["turns"] for e in report["episodes"])
    assert main(["rl", "agent", "--episodes", "1", "--max-turns", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("env lookup:") and lines[1].startswith("episode 0: reward")
    assert lines[2].startswith("1 episodes: mean reward") and len(lines) == 3


def test_cli_agent_remote_gateway_with_token(tiny, capsys):
    from glmport.cli import main
    from glmport.rl.gateway import running_server, start_local_pool
    from glmport.rl.gateway_app import create_app

    pool = start_local_pool(tiny, 9)
    try:
        with running_server(create_app(pool, token="s3")) as url:
            argv = ["rl", "agent", "--gateway", url, "--episodes", "1", "--max-turns", "2"]
            assert main([*argv, "--token", "s3", "--json"]) == 0
            report = json.loads(capsys.readouterr().out)
            assert report["episodes"][0]["turns"] == 2
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert err.startswith("glmport: error: gateway POST /generate: HTTP 401")
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--context", "most"], "unknown context strategy 'most'"),
        (["--token", "t"], "--token is the bearer token of --gateway"),
        (["--episodes", "0"], "argument --episodes: expected an integer from 1"),
        (["--gateway", "http://127.0.0.1:9", "--model", "tiny"], "not allowed with"),
    ],
)
def test_cli_agent_errors(capsys, argv, message):
    from glmport.cli import main

    try:
        code = main(["rl", "agent", *argv])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("glmport: error:") and message in err and len(err.splitlines()) == 1
