"""Training losses: next-token, MTP, and the indexer KL in DSA's dense warm-up and
sparse adaptation, on GlmMoeDsaConfig.tiny() with a toy corpus."""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from hang_guard import guard_s

import glmport
from glmport.core.errors import ConfigError
from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from glmport.model.attention import Attention, AttentionRecord, record_attention
from glmport.model.packing import pack
from glmport.model.training import (
    STAGES,
    attention_target,
    configure_stage,
    indexer_parameters,
    kl_divergence,
    training_losses,
    training_step,
)

STEPS = 30


pytestmark = pytest.mark.usefixtures("one_thread")


def _corpus() -> torch.Tensor:
    """``[4, 24]``: each row repeats its own random 5-token motif (learnable by looking
    back 5 positions, so attention and the indexer have structure to find)."""
    motifs = torch.randint(0, 128, (4, 5), generator=torch.Generator().manual_seed(0))
    return motifs.repeat(1, 5)[:, :24]


def _model(**overrides) -> GlmMoeDsaForCausalLM:
    return GlmMoeDsaForCausalLM.from_config(GlmMoeDsaConfig.tiny(**overrides))


def _optimizer(model, stage: str, lr_main: float = 1e-2) -> torch.optim.Optimizer:
    """Adam: indexer at 1e-2, the rest at ``lr_main`` (so the KL target moves slowly)."""
    params = configure_stage(model, stage)
    ix = {id(p) for p in indexer_parameters(model)}
    groups = [{"params": [p for p in params if id(p) in ix], "lr": 1e-2}]
    rest = [p for p in params if id(p) not in ix]
    return torch.optim.Adam(groups + ([{"params": rest, "lr": lr_main}] if rest else []))


def _train(model, stage: str, steps: int = STEPS, lr_main: float = 1e-2, **kw) -> dict:
    """Loss histories ``{name: [step 0, ..., step steps-1]}``."""
    opt = _optimizer(model, stage, lr_main)
    ids = _corpus()
    history = [training_step(model, opt, ids, stage=stage, **kw) for _ in range(steps)]
    return {k: [h[k] for h in history] for k in history[0]}


@pytest.fixture(scope="module")
def dense_pretrained() -> dict[str, torch.Tensor]:
    """A state dict LM-trained with dense attention: ``index_topk`` >= the sequence
    length selects every visible key, so the sparse stage is dense causal training."""
    model = _model(index_topk=64)
    _train(model, "sparse_adaptation", steps=20, kl_weight=0.0)
    return model.state_dict()


# -- API and closed forms ----------------------------------------------------------


def test_unknown_stage_is_a_config_error_listing_the_stages():
    model = _model()
    with pytest.raises(ConfigError, match="dense_warmup, sparse_adaptation"):
        training_losses(model, _corpus(), stage="warmup")
    with pytest.raises(ConfigError, match="unknown training stage 'sparse'"):
        configure_stage(model, "sparse")


def test_mtp_depth_needs_mtp_layers():
    with pytest.raises(ConfigError, match="mtp_depth"):
        training_losses(_model(num_nextn_predict_layers=0), _corpus(), mtp_depth=1)


def test_kl_is_zero_when_the_indexer_distribution_equals_the_target():
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    logits[:, 4:] = -math.inf  # padded (-1) slots
    target = torch.softmax(logits, dim=-1)
    assert float(kl_divergence(target, logits)) == pytest.approx(0.0, abs=1e-6)


def test_kl_matches_a_hand_computed_two_key_case():
    # p = (1/4, 3/4) against softmax(0, 0) = (1/2, 1/2), plus one empty slot.
    target = torch.tensor([[0.25, 0.75, 0.0]])
    logits = torch.tensor([[0.0, 0.0, -math.inf]], requires_grad=True)
    kl = kl_divergence(target, logits)
    expected = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert kl.item() == pytest.approx(expected, rel=1e-6)
    kl.backward()  # d KL / d logits = softmax(logits) - p, 0 at the empty slot
    torch.testing.assert_close(logits.grad, torch.tensor([[0.25, -0.25, 0.0]]))


def test_attention_target_sums_head_softmaxes_and_normalises():
    # One query, two heads, two keys (Dk = 1): p = mean over heads of softmax(scale q.k).
    q = torch.tensor([[[1.0], [-2.0]]])  # [T=1, H=2, 1]
    k = torch.tensor([[[0.5], [1.0]], [[2.0], [0.0]]])  # [N=2, H=2, 1]
    scale = 0.5
    scores = scale * torch.einsum("thd,nhd->thn", q, k)  # [1, 2, 2]
    rec = AttentionRecord(
        *[torch.empty(0)] * 4,
        q=q,
        k=k,
        lse=scores.logsumexp(-1),
        indices=torch.tensor([[1, 0, -1]], dtype=torch.int32),
        k_start=torch.tensor([0], dtype=torch.int32),
        k_end=torch.tensor([2], dtype=torch.int32),
    )
    heads = torch.softmax(scores, dim=-1)[0]  # [H, N]
    expected = torch.tensor([[heads[:, 1].mean(), heads[:, 0].mean(), 0.0]])
    torch.testing.assert_close(attention_target(rec, scale), expected)


@pytest.mark.parametrize("stage", STAGES)
def test_attention_target_is_the_layers_causal_softmax(stage):
    """Against an independent dense computation from the recorded q, k: per head a
    softmax over the attended slots (all visible ones in the warm-up), mean over heads."""
    model = _model()
    attn = model.model.layers[0].self_attn
    ids = _corpus()[:2, :10]
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: a second sequence with its own range
    with torch.no_grad(), record_attention([attn], dense=stage == "dense_warmup") as records:
        model(ids, mask)
    (rec,) = records[attn]
    t = rec.q.shape[0]
    scores = attn.scale * torch.einsum("thd,nhd->thn", rec.q, rec.k)  # [T, H, N]
    allowed = torch.zeros(t, t, dtype=torch.bool)
    valid = rec.indices >= 0
    allowed[torch.arange(t)[:, None].expand_as(rec.indices)[valid], rec.indices[valid].long()] = (
        True
    )
    if stage == "dense_warmup":
        slot = torch.arange(t)
        visible = (slot >= rec.k_start[:, None]) & (slot < rec.k_end[:, None])
        assert torch.equal(allowed, visible)
    dense = torch.softmax(scores.masked_fill(~allowed[:, None, :], -math.inf), -1).mean(1)
    expected = dense.gather(1, rec.indices.long().clamp(min=0)).masked_fill(~valid, 0.0)
    torch.testing.assert_close(attention_target(rec, attn.scale), expected)


def test_dense_warmup_attention_equals_full_topk_attention():
    """Warm-up runs the main attention dense: the same LM loss as a model whose top-k
    covers every key (where sparse attention is dense causal)."""
    ids = _corpus()
    sparse, full = _model(), _model(index_topk=64)
    with torch.no_grad():
        warm = training_losses(sparse, ids, stage="dense_warmup").lm.item()
        assert warm == pytest.approx(training_losses(full, ids).lm.item(), rel=1e-5)
        assert training_losses(sparse, ids).lm.item() != pytest.approx(warm, rel=1e-5)


def test_mtp_loss_predicts_token_i_plus_k_plus_1_recursively():
    """Depth-2 MTP against a hand-shifted computation with plain cross-entropy."""
    model = _model()
    ids = _corpus()[:2, :12]
    got = training_losses(model, ids, mtp_depth=2).as_floats()["mtp"]
    mtp = model.model.mtp_layers[0]
    with torch.no_grad():
        h = model(ids).hidden_states  # [B, S, D]
        expected = []
        for k in (1, 2):
            batch = pack(ids[:, k:])
            cos, sin = model.model.rope(batch.positions)
            x = mtp.fuse(h[:, :-1].reshape(-1, h.shape[-1]), batch.ids)
            x = mtp(x, batch, cos, sin)[0]
            h = batch.unpack(x)
            expected.append(
                F.cross_entropy(mtp.logits(h[:, :-1]).flatten(0, 1), ids[:, k + 1 :].flatten())
            )
    assert got == pytest.approx(float(sum(expected) / 2), rel=1e-5)


def test_mtp_loss_also_trains_the_main_model():
    """As in DeepSeek-V3, the MTP gradient flows into the main model's hidden states."""
    model = _model()
    training_losses(model, _corpus()[:2, :12]).mtp.backward()
    assert float(model.model.layers[0].self_attn.q_a_proj.weight.grad.abs().sum()) > 0
    assert model.lm_head.weight.grad is None  # the MTP layer has its own head


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_losses_are_token_weighted_means_of_each_sequence(side):
    model = _model()
    ids = _corpus()[:2, :16]
    lengths = (16, 11)
    mask = torch.ones_like(ids)
    if side == "left":
        mask[1, :5] = 0
    else:
        mask[1, 11:] = 0
    batched = training_losses(model, ids, mask).as_floats()
    rows = [ids[0:1], ids[1:2][mask[1:2].bool()].view(1, -1)]
    singles = [training_losses(model, r).as_floats() for r in rows]
    for name, per_seq in (("lm", [n - 1 for n in lengths]), ("mtp", [n - 2 for n in lengths])):
        mean = sum(s[name] * n for s, n in zip(singles, per_seq, strict=True)) / sum(per_seq)
        assert batched[name] == pytest.approx(mean, rel=1e-5), name


def test_labels_minus_100_are_ignored():
    model = _model()
    ids = _corpus()[:2, :12]
    labels = ids.clone()
    labels[:, :6] = -100  # a prompt: its tokens are never targets
    with torch.no_grad():
        full = model(ids).logits[:, :-1]
    expected = F.cross_entropy(full[:, 5:].flatten(0, 1), ids[:, 6:].flatten()).item()
    got = training_losses(model, ids, labels=labels, mtp_depth=0).as_floats()["lm"]
    assert got == pytest.approx(expected, rel=1e-5)


def test_sparse_adaptation_kl_reaches_only_the_indexer():
    model = _model()
    configure_stage(model, "sparse_adaptation")
    training_losses(model, _corpus()).indexer_kl.backward()
    ix = {id(p) for p in indexer_parameters(model)}
    for name, p in model.named_parameters():
        assert (p.grad is not None) == (id(p) in ix), name


# -- backends ----------------------------------------------------------------------


@pytest.mark.parametrize("stage", STAGES)
def test_cpu_and_generic_backends_agree_on_losses_and_gradients(stage):
    grads, values = {}, {}
    for backend in ("cpu", "generic"):
        model = _model()
        configure_stage(model, stage)
        with glmport.use_backend(backend):
            losses = training_losses(model, _corpus(), stage=stage)
            losses.loss.backward()
        values[backend] = losses.as_floats()
        grads[backend] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    # The indexer KL of the dense warm-up is ~3e-5 (the indexer already mimics the
    # attention): rounding of the attention's lse moves it by ~4e-9, hence the abs term.
    assert values["cpu"] == pytest.approx(values["generic"], rel=1e-4, abs=1e-8)
    assert grads["cpu"].keys() == grads["generic"].keys() and grads["cpu"]
    for name, g in grads["cpu"].items():
        torch.testing.assert_close(grads["generic"][name], g, rtol=1e-3, atol=1e-6, msg=name)


# -- threads -----------------------------------------------------------------------


@pytest.mark.parametrize("stage", STAGES)
def test_recording_in_one_thread_leaves_a_second_thread_sharing_the_model_alone(stage):
    """Thread A computes the training loss (which records attention and, in the
    warm-up, runs it dense) while thread B runs forwards of the same model. A pre-hook
    on the first decoder layer holds A inside its recording until B has run, so every
    B forward overlaps an open recording. B must get the single-threaded logits, A the
    single-threaded loss (no B record in its KL), and a recording B opens itself holds
    only B's records."""
    rounds = 3
    model = _model()
    ids_a, ids_b = _corpus()[:2], _corpus()[2:, :17]
    with torch.no_grad():
        want_logits = model(ids_b).logits
    want_loss = training_losses(model, ids_a, stage=stage).as_floats()
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    mtp_attentions = [layer.self_attn for layer in model.model.mtp_layers]
    # Each wait is for the other thread's forward of the tiny model (well under 1 s idle).
    a_inside, b_done = (threading.Barrier(2, timeout=guard_s(1)) for _ in range(2))
    a_ident = []

    def hold_a_inside(module, args):
        if threading.get_ident() in a_ident:
            a_inside.wait()
            b_done.wait()

    def thread_a():
        a_ident.append(threading.get_ident())
        return [training_losses(model, ids_a, stage=stage).as_floats() for _ in range(rounds)]

    def thread_b():
        logits, own = [], []
        for _ in range(rounds):
            a_inside.wait()
            with torch.no_grad():
                logits.append(model(ids_b).logits)
                with record_attention(attentions) as records:
                    model(ids_b)
            own.append(records)
            b_done.wait()
        return logits, own

    hook = model.model.layers[0].register_forward_pre_hook(hold_a_inside)
    try:
        with ThreadPoolExecutor(2) as pool:
            fut_a, fut_b = pool.submit(thread_a), pool.submit(thread_b)
            losses, (logits, own) = fut_a.result(), fut_b.result()
    finally:
        hook.remove()
    assert losses == [want_loss] * rounds
    for got in logits:
        assert torch.equal(got, want_logits)
    t_b = ids_b.numel()
    for records in own:
        assert list(records) == attentions
        for attn, recs in records.items():
            if attn in mtp_attentions:  # a plain forward does not run the MTP layers
                assert recs == []
            else:
                (rec,) = recs
                assert rec.h.shape[0] == t_b and rec.indices.shape[0] == t_b


# -- losses fall -------------------------------------------------------------------


def test_lm_and_mtp_losses_fall_in_sparse_training_from_scratch():
    h = _train(_model(), "sparse_adaptation")
    assert h["lm"][-1] < 0.3 * h["lm"][0], h["lm"]
    assert h["mtp"][-1] < 0.3 * h["mtp"][0], h["mtp"]


def test_dense_warmup_trains_only_the_indexer_and_its_kl_falls(dense_pretrained):
    model = _model()
    model.load_state_dict(dense_pretrained)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = _optimizer(model, "dense_warmup")
    training_step(model, opt, _corpus(), stage="dense_warmup")
    ix = {id(p) for p in indexer_parameters(model)}
    for name, p in model.named_parameters():
        assert (p.grad is not None) == (id(p) in ix), name
        assert torch.equal(p, before[name]) != (id(p) in ix), name
    h = _train(model, "dense_warmup")
    assert h["indexer_kl"][-1] < 0.1 * h["indexer_kl"][0], h["indexer_kl"]
    assert max(h["lm"]) == min(h["lm"])  # the main model is frozen
    for name, p in model.named_parameters():
        if ".indexer." not in name:
            assert torch.equal(p, before[name]), name


def test_sparse_adaptation_lowers_lm_loss_and_the_selected_set_kl(dense_pretrained):
    model = _model()
    model.load_state_dict(dense_pretrained)
    h = _train(model, "sparse_adaptation", lr_main=1e-3)
    assert h["lm"][-1] < 0.7 * h["lm"][0], h["lm"]
    assert h["indexer_kl"][-1] < 0.2 * h["indexer_kl"][0], h["indexer_kl"]
