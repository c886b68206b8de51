"""The paged forms of the attention ops' contracts (issue 31, build 1): a malformed
paged indexer call or split rope key is refused with an ``OpInputError`` naming the
argument; table entries past what a range reads are never read; and the model's
cached steps read the pools only through the ops (no packed copy of any pool)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import glmport
from glmport.core.errors import OpInputError
from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from glmport.model.cache import PagedKVCache, forward_cached


def _paged_call(gen: torch.Generator) -> list:
    """A valid paged call: 3 queries, pages of 4 keys, 6 blocks, tables of 3 entries."""
    q = torch.randn(3, 2, 8, generator=gen)
    k = torch.randn(6, 4, 8, generator=gen)
    w = torch.randn(3, 2, generator=gen)
    table = torch.tensor([[5, 0, 2], [1, 3, 4], [2, 99, 99]], dtype=torch.int32)
    start = torch.zeros(3, dtype=torch.int32)
    end = torch.tensor([9, 12, 3], dtype=torch.int32)
    return [q, k, w, start, end, 4, None, None, table, True]


@pytest.mark.parametrize(
    ("arg", "position", "bad"),
    [
        ("k_start", 3, torch.tensor([0, 1, 0], dtype=torch.int32)),  # paged: from 0
        ("k_end", 4, torch.tensor([9, 13, 3], dtype=torch.int32)),  # past 3 blocks x 4
        ("block_table", 8, torch.tensor([[5, 0, 6], [1, 3, 4], [2, 9, 9]], dtype=torch.int32)),
        ("block_table", 8, torch.zeros(3, 3, dtype=torch.int64)),
        ("block_table", 8, torch.zeros(2, 3, dtype=torch.int32)),  # a row per query
        ("k", 1, torch.randn(24, 8)),  # a paged pool is [blocks, block_size, Di]
        ("need_scores", 9, 1),
    ],
)
def test_a_malformed_paged_indexer_call_names_its_argument(arg, position, bad):
    args = _paged_call(torch.Generator().manual_seed(0))
    args[position] = bad
    with pytest.raises(OpInputError) as err:
        glmport.ops.lightning_indexer(*args)
    assert err.value.arg == arg, err.value


def test_table_entries_past_a_range_are_never_read():
    gen = torch.Generator().manual_seed(1)
    args = _paged_call(gen)
    for backend in ("cpu", "generic"):
        with glmport.use_backend(backend):
            clean = glmport.ops.lightning_indexer(*args)
            # Query 2 reads 3 keys: one block. Its other entries may name anything.
            args[8] = args[8].clone()
            args[8][2, 1:] = torch.tensor([-7, 10**6], dtype=torch.int32)
            dirty = glmport.ops.lightning_indexer(*args)
        assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda k: torch.randn(k.shape[0], 1, 5), "wrong width: q is 576 = 512 + 64"),
        (lambda k: torch.randn(k.shape[0] - 1, 1, 64), "one row short"),
        (lambda k: torch.randn(k.shape[0], 1, 64, dtype=torch.float64), "float64"),
        (lambda k: torch.randn(k.shape[0], 1, 64).half(), "not k's dtype"),
    ],
)
def test_a_malformed_rope_key_names_k_rope(make, why):
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 4, 576, generator=gen), torch.randn(10, 1, 512, generator=gen)
    idx = torch.tensor([[0, 3], [9, -1]], dtype=torch.int32)
    with pytest.raises(OpInputError) as err:
        glmport.ops.sparse_attention(q, k, k[..., :512], idx, 0.05, False, make(k))
    assert err.value.arg == "k_rope", why


class _PoolReads(TorchDispatchMode):
    """Records every op that reads one of the pools (by storage) into a new tensor:
    views of a pool and writes into it are not reads."""

    def __init__(self, pools: list[torch.Tensor]) -> None:
        super().__init__()
        self.pools = {p.untyped_storage().data_ptr() for p in pools}
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        inputs = {a.untyped_storage().data_ptr() for a in leaves if isinstance(a, torch.Tensor)}
        if inputs & self.pools:
            for o in torch.utils._pytree.tree_leaves(out):
                if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs:
                    self.reads.append(str(func))
        return out


def test_a_cached_step_reads_the_pools_only_through_the_ops(monkeypatch):
    """The model's own code around the ops only views the pools and writes into them:
    before, a sequence whose blocks were not one run had its indexer keys gathered
    into a packed copy every layer and step. What the ops' kernels do inside is their
    backend's (the mode is paused while an op runs)."""
    config = GlmMoeDsaConfig.tiny(index_topk=4)
    model = GlmMoeDsaForCausalLM.from_config(config, seed=0)
    cache = PagedKVCache.for_config(config, config.num_hidden_layers, num_blocks=64, block_size=4)
    seqs = [cache.add_sequence(), cache.add_sequence()]
    for _ in range(3):  # interleaved blocks: neither sequence is one run of slots
        forward_cached(model, cache, seqs, [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    pools = [*cache.latent, *cache.rope, *(k for k in cache.index_keys if k is not None)]

    def paused(original):
        def call(*args):
            with _disable_current_modes():
                return original(*args)

        return call

    for name in ("lightning_indexer", "sparse_attention"):
        monkeypatch.setattr(glmport.ops, name, paused(getattr(glmport.ops, name)))
    with glmport.use_backend("generic"), _PoolReads(pools) as counter:
        forward_cached(model, cache, seqs, [[11], [12]])
    assert counter.reads == [], counter.reads


def test_tables_of_consecutive_blocks_read_in_place_give_the_reference_choice():
    """generic reads a lone sequence's run of blocks as packed keys (no gather): the
    same choice and scores as the reference, empty ranges and unread entries included."""
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(4, 2, 8, generator=gen), torch.randn(8, 4, 8, generator=gen)
    w = torch.randn(4, 2, generator=gen)
    table = torch.tensor([[2, 3, 4], [2, 3, 99], [5, 6, 7], [-3, 0, 0]], dtype=torch.int32)
    args = (q, k, w, torch.zeros(4, dtype=torch.int32), torch.tensor([11, 7, 12, 0]), 5)
    args = (*args[:4], args[4].int(), 5, None, None, table, True)
    with glmport.use_backend("cpu"):
        want = glmport.ops.lightning_indexer(*args)
    with glmport.use_backend("generic"):
        got = glmport.ops.lightning_indexer(*args)
    assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1])
    assert (want[0][3] == -1).all() and (want[0][0] >= 0).all()
