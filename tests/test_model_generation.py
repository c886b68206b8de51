"""Inference: the paged KV cache, cached forward steps equal to the full forward,
generation (greedy, sampled, stop tokens), MTP speculative decoding equal to greedy,
and ``glmport generate``."""

from __future__ import annotations

import json
import re

import pytest
import torch

import glmport
from glmport.cli import main
from glmport.core.errors import ConfigError
from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM, generation
from glmport.model.cache import (
    CacheCapacityError,
    PagedKVCache,
    forward_cached,
    mtp_forward_cached,
)
from glmport.model.generation import generate
from glmport.model.packing import pack

TOL = 1e-4
# Prompts longer than index_topk (4), of different lengths: the indexer's selection is real.
PROMPTS = [[5, 17, 33, 2, 90, 11, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], [42]]


def _model(seed: int = 0, **overrides) -> GlmMoeDsaForCausalLM:
    # 16 indexer heads: with 4, relu zeros tie index scores exactly and equally valid
    # selections differ. Weights x4: at init std 0.02 attention is nearly uniform and
    # logits nearly flat; x4 makes positions and selections matter (logit std ~2.6)
    # while fp32 cached vs. full differences stay ~1e-5.
    model = GlmMoeDsaForCausalLM.from_config(
        GlmMoeDsaConfig.tiny(index_n_heads=16, **overrides), seed=seed
    )
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    return model


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> GlmMoeDsaForCausalLM:
    return _model()


def _full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0]


def _greedy_by_recompute(model, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(_full_logits(model, torch.tensor(seq))[-1].argmax()))
    return seq[len(prompt) :]


def _cut_at_stop(tokens: list[int], stop: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[: i + 1]
    return tokens


# -- the paged cache -----------------------------------------------------------------


def test_interleaved_sequences_get_non_contiguous_slots_in_logical_order():
    cache = PagedKVCache(num_layers=2, latent_dim=3, index_dim=2, num_blocks=8, block_size=2)
    a, b = cache.add_sequence(), cache.add_sequence()
    got = {a: [], b: []}
    for seq, n in ((a, 3), (b, 1), (a, 2), (b, 4), (a, 1)):
        got[seq] += cache.append(seq, n).tolist()
    assert cache.block_table(a) == [0, 1, 3] and cache.block_table(b) == [2, 4, 5]
    assert got[a] == [0, 1, 2, 3, 6, 7] and got[b] == [4, 5, 8, 9, 10]
    assert cache.slots(a).tolist() == got[a] and cache.slots(b, 1, 3).tolist() == [5, 8]
    assert cache.length(a) == 6 and cache.length(b) == 5 and cache.num_free_blocks == 2


def test_truncate_frees_whole_blocks_and_later_appends_reuse_them():
    cache = PagedKVCache(num_layers=1, latent_dim=3, index_dim=2, num_blocks=4, block_size=2)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append(a, 5)  # blocks 0, 1, 2
    cache.truncate(a, 3)  # keeps blocks 0, 1 (slot 2 of block 1 in use)
    assert cache.block_table(a) == [0, 1] and cache.num_free_blocks == 2
    assert cache.append(a, 1).tolist() == [3]  # fills block 1, takes no block
    assert cache.append(b, 3).tolist() == [4, 5, 6]  # blocks 2, 3
    cache.free(a)
    assert cache.num_free_blocks == 2
    assert cache.append(b, 3).tolist() == [7, 0, 1]  # block 3's tail, then freed block 0
    with pytest.raises(ConfigError, match="unknown sequence id 0"):
        cache.length(a)


def test_a_full_cache_is_a_clear_error_and_changes_nothing():
    cache = PagedKVCache(num_layers=1, latent_dim=3, index_dim=2, num_blocks=3, block_size=4)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append(a, 6)
    with pytest.raises(CacheCapacityError, match="2 more blocks of 4 slots, 1 of 3 are free"):
        cache.append_batch([a, b], [1, 5])
    assert cache.length(a) == 6 and cache.length(b) == 0 and cache.num_free_blocks == 1
    assert isinstance(CacheCapacityError("x"), glmport.GlmportError)


@pytest.mark.parametrize(
    "call, needle",
    [
        (lambda c, s: c.truncate(s, 3), "cannot truncate sequence 0 of length 2 to 3"),
        (lambda c, s: c.slots(s, 1, 5), r"positions \[1, 5\) are outside sequence 0"),
        (lambda c, s: c.append(s, -1), "token count must be an int >= 0"),
        (lambda c, s: c.append_batch([s, s], [1, 1]), "a sequence appears twice"),
        (lambda c, s: c.free(7), "unknown sequence id 7"),
        (lambda c, s: PagedKVCache(1, 3, 2, num_blocks=0), "num_blocks must be an int >= 1"),
    ],
)
def test_bad_cache_requests_are_config_errors(call, needle):
    cache = PagedKVCache(num_layers=1, latent_dim=3, index_dim=2, num_blocks=2, block_size=2)
    seq = cache.add_sequence()
    cache.append(seq, 2)
    with pytest.raises(ConfigError, match=needle):
        call(cache, seq)


# -- cached forward steps ------------------------------------------------------------


@pytest.mark.parametrize("backend", ["cpu", "generic"])
def test_prefill_decode_and_verify_steps_equal_the_full_forward(model, backend):
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 128, (16,), generator=g), torch.randint(0, 128, (12,), generator=g)]
    # Chunks per step: a prefill, single-token decodes, and a 3-token verification run.
    steps = [(8, 5), (1, 1), (3, 2), (1, 1), (1, 1), (1, 1), (1, 1)]
    with glmport.use_backend(backend):
        full = [_full_logits(model, s) for s in seqs]
        # Blocks of 4 slots, allocated in turn: both sequences' slots interleave.
        cache = PagedKVCache.for_config(model.config, 3, num_blocks=8, block_size=4)
        ids = [cache.add_sequence(), cache.add_sequence()]
        got: list[list[torch.Tensor]] = [[], []]
        done = [0, 0]
        for counts in steps:
            new = [s[d : d + n] for s, d, n in zip(seqs, done, counts, strict=True)]
            out = forward_cached(model, cache, ids, new)
            for b, logits in enumerate(out.split(out.logits)):
                got[b].append(logits)
            done = [d + n for d, n in zip(done, counts, strict=True)]
    assert cache.block_table(ids[0]) == [0, 1, 4, 5] and cache.block_table(ids[1]) == [2, 3, 6]
    for b in range(2):
        cached = torch.cat(got[b])
        assert cached.shape == full[b].shape
        assert (cached - full[b]).abs().max() <= TOL
        # Discriminative: the logits of a neighbouring position are far off.
        assert (cached[1:] - full[b][:-1]).abs().amax(dim=-1).min() > 100 * TOL


@pytest.mark.parametrize("backend", ["cpu", "generic"])
def test_a_lone_sequence_prefilled_then_decoded_equals_the_full_forward(model, backend):
    ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(3))
    with glmport.use_backend(backend):
        full = _full_logits(model, ids)
        cache = PagedKVCache.for_config(model.config, 3, num_blocks=8, block_size=4)
        seq = cache.add_sequence()
        got = [forward_cached(model, cache, [seq], [ids[:9]]).logits]
        got += [forward_cached(model, cache, [seq], [ids[i : i + 1]]).logits for i in range(9, 16)]
    assert (torch.cat(got) - full).abs().max() <= TOL


def test_the_top_k_selection_changes_the_logits_at_these_lengths(model):
    # With index_topk 64 every key is kept (dense); the sparse model's logits differ by
    # far more than TOL, so the cached step above had to select like the full forward.
    dense = _model(index_topk=64)
    ids = torch.tensor(PROMPTS[1] + PROMPTS[0])
    diff = (_full_logits(dense, ids) - _full_logits(model, ids)).abs().amax(dim=-1)
    assert diff[:4].max() <= TOL  # up to index_topk keys: identical
    assert diff[6:].min() > 100 * TOL


def test_mtp_cached_steps_equal_the_mtp_layer_over_the_whole_sequence(model):
    mtp = model.model.mtp_layers[0]
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 128, (14,), generator=g), torch.randint(0, 128, (10,), generator=g)]
    hidden, refs = [], []
    with torch.no_grad():
        for s in seqs:
            h = model(s[None]).hidden_states[0, :-1]
            batch = pack(s[None, :-1])
            cos, sin = model.model.rope(batch.positions)
            refs.append(mtp.logits(mtp(mtp.fuse(h, s[1:]), batch, cos, sin)[0]))
            hidden.append(h)
    cache = PagedKVCache.for_config(model.config, 1, num_blocks=16, block_size=2)
    ids = [cache.add_sequence(), cache.add_sequence()]
    got: list[list[torch.Tensor]] = [[], []]
    done = [0, 0]
    for counts in [(6, 3), (1, 1), (3, 2), (1, 1), (2, 3)]:
        h = torch.cat([hs[d : d + n] for hs, d, n in zip(hidden, done, counts, strict=True)])
        nxt = [s[d + 1 : d + 1 + n] for s, d, n in zip(seqs, done, counts, strict=True)]
        out = mtp_forward_cached(model, cache, ids, h, nxt)
        for b, logits in enumerate(out.split(out.logits)):
            got[b].append(logits)
        done = [d + n for d, n in zip(done, counts, strict=True)]
    for b in range(2):
        cached = torch.cat(got[b])
        assert (cached - refs[b][: len(cached)]).abs().max() <= TOL
        assert (cached[1:] - refs[b][: len(cached) - 1]).abs().amax(dim=-1).min() > 100 * TOL


def test_a_cache_of_the_wrong_depth_is_a_clear_error(model):
    cache = PagedKVCache.for_config(model.config, 2, num_blocks=4)
    seq = cache.add_sequence()
    with pytest.raises(ConfigError, match="the cache has 2 layers, the model 3 decoder layers"):
        forward_cached(model, cache, [seq], [[1, 2]])
    with pytest.raises(ConfigError, match="expected a one-layer cache, got 2"):
        mtp_forward_cached(model, cache, [seq], torch.zeros(1, 64), [[1]])


# -- generation ----------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["cpu", "generic"])
def test_greedy_generation_equals_argmax_of_the_full_forward_recomputed(model, backend):
    with glmport.use_backend(backend):
        result = generate(model, PROMPTS, 8, block_size=4)
        expected = [_greedy_by_recompute(model, p, 8) for p in PROMPTS]
    assert result.output_ids == expected
    assert result.new_tokens == 24 and result.tokens_per_s > 0
    assert result.seconds == pytest.approx(result.prefill_seconds + result.decode_seconds)


def test_a_batch_generates_what_each_prompt_generates_alone(model):
    batch = generate(model, PROMPTS, 9).output_ids
    assert batch == [generate(model, [p], 9).output_ids[0] for p in PROMPTS]
    assert len(set(map(tuple, batch))) == 3  # the prompts lead to different outputs


def test_a_stop_token_ends_only_the_sequence_that_emits_it(model):
    free = generate(model, PROMPTS, 10).output_ids
    stop = free[0][2]
    assert stop not in free[1] and stop not in free[0][:2]
    stopped = generate(model, PROMPTS, 10, stop_tokens=[stop]).output_ids
    assert stopped[0] == free[0][:3]  # ends with the stop token
    assert stopped[1] == free[1]
    assert stopped == [_cut_at_stop(o, {stop}) for o in free]


def test_seeded_sampling_is_reproducible_and_another_seed_differs(model):
    def sample(seed):
        return generate(model, PROMPTS, 12, greedy=False, temperature=1.5, seed=seed).output_ids

    first = sample(1)
    assert first == sample(1)
    assert first != sample(2)
    assert first != generate(model, PROMPTS, 12).output_ids


@pytest.mark.parametrize("kwargs", [dict(top_k=1), dict(top_p=1e-6), dict(top_k=3, top_p=1e-6)])
def test_sampling_that_keeps_one_token_equals_greedy(model, kwargs):
    sampled = generate(model, PROMPTS, 8, greedy=False, temperature=2.0, seed=0, **kwargs)
    assert sampled.output_ids == generate(model, PROMPTS, 8).output_ids


def test_top_k_sampling_draws_only_from_the_k_best_tokens(model):
    # Prompt 2 is one token: every sampled first token must be among its top 2.
    best = _full_logits(model, torch.tensor(PROMPTS[2]))[-1].topk(2).indices.tolist()
    firsts = {
        generate(model, [PROMPTS[2]], 1, greedy=False, temperature=5.0, top_k=2, seed=s).output_ids[
            0
        ][0]
        for s in range(12)
    }
    assert firsts == set(best)


def test_abort_stops_generation_between_decode_steps(model):
    asked = []

    def abort() -> bool:
        asked.append(True)
        return len(asked) == 3  # let two decode steps run

    with pytest.raises(generation.GenerationAborted, match="2 sequences unfinished"):
        generate(model, [[1, 2], [3]], 6, greedy=False, seed=0, abort=abort)
    assert len(asked) == 3
    never = generate(model, [[1, 2]], 4, greedy=False, seed=0, abort=lambda: False)
    assert never.output_ids == generate(model, [[1, 2]], 4, greedy=False, seed=0).output_ids
    with pytest.raises(ConfigError, match="abort need sampled"):
        generate(model, [[1, 2]], 4, speculative=True, abort=lambda: False)


def test_zero_new_tokens_returns_empty_outputs(model):
    result = generate(model, PROMPTS, 0, speculative=True)
    assert result.output_ids == [[], [], []] and result.new_tokens == 0


@pytest.mark.parametrize(
    "prompts, kwargs, needle",
    [
        ([[1, 2]], dict(max_new_tokens=-1), "max_new_tokens must be an int >= 0"),
        ([], {}, "prompts must be a non-empty list"),
        ([[1], []], {}, "prompt 1 must be a non-empty list of token ids"),
        ([[1, 128, -1]], {}, r"prompt 0 has token ids outside \[0, 128\): \[128, -1\]"),
        (
            [[1]],
            dict(greedy=False, temperature=0.0),
            r"temperature must be a number in \[1e-06, 1e\+06\] when sampling, got 0.0 "
            r"\(for argmax decoding use greedy=True\)",
        ),
        ([[1]], dict(top_p=0.0), r"top_p must be a number in \(0, 1\]"),
        ([[1]], dict(top_p=1.5), r"top_p must be a number in \(0, 1\]"),
        ([[1]], dict(top_k=-2), "top_k must be an int >= 0"),
        ([[1]], dict(stop_tokens=[500]), r"stop_tokens has token ids outside \[0, 128\)"),
        ([[1]], dict(speculative=True, greedy=False), "speculative decoding is greedy only"),
        ([[1]], dict(max_new_tokens=5000), "exceeds max_position_embeddings 4096"),
    ],
)
def test_bad_generation_arguments_are_clear_errors(model, prompts, kwargs, needle):
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ConfigError, match=needle):
        generate(model, prompts, **kwargs)


def test_speculative_decoding_needs_an_mtp_layer():
    plain = GlmMoeDsaForCausalLM.from_config(GlmMoeDsaConfig.tiny(num_nextn_predict_layers=0))
    with pytest.raises(ConfigError, match="needs an MTP layer"):
        generate(plain, [[1]], 2, speculative=True)


# -- speculative decoding ------------------------------------------------------------


@pytest.mark.parametrize("max_new", [1, 2, 5, 13])
def test_speculative_decoding_equals_greedy(model, max_new):
    greedy = generate(model, PROMPTS, max_new, block_size=4)
    spec = generate(model, PROMPTS, max_new, speculative=True, block_size=4)
    assert spec.output_ids == greedy.output_ids
    if max_new > 2:  # with 2, the one step after prefill has no room for a draft
        assert spec.verify_steps > 0 and 1.0 <= spec.acceptance_length <= 4.0
    else:
        assert spec.acceptance_length is None


def test_speculative_decoding_honours_stop_tokens_like_greedy(model):
    free = generate(model, PROMPTS, 12).output_ids
    stop = {free[0][4], free[2][1]}
    spec = generate(model, PROMPTS, 12, speculative=True, stop_tokens=sorted(stop))
    assert spec.output_ids == generate(model, PROMPTS, 12, stop_tokens=sorted(stop)).output_ids
    assert spec.output_ids == [_cut_at_stop(o, stop) for o in free]


def _reference_drafts(model, seq: list[int], k: int) -> list[int]:
    """``k`` greedy MTP drafts after ``seq`` without a cache: the MTP layer over the
    whole sequence of entries (entry ``i`` fuses main hidden ``i`` with token ``i + 1``),
    then recursively over its own last output fused with the previous draft."""
    mtp = model.model.mtp_layers[0]
    ids = torch.tensor(seq)
    with torch.no_grad():
        hidden = model(ids[None]).hidden_states[0]
        x = mtp.fuse(hidden[:-1], ids[1:])
        drafts = []
        for _ in range(k):
            batch = pack(torch.zeros(1, x.shape[0], dtype=torch.long))
            cos, sin = model.model.rope(batch.positions)
            g = mtp(x, batch, cos, sin)[0][-1:]
            drafts.append(int(mtp.logits(g).argmax()))
            x = torch.cat((x, mtp.fuse(g, torch.tensor(drafts[-1:]))))
    return drafts


def _model_with_three_token_heads() -> GlmMoeDsaForCausalLM:
    """The scaled random model, but the LM head and the MTP head keep only the rows of
    tokens 10, 20 and 30 (the third the negated sum of the other two, so one of them
    always beats the zero logit of every other token): random drafts then match a
    third of the time, and the MTP layer still depends on everything it is given."""
    model = _model()
    with torch.no_grad():
        for head in (model.lm_head, model.model.mtp_layers[0].shared_head.head):
            rows = head.weight[[10, 20]].clone()
            head.weight.zero_()
            head.weight[[10, 20, 30]] = torch.cat((rows, -rows.sum(0, keepdim=True)))
    return model


def test_speculative_drafts_are_the_uncached_recursive_mtp_drafts(monkeypatch):
    model = _model_with_three_token_heads()
    calls = []
    draft = generation._draft

    def recording(model, mtp_cache, mtp_seqs, batch, k, queue_h, queue_ids):
        drafts = draft(model, mtp_cache, mtp_seqs, batch, k, queue_h, queue_ids)
        # The MTP cache is back at the main cache's length: the pending token's position.
        calls.extend((b, mtp_cache.length(mtp_seqs[b]), drafts[b]) for b in batch)
        return drafts

    monkeypatch.setattr(generation, "_draft", recording)
    spec = generate(model, PROMPTS, 12, speculative=True, block_size=2)
    assert spec.output_ids == generate(model, PROMPTS, 12).output_ids
    assert 1.3 < spec.acceptance_length < 4.0  # some drafts accepted, some rejected
    assert {len(d) for _, _, d in calls} == {1, 2, 3}
    for b, pending_at, drafts in calls:
        seq = (PROMPTS[b] + spec.output_ids[b])[: pending_at + 1]
        assert drafts == _reference_drafts(model, seq, len(drafts)), (b, pending_at)


def _model_with_an_agreeing_mtp_layer() -> GlmMoeDsaForCausalLM:
    """The main model's next token mostly follows from its current token (embeddings
    x3 dominate the residual stream); the MTP layer predicts exactly that function of
    the token it is given (``eh_proj`` passes the embedding half, its attention and MLP
    outputs are zero, its head is the LM head), so most drafts are right, not all."""
    model = GlmMoeDsaForCausalLM.from_config(GlmMoeDsaConfig.tiny(index_n_heads=16), seed=0)
    mtp = model.model.mtp_layers[0]
    h = model.config.hidden_size
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(3.0)
        mtp.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
        mtp.eh_proj.weight.zero_()
        mtp.eh_proj.weight[:, :h] = torch.eye(h)
        mtp.self_attn.o_proj.weight.zero_()
        mtp.mlp.experts.down_proj.zero_()
        mtp.mlp.shared_experts.down_proj.weight.zero_()
    return model


def test_an_agreeing_mtp_layer_gets_drafts_accepted_and_output_stays_greedy():
    model = _model_with_an_agreeing_mtp_layer()
    greedy = generate(model, PROMPTS, 16)
    spec = generate(model, PROMPTS, 16, speculative=True, block_size=4)
    assert spec.output_ids == greedy.output_ids
    assert spec.output_ids == [_greedy_by_recompute(model, p, 16) for p in PROMPTS]
    # Fewer main-model steps than tokens, and some drafts rejected (rollback ran).
    assert 2.0 < spec.acceptance_length < 4.0


# -- glmport generate ----------------------------------------------------------------


def _cli_json(capsys, *args: str) -> dict:
    assert main(["generate", "--input-ids", "3,1,4,1,5,9", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_generate_json_is_greedy_generation_of_the_tiny_model(capsys):
    report = _cli_json(capsys, "--model", "tiny", "--max-new-tokens", "6")
    tiny = GlmMoeDsaForCausalLM.from_config("tiny", seed=0)
    assert report["output_ids"] == generate(tiny, [[3, 1, 4, 1, 5, 9]], 6).output_ids[0]
    assert report["input_ids"] == [3, 1, 4, 1, 5, 9] and report["new_tokens"] == 6
    assert report["tokens_per_s"] > 0 and report["seconds"] > 0
    assert "acceptance_length" not in report
    spec = _cli_json(capsys, "--model", "tiny", "--max-new-tokens", "6", "--speculative")
    assert spec["output_ids"] == report["output_ids"] and spec["acceptance_length"] >= 1.0
    stopped = _cli_json(
        capsys,
        "--model",
        "tiny",
        "--max-new-tokens",
        "6",
        "--stop-tokens",
        str(report["output_ids"][1]),
    )
    assert stopped["output_ids"] == _cut_at_stop(report["output_ids"], {report["output_ids"][1]})


def test_cli_generate_samples_reproducibly_and_loads_a_checkpoint_folder(capsys, tmp_path):
    GlmMoeDsaForCausalLM.from_config("tiny", seed=0).save_pretrained(tmp_path)
    args = ["--max-new-tokens", "8", "--temperature", "2", "--top-k", "50", "--seed", "4"]
    first = _cli_json(capsys, "--model", "tiny", *args)["output_ids"]
    assert _cli_json(capsys, "--model", "tiny", *args)["output_ids"] == first
    assert _cli_json(capsys, "--model", str(tmp_path), *args)["output_ids"] == first
    greedy = _cli_json(capsys, "--model", str(tmp_path), "--max-new-tokens", "8", "--greedy")
    assert greedy["output_ids"] != first


def test_cli_generate_text_output_and_backend(capsys):
    args = ["generate", "--model", "tiny", "--input-ids", "7,8", "--max-new-tokens", "3"]
    assert main([*args, "--backend", "generic", "--speculative"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("output_ids: ") and len(out[0].split(": ")[1].split(",")) == 3
    assert "3 new tokens in" in out[1] and "mean acceptance length" in out[1]


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--input-ids", "1,x"], "--input-ids must be comma-separated integers"),
        (["--input-ids", "1,999"], r"token ids outside \[0, 128\)"),
        (["--greedy", "--temperature", "0.5"], "--greedy cannot be combined with --temperature"),
        (["--temperature", "0"], r"--temperature must be .* got 0.0 .*use --greedy\)"),
        (["--top-p", "2"], r"--top-p must be a number in \(0, 1\]"),
        (["--model", "/nonexistent"], "--model must be 'tiny' or a checkpoint folder"),
        (["--backend", "nope"], "unknown glmport backend 'nope'"),
        (["--speculative", "--seed", "1"], "--speculative cannot be combined with --seed"),
    ],
)
def test_cli_generate_bad_arguments_exit_2_with_a_message(capsys, extra, needle):
    base = {"--model": "tiny", "--input-ids": "1,2", "--max-new-tokens": "2"}
    for flag in extra:  # a flag given in extra replaces the base one
        base.pop(flag, None)
    args = ["generate", *[x for kv in base.items() for x in kv], *extra]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "glmport: error:" in err
    assert re.search(needle, err), err
