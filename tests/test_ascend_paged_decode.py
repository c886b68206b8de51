"""Decode on the model's paged cache through the ascend adapters (issue 31, build 1):
the indexer's paged call (``PA_BSND`` through each token's block table) and attention
over the split latent / rope pools (``PA_BSND`` over the pools in place) copy no cache
pool and read nothing back on the host. Both are counted around the adapters only: the
emulator standing in for the NPU runs with the counters paused. The same counters see
the copies of a joint ``[N, 576]`` latent and the host read of an unpaged indexer call,
so they can fail; and the paged step's selection and attention equal the float64
reference's on the same cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from host_reads import counting_host_reads
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import glmport
from glmport.backends.ascend import attention, indexer
from glmport.backends.ascend import emulator as npu_emulator
from glmport.core.tolerance import compare, tolerance
from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from glmport.model.cache import PagedKVCache, StepPlan, plan_step

# GLM-5's widths where the NPU ops take them: latent 512 + rope 64, 16 query heads,
# indexer 16 x 128, topk 64; pages of 16 slots, 64 blocks (1024 slots per pool).
CONFIG = GlmMoeDsaConfig.tiny(
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    num_attention_heads=16,
    index_n_heads=16,
    index_head_dim=128,
    index_topk=64,
)
MODEL = GlmMoeDsaForCausalLM.from_config(CONFIG, seed=0)  # plan_step reads its rope and device
BLOCKS, PAGE = 64, 16
LENGTHS = (150, 70, 301)  # cached tokens of three sequences before the decode step
EMULATOR = "glmport.backends.ascend.emulator"


class _CacheCopies(TorchDispatchMode):
    """Records every op whose output is a new tensor at least as large as the smallest
    cache pool (``threshold`` elements): a copy of a cache, or a temporary of its size.
    Views (outputs sharing an input's storage) are not copies."""

    def __init__(self, threshold: int) -> None:
        super().__init__()
        self.threshold, self.copies = threshold, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr()
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        }
        for o in torch.utils._pytree.tree_leaves(out):
            if (
                isinstance(o, torch.Tensor)
                and o.numel() >= self.threshold
                and o.untyped_storage().data_ptr() not in inputs
            ):
                self.copies.append((str(func), tuple(o.shape)))
        return out


def _paused(fn: Callable) -> Callable:
    """``fn`` (an emulated NPU op: the device's own work) run with the modes off."""

    def call(*args, **kwargs):
        with _disable_current_modes():
            return fn(*args, **kwargs)

    return call


NPU = SimpleNamespace(
    npu_lightning_indexer=_paused(npu_emulator.npu_lightning_indexer),
    npu_sparse_flash_attention=_paused(npu_emulator.npu_sparse_flash_attention),
)


@contextmanager
def counting(threshold: int) -> Iterator[tuple[list, object]]:
    """``(copies, host reads)`` made by the code run inside, the emulator's excepted."""
    copies = _CacheCopies(threshold)
    with counting_host_reads(exempt=EMULATOR) as reads, copies:
        yield copies.copies, reads


class _Step:
    """A decode step's inputs on a filled paged cache: one new token per sequence."""

    def __init__(self, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(0)
        self.cache = PagedKVCache.for_config(CONFIG, 1, BLOCKS, PAGE, dtype=dtype)
        # Interleave the sequences' blocks: no sequence is one run of slots.
        seqs = [self.cache.add_sequence() for _ in LENGTHS]
        for chunk in range(0, max(LENGTHS), 40):
            for seq, length in zip(seqs, LENGTHS, strict=True):
                if chunk < length:
                    self.cache.append(seq, min(40, length - chunk))
        for pool in (self.cache.latent[0], self.cache.rope[0], self.cache.index_keys[0]):
            pool.copy_(torch.randn(pool.shape, generator=gen).to(dtype))
        self.plan: StepPlan = plan_step(MODEL, self.cache, seqs)
        t = len(seqs)
        self.q_index = torch.randn(t, CONFIG.index_n_heads, 128, generator=gen).to(dtype)
        self.weights = torch.randn(t, CONFIG.index_n_heads, generator=gen) * 0.05
        self.q = torch.randn(t, CONFIG.num_attention_heads, 576, generator=gen).to(dtype)
        self.latent = self.cache.latent[0][:, None, :]
        self.rope = self.cache.rope[0][:, None, :]
        self.keys = self.plan.paged(self.cache.index_keys[0])

    def select(self, npu=NPU) -> torch.Tensor:
        """The adapter's paged indexer call: logical positions ``[T, topk]``."""
        p = self.plan
        return indexer.lightning_indexer(
            npu, self.q_index, self.keys, self.weights, p.k_start, p.k_end,
            CONFIG.index_topk, None, None, p.block_table, False,
        )[0]  # fmt: skip

    def attend(self, slots: torch.Tensor, npu=NPU) -> torch.Tensor:
        return attention.sparse_attention(
            npu, self.q, self.latent, self.latent, slots, 0.04, False, self.rope
        )[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_paged_decode_step_copies_no_cache_and_reads_nothing_back(dtype):
    step = _Step(dtype)
    threshold = step.cache.rope[0].numel()  # the smallest pool
    with counting(threshold) as (copies, reads):
        slots = step.plan.physical(step.select())
        step.attend(slots)
    assert copies == [] and not reads, (copies, dict(reads))


def test_the_counters_see_a_joint_latent_copied_and_an_unpaged_call_read_back():
    step = _Step(torch.bfloat16)
    joint = torch.cat((step.latent, step.rope), dim=-1)  # [N, 1, 576]: the layout before
    slots = torch.randint(0, joint.shape[0], (3, 32), dtype=torch.int32)
    with counting(step.cache.rope[0].numel()) as (copies, reads):
        attention.sparse_attention(NPU, step.q, joint, joint[..., :512], slots, 0.04, False)
    assert len(copies) >= 2, copies  # k[..., :512] and k[..., 512:], every call
    flat = step.cache.index_keys[0]
    start = torch.zeros(3, dtype=torch.int32)
    end = torch.tensor([100, 200, 300], dtype=torch.int32)
    with counting(step.cache.rope[0].numel()) as (copies, reads):
        indexer.lightning_indexer(NPU, step.q_index, flat, step.weights, start, end, 64)
    assert reads, "the unpaged call cuts batches from the ranges' values: a host read"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_paged_step_selects_and_attends_as_the_reference(dtype):
    step = _Step(dtype)
    p = step.plan
    picked = step.select()
    with glmport.use_backend("cpu"):
        want, _ = glmport.ops.lightning_indexer(
            step.q_index.float(), step.keys.float(), step.weights,
            p.k_start, p.k_end, CONFIG.index_topk, None, None, p.block_table,
        )  # fmt: skip
        slots = p.physical(picked)
        ref, _ = glmport.ops.sparse_attention(
            step.q.float(), step.latent.float(), step.latent.float(), slots, 0.04, False,
            step.rope.float(),
        )  # fmt: skip
    # The same keys: bf16 / fp16 scores order the near-ties their own way, so compare
    # the sets where the reference's scores are clear of the k-th best.
    for t in range(picked.shape[0]):
        got = set(picked[t][picked[t] >= 0].tolist())
        assert len(got) == min(CONFIG.index_topk, int(p.k_end[t]))
        assert len(got & set(want[t].tolist())) >= 0.9 * len(got)
    out = step.attend(slots)
    verdict = compare(out.float(), ref, tolerance("sparse_attention", dtype))
    assert verdict.ok, verdict
    # Discriminative: attending the slots of another token's sequence is far off.
    other = step.attend(slots.roll(1, dims=0))
    assert not compare(other.float(), ref, tolerance("sparse_attention", dtype)).ok


def test_through_the_dispatcher_the_paged_calls_run_on_ascend_itself(caplog):
    step = _Step(torch.bfloat16)
    p = step.plan
    with glmport.use_backend("ascend", emulate=True), caplog.at_level("WARNING", "glmport"):
        picked, scores = glmport.ops.lightning_indexer(
            step.q_index, step.keys, step.weights, p.k_start, p.k_end, CONFIG.index_topk,
            None, None, p.block_table, False,
        )  # fmt: skip
        glmport.ops.sparse_attention(
            step.q, step.latent, step.latent, p.physical(picked), 0.04, False, step.rope
        )
    assert scores.shape == (0,)
    assert not [r for r in caplog.records if "falling back" in r.getMessage()], caplog.text
