"""The gateway's per-session KV cache reuse (rl/sessions.py): a continued or forked
session gives exactly what a fresh ``generate`` on the full token list gives, its
held tokens are exact, sessions are evicted least recently used first, and bad input
is refused by name."""

from __future__ import annotations

import pytest
import torch

from glmport.core.errors import ConfigError
from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from glmport.model.generation import generate
from glmport.rl.sessions import SessionStore

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-5
PROMPT = [5, 17, 3, 99, 42, 8, 61]


@pytest.fixture(scope="module")
def model():
    return GlmMoeDsaForCausalLM.from_config("tiny", seed=0).eval().requires_grad_(False)


def fresh(model, input_ids, n, *, temperature=0.0, **sampling):
    """The independent reference: one ``generate`` on the full token list."""
    if temperature == 0:
        result = generate(model, [input_ids], n, greedy=True, return_logprobs=True, **sampling)
    else:
        result = generate(
            model,
            [input_ids],
            n,
            greedy=False,
            temperature=temperature,
            return_logprobs=True,
            **sampling,
        )
    return result.output_ids[0], result.logprobs[0].tolist()


def assert_matches(out, model, input_ids, n, **sampling):
    ids, logprobs = fresh(model, input_ids, n, **sampling)
    assert out.output_ids == ids
    assert out.output_logprobs == pytest.approx(logprobs, abs=TOL)


def test_continued_session_equals_a_fresh_generate(model):
    store = SessionStore(model, max_sessions=4)
    first = store.generate("a", PROMPT, max_new_tokens=6, temperature=0)
    assert first.cached_tokens == 0 and len(first.output_ids) == 6
    assert_matches(first, model, PROMPT, 6)
    # The last new token has not been fed yet: the cache holds everything before it.
    assert store.held_tokens("a") == PROMPT + first.output_ids[:-1]
    assert store.cache.length(0) == len(PROMPT) + 5

    # An agent turn: the output so far plus a tool result.
    second_in = PROMPT + first.output_ids + [7, 7, 100]
    second = store.generate("a", second_in, max_new_tokens=5, temperature=0)
    assert second.cached_tokens == len(PROMPT) + 5
    assert_matches(second, model, second_in, 5)
    assert store.held_tokens("a") == second_in + second.output_ids[:-1]


def test_diverging_request_forks_and_a_repeat_reuses_all_but_the_last(model):
    store = SessionStore(model, max_sessions=4)
    base = [*PROMPT, 1, 2, 3, 4, 5]
    store.generate("s", base, max_new_tokens=4, temperature=0)
    fork_in = [*PROMPT[:4], 77, 78]
    fork = store.generate("s", fork_in, max_new_tokens=4, temperature=0)
    assert fork.cached_tokens == 4
    assert_matches(fork, model, fork_in, 4)
    assert store.held_tokens("s") == fork_in + fork.output_ids[:-1]

    # The same input again: everything but its last token is reused (its logits are
    # needed to choose the first new token), and the answer is the same.
    again = store.generate("s", fork_in, max_new_tokens=4, temperature=0)
    assert again.cached_tokens == len(fork_in) - 1
    assert again.output_ids == fork.output_ids
    assert again.output_logprobs == pytest.approx(fork.output_logprobs, abs=TOL)

    # A shorter request inside the held tokens truncates to it.
    short = store.generate("s", fork_in[:3], max_new_tokens=2, temperature=0)
    assert short.cached_tokens == 2
    assert_matches(short, model, fork_in[:3], 2)


def test_sampled_session_matches_generate_with_the_same_seed(model):
    store = SessionStore(model, max_sessions=4)
    sampling = dict(temperature=0.7, top_k=40, top_p=0.95, seed=123)
    first = store.generate("t", PROMPT, max_new_tokens=8, **sampling)
    assert_matches(first, model, PROMPT, 8, **sampling)
    turn = PROMPT + first.output_ids + [9]
    second = store.generate("t", turn, max_new_tokens=8, **sampling)
    assert second.cached_tokens == len(PROMPT) + 7
    assert_matches(second, model, turn, 8, **sampling)


def test_logprobs_are_the_full_forwards_log_softmax(model):
    """Independent of ``generate``: the sampled tokens' log-probabilities from one
    uncached forward of the whole sequence, at the temperature."""
    store = SessionStore(model, max_sessions=4)
    t = 1.3
    store.generate("u", PROMPT, max_new_tokens=3, temperature=t, seed=5)
    turn = [*PROMPT, 11, 12]
    out = store.generate("u", turn, max_new_tokens=6, temperature=t, seed=6)
    assert out.cached_tokens > 0
    full = torch.tensor([turn + out.output_ids])
    with torch.no_grad():
        logits = model(full).logits[0].double()
    logp = torch.log_softmax(logits / t, dim=-1)
    n = len(turn)
    expected = [logp[n - 1 + i, tok].item() for i, tok in enumerate(out.output_ids)]
    assert out.output_logprobs == pytest.approx(expected, abs=1e-4)


def test_stop_token_ends_the_output_and_the_bookkeeping_follows(model):
    store = SessionStore(model, max_sessions=4)
    ids, _ = fresh(model, PROMPT, 6)
    stop = ids[2]
    out = store.generate("v", PROMPT, max_new_tokens=6, temperature=0, stop_tokens=[stop])
    assert out.output_ids == ids[: ids.index(stop) + 1]
    assert store.held_tokens("v") == PROMPT + out.output_ids[:-1]
    # One new token: the cache holds just the input.
    one = store.generate("w", PROMPT, max_new_tokens=1, temperature=0)
    assert one.output_ids == ids[:1] and store.held_tokens("w") == PROMPT


def test_least_recently_used_session_is_evicted(model):
    store = SessionStore(model, max_sessions=2)
    for sid in ("a", "b"):
        store.generate(sid, PROMPT, max_new_tokens=2, temperature=0)
    store.generate("a", [*PROMPT, 1], max_new_tokens=2, temperature=0)  # a is now recent
    store.generate("c", PROMPT, max_new_tokens=2, temperature=0)  # evicts b
    assert "b" not in store and "a" in store and "c" in store and len(store) == 2
    again = store.generate("b", [*PROMPT, 1], max_new_tokens=2, temperature=0)
    assert again.cached_tokens == 0  # its cache was freed
    assert "a" not in store  # the least recent then


def test_a_full_cache_evicts_old_sessions_to_make_room():
    config = GlmMoeDsaConfig.tiny(max_position_embeddings=64)
    small = GlmMoeDsaForCausalLM.from_config(config, seed=0).eval().requires_grad_(False)
    store = SessionStore(small, max_sessions=8, block_size=16, cache_tokens=64)
    assert store.cache.num_blocks == 4
    long = list(range(30))
    store.generate("a", long, max_new_tokens=10, temperature=0)  # 39 tokens: 3 blocks
    out = store.generate("b", long[::-1], max_new_tokens=10, temperature=0)
    assert "a" not in store and "b" in store
    assert_matches(out, small, long[::-1], 10)
    # A request up to the whole context still fits.
    store.generate("c", list(range(60)), max_new_tokens=4, temperature=0)
    assert list(store._sessions) == ["c"]


def test_clear_frees_every_session(model):
    store = SessionStore(model, max_sessions=4)
    for sid in ("a", "b", "c"):
        store.generate(sid, PROMPT, max_new_tokens=3, temperature=0)
    assert store.cache.num_free_blocks < store.cache.num_blocks
    store.clear()
    assert len(store) == 0 and store.cache.num_free_blocks == store.cache.num_blocks
    out = store.generate("a", PROMPT, max_new_tokens=3, temperature=0)
    assert out.cached_tokens == 0
    assert_matches(out, model, PROMPT, 3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(input_ids=[1, 128]), r"input_ids has token ids outside \[0, 128\): \[128\]"),
        (dict(input_ids=[1, -1]), r"input_ids has token ids outside"),
        (dict(input_ids=[]), "input_ids must be a non-empty list"),
        (dict(input_ids=[1, True]), "input_ids has token ids outside"),
        (
            dict(input_ids=[1] * 4090, max_new_tokens=7),
            r"input_ids \(4090 tokens\) \+ max_new_tokens 7 exceeds max_position_embeddings 4096",
        ),
        (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1, got 0"),
        (dict(max_new_tokens=2.0), "max_new_tokens must be an int"),
        (dict(temperature=-1.0), r"temperature must be .* got -1.0 .*use temperature 0\)"),
        (dict(top_p=0.0), r"top_p must be a number in \(0, 1\]"),
        (dict(top_k=-2), "top_k must be an int >= 0"),
        (dict(stop_tokens=[500]), r"stop_tokens has token ids outside \[0, 128\): \[500\]"),
        (dict(session_id=""), "session_id must be a non-empty string"),
    ],
)
def test_bad_requests_are_refused_by_name(model, kwargs, match):
    store = SessionStore(model, max_sessions=2)
    args = dict(session_id="x", input_ids=PROMPT, max_new_tokens=2, temperature=0.0)
    args = {**args, **kwargs}
    with pytest.raises(ConfigError, match=match):
        store.generate(args.pop("session_id"), args.pop("input_ids"), **args)
    assert len(store) == 0  # nothing half-made
