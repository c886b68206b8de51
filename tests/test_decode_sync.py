"""A decode step without host synchronisation (issue 30): the model's paged-cache
``decode_step`` reads no tensor value on the host under the default validation, and
``torch.compile(decode_step, fullgraph=True)`` traces it whole.

On an accelerator a host read of a device tensor (``.item()``, ``bool(t)``, ``int(t)``,
``.tolist()``, ``nonzero``, a boolean-mask index) makes the host wait for the device.
The CPU has no such wait, so the tests count the calls themselves, made by any code of
the step but a backend's kernels (``glmport.backends.*``: how a kernel runs is its
backend's business; the generic and cpu kernels do read, to pick tile windows and
expert row ranges); the cuda backend's step is counted whole, its kernels included.
"""

from __future__ import annotations

import pytest
import torch
from host_reads import counting_host_reads

import glmport
from glmport.core.errors import ConfigError
from glmport.core.selection import current_settings
from glmport.core.validate import Level, holds
from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from glmport.model.cache import PagedKVCache, decode_step, forward_cached, plan_step
from glmport.model.packing import Widths

pytestmark = pytest.mark.usefixtures("one_thread")

# index_topk is 4: the first batch mixes sequences past it (the indexer runs) and one
# below it (all its keys are attended); a lone sequence reads its keys in place.
BATCHES = {
    "mixed": [[5, 17, 33, 2, 90, 11, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], [42]],
    "lone": [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]],
}


@pytest.fixture(scope="module")
def model() -> GlmMoeDsaForCausalLM:
    return GlmMoeDsaForCausalLM.from_config(GlmMoeDsaConfig.tiny(index_n_heads=16), seed=0)


def _prefilled(model, prompts: list[list[int]]):
    """A cache holding ``prompts``, its sequence ids and each prompt's greedy next token
    ``[B]`` int64."""
    cache = PagedKVCache.for_config(model.config, model.config.num_hidden_layers, 16, 4)
    seqs = [cache.add_sequence() for _ in prompts]
    step = forward_cached(model, cache, seqs, prompts, last_only=True)
    return cache, seqs, step.logits.argmax(dim=-1)


def test_the_counter_counts_each_kind_of_host_read():
    t, mask = torch.arange(3), torch.tensor([True, False, True])
    with counting_host_reads() as reads:
        t[0].item(), t.tolist(), bool(t[1]), int(t[2]), float(t[0]), t.nonzero()
        t[mask], t[1:]  # a mask reads the count of its True entries; a slice reads nothing
    assert sum(reads.values()) == 7, reads
    assert all(caller == __name__ for _, caller in reads)


def test_the_counter_leaves_tensor_as_it_found_it():
    before = dict(vars(torch.Tensor))
    with counting_host_reads():
        torch.arange(3)[1].item()
    assert dict(vars(torch.Tensor)) == before
    # A 0-d tensor is still no sequence: torch.tensor reads it as a number.
    assert torch.tensor([torch.tensor(0.5), 2.0]).tolist() == [0.5, 2.0]


@pytest.mark.parametrize("backend", ["generic", "cpu"])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_a_decode_step_reads_no_tensor_on_the_host(model, backend: str, batch: str):
    assert current_settings().validate == Level.FULL  # the default
    with glmport.use_backend(backend):
        cache, seqs, tokens = _prefilled(model, BATCHES[batch])
        plan = plan_step(model, cache, seqs)
        with counting_host_reads() as reads:
            logits = decode_step(model, cache, plan, tokens)
    assert not reads, dict(reads)
    assert logits.shape == (len(seqs), model.config.vocab_size)


def test_a_decode_step_on_cuda_reads_nothing_at_all(model, cuda_module):
    """The accelerator backend's own kernels and wrappers read nothing back either
    (Triton under the interpreter: the same wrappers and host plans as on a GPU), so a
    cuda decode step, model and kernels, never waits for the device."""
    cuda_module("runtime")
    for prompts in BATCHES.values():
        with glmport.use_backend("cuda", emulate=True):
            cache, seqs, tokens = _prefilled(model, prompts)
            plan = plan_step(model, cache, seqs)
            with counting_host_reads(exempt="no module") as reads:
                logits = decode_step(model, cache, plan, tokens)
        assert not reads, dict(reads)
        assert torch.isfinite(logits).all()


def test_strict_validation_reads_its_checks_on_the_host(model):
    """The counter is not blind to the step: strict reads each check's verdict."""
    with glmport.use_backend("generic", validate="strict"):
        cache, seqs, tokens = _prefilled(model, BATCHES["mixed"])
        plan = plan_step(model, cache, seqs)
        with counting_host_reads() as reads:
            decode_step(model, cache, plan, tokens)
    assert reads[("__bool__", "glmport.core.validate")] > 0, dict(reads)


@pytest.mark.parametrize("batch", list(BATCHES))
def test_decode_step_equals_the_cached_forward_of_one_token(model, batch: str):
    with glmport.use_backend("generic"):
        cache, seqs, tokens = _prefilled(model, BATCHES[batch])
        twin, twin_seqs, _ = _prefilled(model, BATCHES[batch])
        got = decode_step(model, cache, plan_step(model, cache, seqs), tokens)
        want = forward_cached(model, twin, twin_seqs, [[t] for t in tokens.tolist()]).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert [cache.length(s) for s in seqs] == [len(p) + 1 for p in BATCHES[batch]]


def test_decode_step_compiles_to_one_graph_equal_to_eager(model):
    with glmport.use_backend("generic"):
        cache, seqs, tokens = _prefilled(model, BATCHES["mixed"])
        twin, twin_seqs, _ = _prefilled(model, BATCHES["mixed"])
        eager = decode_step(model, cache, plan_step(model, cache, seqs), tokens)
        compiled = torch.compile(decode_step, fullgraph=True)
        got = compiled(model, twin, plan_step(model, twin, twin_seqs), tokens)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)


def test_decode_step_refuses_token_ids_outside_the_vocabulary_by_name(model):
    cache, seqs, tokens = _prefilled(model, BATCHES["mixed"])
    plan = plan_step(model, cache, seqs)
    bad = tokens.clone()
    bad[1] = model.config.vocab_size
    with pytest.raises(ConfigError, match=r"token_ids must lie in \[0, 128\), got \[.*128"):
        decode_step(model, cache, plan, bad)
    with pytest.raises(ConfigError, match=r"token_ids must be a \[3\] int64 or int32 tensor"):
        decode_step(model, cache, plan, tokens.float())


def test_decode_step_takes_one_new_token_per_sequence(model):
    cache, seqs, tokens = _prefilled(model, BATCHES["mixed"])
    plan = plan_step(model, cache, seqs, [1, 2, 1])
    with pytest.raises(ConfigError, match="one new token per sequence; the plan holds 4"):
        decode_step(model, cache, plan, tokens)


def test_a_failed_check_on_the_cpu_comes_back_false_for_a_precise_error():
    assert holds(torch.tensor(True), "never shown")
    assert not holds(torch.tensor(False), "read back on the cpu")
    assert not holds(torch.tensor(False), "read on the host", reads=True)


def test_widths_count_the_queries_past_a_limit_from_host_ints():
    widths = Widths(((1, 7), (9, 2), (1, 1)))  # a prompt of 7, 2 tokens after 8, a prompt of 1
    assert widths.widest == 10
    assert [widths.wider_than(n) for n in (0, 4, 9, 10)] == [10, 5, 1, 0]
    assert Widths(()).widest == 0 and Widths(()).wider_than(0) == 0
