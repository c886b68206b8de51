"""Recording and replaying the discrete choices (routed experts, indexer selections) of
a forward: generation's record, the packed training forward's replay, gradients, and
the errors on a record that does not fit."""

from __future__ import annotations

import pytest
import torch

import glmport
import glmport.ops as ops
from glmport.core.errors import ConfigError
from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from glmport.model.choices import Choices, choice_tape
from glmport.model.generation import generate
from glmport.model.scoring import continuation_logprobs

# index_topk 4 below most sequence lengths: the indexer really selects.
CONFIG = GlmMoeDsaConfig.tiny(num_nextn_predict_layers=0, vocab_size=64)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [5] * 11]
NEW = 6


@pytest.fixture(scope="module")
def model() -> GlmMoeDsaForCausalLM:
    return GlmMoeDsaForCausalLM.from_config(CONFIG, seed=0)


@pytest.fixture(scope="module")
def rollout(model):
    with glmport.use_backend("cpu"):
        return generate(
            model, PROMPTS, NEW, greedy=False, seed=3, return_logprobs=True, record_choices=True
        )


def _same(a: Choices, b: Choices) -> bool:
    return torch.equal(a.experts, b.experts) and torch.equal(a.indices, b.indices)


def test_generation_records_every_consumed_token(rollout):
    moe_layers = sum(CONFIG.is_moe_layer(i) for i in range(CONFIG.num_hidden_layers))
    for prompt, new, choices in zip(PROMPTS, rollout.output_ids, rollout.choices, strict=True):
        n = len(prompt) + len(new) - 1
        assert choices.experts.shape == (moe_layers, n, CONFIG.num_experts_per_tok)
        assert choices.indices.shape == (CONFIG.num_hidden_layers, n, CONFIG.index_topk)
        assert choices.experts.dtype == torch.int16 and choices.indices.dtype == torch.int32
        # Expert ids in range and distinct per token; key positions causal, -1 only past
        # the visible keys.
        assert int(choices.experts.min()) >= 0 and int(choices.experts.max()) < 8
        e = choices.experts.long().sort(dim=-1).values
        assert bool((e[..., 1:] != e[..., :-1]).all())
        pos = torch.arange(n)[None, :, None]
        idx = choices.indices
        assert bool(((idx == -1) | ((idx >= 0) & (idx <= pos))).all())
        valid = (idx >= 0).sum(dim=-1)
        assert torch.equal(
            valid, torch.clamp(pos[..., 0] + 1, max=CONFIG.index_topk).expand_as(valid)
        )


def test_generation_logprobs_match_float64_log_softmax(model):
    temperature = 0.7
    result = generate(
        model, PROMPTS, NEW, greedy=False, temperature=temperature, seed=5, return_logprobs=True
    )
    for prompt, new, logp in zip(PROMPTS, result.output_ids, result.logprobs, strict=True):
        ids = torch.tensor([prompt + new])
        with torch.no_grad():
            logits = model(ids).logits[0].double()
        ref = torch.log_softmax(logits / temperature, dim=-1)
        expected = ref[len(prompt) - 1 : -1].gather(1, torch.tensor(new)[:, None])[:, 0]
        assert logp.dtype == torch.float32 and logp.shape == (len(new),)
        torch.testing.assert_close(logp.double(), expected, atol=2e-5, rtol=0)


def test_packed_forward_makes_the_cached_rollouts_choices(model, rollout):
    """Same backend and dtype: the training forward, not replaying, chooses exactly what
    the paged-cache rollout chose, and scores the same log-probabilities."""
    with glmport.use_backend("cpu"):
        scored = continuation_logprobs(model, PROMPTS, rollout.output_ids, record=True)
    for b in range(len(PROMPTS)):
        assert _same(scored.choices[b], rollout.choices[b])
        torch.testing.assert_close(
            scored.logprobs[b][scored.mask[b]], rollout.logprobs[b], atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("kinds", [("routing",), ("indices",), ("routing", "indices")])
def test_replay_across_backends_and_dtypes_is_bit_exact(model, kinds):
    """A bf16 rollout on generic, an fp32 training forward on cpu replaying it: the
    choices the training forward used are the rollout's, bit for bit."""
    low = GlmMoeDsaForCausalLM.from_config(CONFIG, seed=0).to(torch.bfloat16)
    with glmport.use_backend("generic"):
        roll = generate(
            low, PROMPTS, NEW, greedy=False, seed=11, return_logprobs=True, record_choices=True
        )
    with glmport.use_backend("cpu"):
        replayed = continuation_logprobs(
            model, PROMPTS, roll.output_ids, replay=roll.choices, kinds=kinds, record=True
        )
    for b in range(len(PROMPTS)):
        for kind in kinds:
            assert torch.equal(replayed.choices[b].get(kind), roll.choices[b].get(kind))


def test_replay_brings_training_logprobs_to_the_rollouts(model):
    low = GlmMoeDsaForCausalLM.from_config(CONFIG, seed=0).to(torch.bfloat16)
    prompts = [[(7 * i + j) % 60 for j in range(12)] for i in range(8)]
    with glmport.use_backend("generic"):
        roll = generate(
            low, prompts, 8, greedy=False, seed=2, return_logprobs=True, record_choices=True
        )
    with glmport.use_backend("cpu"), torch.no_grad():
        free = continuation_logprobs(model, prompts, roll.output_ids, record=True)
        replayed = continuation_logprobs(model, prompts, roll.output_ids, replay=roll.choices)
    rollout_logp = torch.zeros_like(free.logprobs).masked_scatter(
        free.mask, torch.cat(roll.logprobs)
    )
    flipped = sum(not _same(free.choices[b], roll.choices[b]) for b in range(len(prompts)))
    assert flipped > 0, "bf16 vs fp32 should flip at least one discrete choice here"
    gap_free = (free.logprobs - rollout_logp)[free.mask].abs().max()
    gap_replay = (replayed.logprobs - rollout_logp)[free.mask].abs().max()
    assert gap_replay < gap_free


def test_replayed_router_weights_equal_moe_gate(model):
    router = model.model.layers[1].mlp.gate
    x = torch.randn(10, CONFIG.hidden_size, generator=torch.Generator().manual_seed(0))
    weights, ids = router(x)
    logits = torch.nn.functional.linear(x.float(), router.weight.float())
    torch.testing.assert_close(router.weights_for(logits, ids), weights, atol=1e-6, rtol=1e-6)


def test_gradients_flow_through_replayed_choices(model, rollout):
    """Replaying the choices a forward would make anyway changes nothing, gradients
    included: the router's gradient reaches it through the replayed experts' weights."""
    grads = []
    for replay in (None, rollout.choices):
        model.zero_grad(set_to_none=True)
        with glmport.use_backend("cpu"):
            scored = continuation_logprobs(model, PROMPTS, rollout.output_ids, replay=replay)
        scored.logprobs.sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    free, replayed = grads
    assert free.keys() == replayed.keys()
    router = "model.layers.1.mlp.gate.weight"
    assert float(replayed[router].abs().sum()) > 0
    for name in free:
        torch.testing.assert_close(replayed[name], free[name], atol=1e-5, rtol=1e-4)
    model.zero_grad(set_to_none=True)


def test_replay_forces_the_recorded_experts_and_keys(model, rollout):
    choices = rollout.choices[0]
    forced_experts = choices.experts.clone()
    forced_experts[0, 3] = torch.tensor([6, 7], dtype=torch.int16)
    forced_indices = choices.indices.clone()
    forced_indices[1, 5] = torch.tensor([0, 1, -1, -1], dtype=torch.int32)
    forced = Choices(forced_experts, forced_indices)
    with glmport.use_backend("cpu"), torch.no_grad():
        scored = continuation_logprobs(
            model, PROMPTS[:1], rollout.output_ids[:1], replay=[forced], record=True
        )
    assert _same(scored.choices[0], forced)
    assert not torch.allclose(scored.logprobs[0][scored.mask[0]], rollout.logprobs[0], atol=1e-4)


def test_replay_refuses_a_record_that_does_not_fit(model, rollout):
    with pytest.raises(ConfigError, match="choices to replay for sequence 1"):
        continuation_logprobs(model, PROMPTS, rollout.output_ids, replay=rollout.choices[:1])
    short = [c.prefix(len(c) - 1) for c in rollout.choices]
    with pytest.raises(ConfigError, match=r"at position .* holds"):
        continuation_logprobs(model, PROMPTS, rollout.output_ids, replay=short)
    bad = Choices(rollout.choices[0].experts[:, :, :1], rollout.choices[0].indices)
    shape = r"experts has shape \[2, 12, 1\], this model records \[2, L, 2\]"
    with pytest.raises(ConfigError, match=shape):
        continuation_logprobs(model, PROMPTS[:1], rollout.output_ids[:1], replay=[bad])
    with pytest.raises(ConfigError, match="unknown kinds"):
        continuation_logprobs(
            model, PROMPTS, rollout.output_ids, replay=rollout.choices, kinds=("experts",)
        )
    experts = rollout.choices[0].experts.clone()
    experts[0, 0, 0] = 8
    with pytest.raises(ConfigError, match=r"expert ids outside \[0, 8\)"):
        continuation_logprobs(
            model,
            PROMPTS[:1],
            rollout.output_ids[:1],
            replay=[Choices(experts, rollout.choices[0].indices)],
        )
    indices = rollout.choices[0].indices.clone()
    indices[0, 0, 0] = 3  # token 0 sees only key 0
    with pytest.raises(ConfigError, match="sees 1 keys"):
        continuation_logprobs(
            model,
            PROMPTS[:1],
            rollout.output_ids[:1],
            replay=[Choices(rollout.choices[0].experts, indices)],
        )
    with pytest.raises(ConfigError, match="holds no indices choices"):
        continuation_logprobs(
            model,
            PROMPTS[:1],
            rollout.output_ids[:1],
            replay=[Choices(rollout.choices[0].experts, None)],
        )


def test_choice_outside_a_tracked_forward_is_an_error(model):
    router = model.model.layers[1].mlp.gate
    with choice_tape(model), pytest.raises(ConfigError, match="outside a tracked forward"):
        router(torch.zeros(2, CONFIG.hidden_size))


def test_speculative_generation_cannot_record(model):
    config = GlmMoeDsaConfig.tiny(vocab_size=64)
    mtp = GlmMoeDsaForCausalLM.from_config(config, seed=0)
    with pytest.raises(ConfigError, match="need sampled"):
        generate(mtp, PROMPTS, 3, speculative=True, record_choices=True)


def test_greedy_logprobs_are_at_temperature_one(model):
    result = generate(model, PROMPTS[:1], 3, return_logprobs=True)
    hidden_ids = torch.tensor([PROMPTS[0] + result.output_ids[0]])
    with torch.no_grad():
        out = model(hidden_ids)
    logp = torch.log_softmax(out.logits[0].double(), dim=-1)
    n = len(PROMPTS[0])
    expected = logp[n - 1 : -1].gather(1, torch.tensor(result.output_ids[0])[:, None])[:, 0]
    torch.testing.assert_close(result.logprobs[0].double(), expected, atol=2e-5, rtol=0)
    assert ops  # the log-probabilities come from glmport.ops.token_logprobs


@pytest.mark.parametrize(
    ("prompts", "continuations", "message"),
    [
        ([], [], "prompts must be a non-empty list"),
        ([[1]], [[2], [3]], "one token id list per prompt"),
        ([[]], [[2]], r"prompt 0 must be a non-empty list of token ids, got \[\]"),
        ([[1], "ab"], [[2], [3]], "prompt 1 must be a non-empty list of token ids"),
        ([[1]], ["ab"], "continuation 0 must be a list of token ids"),
        ([[1, 64]], [[2]], r"prompt 0 has token ids outside \[0, 64\): \[64\]"),
        ([[1]], [[2, True, -1]], r"continuation 0 has token ids outside \[0, 64\): \[True, -1\]"),
        ([[1] * 4000], [[2] * 97], "exceeds max_position_embeddings 4096"),
    ],
)
def test_scoring_refuses_bad_token_lists(model, prompts, continuations, message):
    with pytest.raises(ConfigError, match=message):
        continuation_logprobs(model, prompts, continuations)
