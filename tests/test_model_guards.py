"""What a checkpoint or a forward call cannot be: weights of mixed dtypes (refused at
load, not at the first forward), a config.json without a field every real one carries
(refused, not defaulted), and a batch with no token (a clear error)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import glmport
from glmport.model import GlmMoeDsaForCausalLM
from glmport.model.config_fields import REQUIRED_FIELDS
from glmport.model.generation import generate
from glmport.model.training import training_losses
from glmport.model.weights import SINGLE_FILE

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny checkpoint folder in float32 and its model."""
    folder = tmp_path_factory.mktemp("ckpt")
    model = GlmMoeDsaForCausalLM.from_config("tiny", seed=1)
    model.save_pretrained(folder)
    return folder, model


def _with_dtypes(folder, tmp_path, dtypes: dict[str, torch.dtype]):
    """A copy of checkpoint ``folder`` with tensors ``key -> dtype`` recast."""
    tensors = load_file(folder / SINGLE_FILE)
    for key, dtype in dtypes.items():
        tensors[key] = tensors[key].to(dtype)
    tmp_path.mkdir(exist_ok=True)
    save_file(tensors, tmp_path / SINGLE_FILE)
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    return tmp_path


def test_an_fp16_lm_head_beside_fp32_weights_is_refused_at_load(saved, tmp_path):
    folder, model = saved
    mixed = _with_dtypes(folder, tmp_path / "mixed", {"lm_head.weight": torch.float16})
    with pytest.raises(glmport.ConfigError) as err:
        GlmMoeDsaForCausalLM.from_pretrained(mixed)
    message = str(err.value)
    assert "lm_head.weight" in message and "float16" in message and "dtype=" in message
    # Asked for one dtype, it loads, and computes what float32 with that head computes.
    loaded = GlmMoeDsaForCausalLM.from_pretrained(mixed, dtype=torch.float32).eval()
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        head = model.lm_head.weight.clone()
        model.lm_head.weight.copy_(head.to(torch.float16).to(torch.float32))
        want = model.eval()(ids).logits
        model.lm_head.weight.copy_(head)
        assert torch.equal(loaded(ids).logits, want)


def test_a_refused_mixed_state_leaves_the_model_unchanged(saved):
    _, model = saved
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: v + 1.0 for k, v in model.state_dict().items()}
    state["model.layers.0.self_attn.q_a_proj.weight"] = state[
        "model.layers.0.self_attn.q_a_proj.weight"
    ].to(torch.bfloat16)
    with pytest.raises(glmport.ConfigError, match="q_a_proj"):
        model.load_hf_state_dict(state)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_a_state_loads_exactly_when_its_weights_share_one_dtype(saved, data):
    """Any weights recast to any dtypes: refused iff the parameters end up in two or more
    dtypes; a loaded model then runs (buffers, such as the router's bias, are free)."""
    _, model = saved
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = {k for k, p in model.named_parameters()}
    keys = sorted(state)
    chosen = data.draw(st.lists(st.sampled_from(keys), max_size=4, unique=True))
    base = data.draw(st.sampled_from(DTYPES))
    state = {k: v.to(base) for k, v in state.items()}
    for key in chosen:
        state[key] = state[key].to(data.draw(st.sampled_from(DTYPES)))
    mixed = len({state[k].dtype for k in params}) > 1
    fresh = GlmMoeDsaForCausalLM.from_config("tiny", seed=2)
    if mixed:
        with pytest.raises(glmport.ConfigError, match="mixes weight dtypes"):
            fresh.load_hf_state_dict(state)
        return
    fresh.load_hf_state_dict(state)
    with torch.no_grad():
        logits = fresh.eval()(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.dtype == base and torch.isfinite(logits).all()


# --- required config fields ---------------------------------------------------------


def _transformers_writes() -> set[str]:
    """The keys transformers' save_pretrained writes for a GlmMoeDsaConfig: what every
    checkpoint saved by it carries (the independent reference for the required set)."""
    import tempfile
    from pathlib import Path

    transformers = pytest.importorskip("transformers", reason="the test extra (transformers)")
    with tempfile.TemporaryDirectory() as folder:
        transformers.GlmMoeDsaConfig().save_pretrained(folder)
        written = json.loads((Path(folder) / "config.json").read_text())
    return set(written) | {f"rope_parameters.{k}" for k in written["rope_parameters"]}


def test_every_required_field_is_one_a_real_checkpoint_always_carries():
    written = _transformers_writes()
    for name, keys in REQUIRED_FIELDS:
        assert any(k in written for k in keys), (name, keys)


@pytest.mark.parametrize(("name", "keys"), REQUIRED_FIELDS, ids=[n for n, _ in REQUIRED_FIELDS])
def test_a_config_json_without_a_required_field_is_refused(saved, tmp_path, name, keys):
    folder, _ = saved
    data = json.loads((folder / "config.json").read_text())
    for key in keys:
        head, _, rest = key.partition(".")
        if rest and isinstance(data.get(head), dict):
            data[head].pop(rest, None)
        else:
            data.pop(head, None)
    if name == "first_k_dense_replace":
        data.pop("mlp_layer_types", None)
    shutil.copy(folder / SINGLE_FILE, tmp_path / SINGLE_FILE)
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(glmport.ConfigError, match=f"does not set {name}:"):
        GlmMoeDsaForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "change",
    [
        {"n_routed_experts": None, "num_experts": 8},  # transformers' alias
        {"rope_parameters": None, "rope_theta": 1e6},  # legacy top level
        {"first_k_dense_replace": None, "mlp_layer_types": ["dense", "sparse", "sparse"]},
        # defaulted: what every checkpoint holds, or no effect on the computation
        {"attention_bias": None, "num_nextn_predict_layers": None, "initializer_range": None},
        {"indexer_rope_interleave": None, "bos_token_id": None, "eos_token_id": None},
    ],
)
def test_the_other_spellings_and_the_defaulted_fields_load(saved, tmp_path, change):
    folder, model = saved
    data = json.loads((folder / "config.json").read_text())
    data.update({k: v for k, v in change.items() if v is not None})
    for key in [k for k, v in change.items() if v is None]:
        data.pop(key)
    shutil.copy(folder / SINGLE_FILE, tmp_path / SINGLE_FILE)
    (tmp_path / "config.json").write_text(json.dumps(data))
    loaded = GlmMoeDsaForCausalLM.from_pretrained(tmp_path)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, model.eval()(ids).logits)


# --- no token ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ids", "mask", "needle"),
    [
        (torch.zeros(0, 5, dtype=torch.long), None, "at least one token"),
        (torch.zeros(2, 0, dtype=torch.long), None, "at least one token"),
        (torch.zeros(0, 0, dtype=torch.long), None, "at least one token"),
        (torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), "marks no token"),
        (torch.zeros(2, 3), None, "integer token ids"),
    ],
)
def test_a_batch_without_a_token_is_a_clear_error(saved, ids, mask, needle):
    _, model = saved
    with pytest.raises(glmport.ConfigError, match=needle):
        model(ids, mask)
    with pytest.raises(glmport.ConfigError, match=needle):
        training_losses(model, ids, mask, mtp_depth=0)
    with pytest.raises(glmport.ConfigError, match="non-empty"):
        generate(model, [], 1)
