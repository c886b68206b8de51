"""Sampling parameters (model/sampling.py): one range check for every caller, a sampler
that never crashes inside the range (greedy is its limit), and reported log-probs that
are finite and <= 0.

The accepted ranges are restated here from the documentation (docs/model.md), not read
from the code: ``accepted`` below is the test's own predicate.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import glmport.ops
from glmport.cli import main
from glmport.core.errors import ConfigError
from glmport.model import GlmMoeDsaForCausalLM
from glmport.model.generation import LogprobContractError, generate
from glmport.model.sampling import (
    Sampler,
    SamplingNames,
    SamplingParameterError,
    check_sampling,
)

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 33, 2, 90]
FIELDS = ("temperature", "top_p", "top_k", "seed")
CLI_NAMES = SamplingNames("--temperature", "--top-p", "--top-k", "--seed", "--greedy")
# The values the issue found crashing or silently wrong, the ends of each range and
# their neighbours, and values of the wrong type.
EXTREMES = [
    0.0,
    -0.0,
    5e-324,
    1e-300,
    1e-45,
    1e-30,
    math.nextafter(1e-6, 0),
    1e-6,
    1e6,
    math.nextafter(1e6, math.inf),
    1e30,
    3.5e38,
    1e300,
    math.inf,
    -math.inf,
    math.nan,
    1,
    2,
    -1,
    1 << 63,
    (1 << 64) - 1,
    1 << 64,
    -(1 << 63),
    -(1 << 63) - 1,
    True,
    None,
    "1",
]
SETTINGS = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def accepted(field: str, v: object) -> bool:
    """The documented ranges (docs/model.md), written independently of the code."""
    if field == "temperature":
        return _number(v) and 1e-6 <= v <= 1e6
    if field == "top_p":
        return _number(v) and 0 < v <= 1
    if field == "top_k":
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**64)


values = st.one_of(
    st.sampled_from(EXTREMES),
    st.floats(),
    st.floats(min_value=1e-7, max_value=1e7),
    st.integers(min_value=-(2**70), max_value=2**70),
)


@pytest.fixture(scope="module")
def model() -> GlmMoeDsaForCausalLM:
    return GlmMoeDsaForCausalLM.from_config("tiny", seed=0).eval().requires_grad_(False)


@SETTINGS
@given(field=st.sampled_from(FIELDS), value=values, cli=st.booleans())
def test_check_sampling_accepts_exactly_the_documented_ranges(field, value, cli):
    names = CLI_NAMES if cli else SamplingNames()
    try:
        params = check_sampling(**{field: value}, names=names)
    except SamplingParameterError as err:
        assert not accepted(field, value), f"{field}={value!r} refused: {err}"
        spelled = getattr(names, field)
        assert (err.field, err.name) == (field, spelled)
        assert err.value is value and err.accepted in str(err)
        assert str(err).startswith(f"{spelled} must be ") and repr(value) in str(err)
        if field == "temperature":  # says how this caller asks for argmax instead
            assert f"use {names.greedy}" in str(err)
        return
    assert accepted(field, value), f"{field}={value!r} accepted"
    assert getattr(params, field) == value


def test_greedy_checks_no_temperature_and_reports_log_probs_at_one():
    params = check_sampling(greedy=True, temperature=1e-300)
    assert params.greedy and params.temperature == 1.0
    with pytest.raises(ConfigError, match="greedy must be True or False"):
        check_sampling(greedy=1)


def _kept_float64(logits: torch.Tensor, temperature: float, top_p: float, top_k: int):
    """The tokens the sampling distribution keeps, per row, and which of them have a
    probability above 0, in float64 (a slack of 1e-6 at the top-p boundary)."""
    z = logits.double() / temperature
    z = z - z.amax(dim=-1, keepdim=True)
    if top_k:
        kth = z.topk(min(top_k, z.shape[-1]), dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, -math.inf)
    probs = z.softmax(dim=-1)
    order = probs.argsort(dim=-1, descending=True)
    sorted_p = probs.gather(-1, order)
    before = sorted_p.cumsum(dim=-1) - sorted_p
    keep_sorted = before < top_p + 1e-6
    keep_sorted[:, 0] = True
    keep = keep_sorted.scatter(-1, order, keep_sorted)
    return keep & (probs > 0), probs


@SETTINGS
@given(
    seed=st.integers(0, 2**32),
    scale=st.sampled_from([1e-3, 1.0, 30.0, 1e4]),
    temperature=st.one_of(
        st.sampled_from([1e-6, 1e-3, 1.0, 1e6]), st.floats(min_value=1e-6, max_value=1e6)
    ),
    top_p=st.one_of(
        st.sampled_from([5e-324, 1e-300, 1e-45, 1e-8, 0.5, 1.0]),
        st.floats(min_value=5e-324, max_value=1.0),
    ),
    top_k=st.sampled_from([0, 1, 3, 200, 2**70]),
)
def test_sampler_never_fails_inside_the_range_and_tends_to_greedy(
    seed, scale, temperature, top_p, top_k
):
    """Inside the range the sampler returns a token the float64 distribution gives a
    positive probability after top-k / top-p; top-p at or below the best token's
    probability (even where it rounds to 0 in fp32) is greedy."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 64, generator=gen) * scale
    params = check_sampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    chosen = Sampler(params, torch.device("cpu"))(logits)
    keep, probs = _kept_float64(logits, temperature, top_p, top_k)
    assert chosen.shape == (3,) and chosen.dtype == torch.int64
    for row, token in enumerate(chosen.tolist()):
        assert keep[row, token], (row, token, probs[row, token].item())
        if top_p < probs[row].max().item() - 1e-6:
            assert token == logits[row].argmax().item()


@settings(SETTINGS, max_examples=40)
@given(
    temperature=st.one_of(st.sampled_from(EXTREMES), st.floats()),
    top_p=st.one_of(st.sampled_from([5e-324, 1e-300, 1e-45, 0.3, 1.0, 0.0, 1.5]), st.floats()),
)
def test_generate_refuses_by_name_or_reports_finite_log_probs(model, temperature, top_p):
    """The API at any parameters: a refusal naming the parameter for values outside the
    documented range (never another exception), else outputs whose log-probabilities
    are finite, <= 0, and the float64 log-softmax of the full forward (above T = 0.1,
    where fp32 logits resolve it to 1e-3)."""
    try:
        result = generate(
            model,
            [PROMPT],
            3,
            greedy=False,
            temperature=temperature,
            top_p=top_p,
            seed=7,
            return_logprobs=True,
        )
    except SamplingParameterError as err:
        assert not (accepted("temperature", temperature) and accepted("top_p", top_p)), err
        assert not accepted(err.field, err.value)
        return
    assert accepted("temperature", temperature) and accepted("top_p", top_p)
    out, logp = result.output_ids[0], result.logprobs[0]
    assert torch.isfinite(logp).all() and (logp <= 0).all(), logp
    if temperature >= 0.1:
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + out[:-1]])).logits[0].double()
        ref = torch.log_softmax(logits / temperature, dim=-1)
        expected = [ref[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(out)]
        assert logp.tolist() == pytest.approx(expected, abs=1e-3)


def _entry_points(model):
    """Every caller that takes a sampling temperature, called with ``t``."""
    from glmport.model.scoring import continuation_logprobs
    from glmport.rl.sessions import SessionStore
    from glmport.rl.workers import GroupSampling

    store = SessionStore(model, max_sessions=1)
    return {
        "generate": lambda t: generate(model, [PROMPT], 2, greedy=False, temperature=t),
        "SessionStore.generate": lambda t: store.generate(
            "s", PROMPT, max_new_tokens=2, temperature=t
        ),
        "continuation_logprobs": lambda t: continuation_logprobs(
            model, [PROMPT], [[1, 2]], temperature=t
        ),
        "GroupSampling": lambda t: GroupSampling(2, 4, t),
    }


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-30, 1e300, math.inf, -1.0])
def test_every_entry_point_refuses_the_same_temperatures(model, temperature):
    for where, call in _entry_points(model).items():
        with pytest.raises(SamplingParameterError) as caught:
            call(temperature)
        assert caught.value.field == "temperature" and caught.value.value == temperature, where


def test_the_smallest_top_p_and_temperature_give_greedys_tokens(model):
    greedy = generate(model, [PROMPT], 4).output_ids
    for kwargs in (dict(top_p=5e-324), dict(top_p=1e-300), dict(temperature=1e-6)):
        sampled = generate(model, [PROMPT], 4, greedy=False, seed=3, **kwargs)
        assert sampled.output_ids == greedy, kwargs


@pytest.mark.parametrize("bad", [1.0, math.nan, -math.inf])
def test_a_backend_log_prob_above_zero_or_nan_is_never_reported(model, monkeypatch, bad):
    """A backend breaking token_logprobs' contract is a loud bug, not a reported value."""
    real = glmport.ops.token_logprobs

    def broken(hidden, weight, targets, temperature):
        logp, entropy = real(hidden, weight, targets, temperature)
        return torch.full_like(logp, bad), entropy

    monkeypatch.setattr(glmport.ops, "token_logprobs", broken)
    with pytest.raises(LogprobContractError, match="finite and <= 0"):
        generate(model, [PROMPT], 2, return_logprobs=True)


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--temperature", "1e-300"], "--temperature"),
        (["--temperature", "5e-324"], "--temperature"),
        (["--temperature", "1e300"], "--temperature"),
        (["--temperature", "inf"], "--temperature"),
        (["--temperature", "nan"], "--temperature"),
        (["--top-p", "0"], "--top-p"),
    ],
)
def test_cli_generate_refuses_out_of_range_sampling_in_one_line(capsys, extra, flag):
    args = ["generate", "--model", "tiny", "--input-ids", "1,2", "--max-new-tokens", "2"]
    assert main([*args, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"glmport: error: {flag} must be ") and err.count("\n") == 1, err
    assert "greedy=True" not in err  # the Python spelling is not the CLI's


@pytest.mark.parametrize("extra", [["--temperature", "0.5"], ["--top-k", "3"], ["--seed", "1"]])
def test_cli_generate_speculative_refuses_sampling_flags_in_one_line(capsys, extra):
    args = ["generate", "--model", "tiny", "--input-ids", "1,2", "--max-new-tokens", "2"]
    assert main([*args, "--speculative", *extra]) == 2
    err = capsys.readouterr().err
    assert err == f"glmport: error: --speculative cannot be combined with {extra[0]}\n", err


def test_cli_generate_top_p_near_zero_is_greedy(capsys):
    args = ["generate", "--model", "tiny", "--input-ids", "1,2", "--max-new-tokens", "3"]
    assert main([*args, "--greedy"]) == 0
    greedy = capsys.readouterr().out.splitlines()[0]
    assert main([*args, "--top-p", "1e-300", "--seed", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == greedy
