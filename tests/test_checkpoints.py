"""Checkpoints that never mix, lose or escape (issue 12): ``from_pretrained`` reads
exactly what the index names, from inside the folder; ``save_pretrained`` is atomic and
leaves nothing stale; ``load_hf_state_dict`` is all or nothing; configs are validated
at construction, one line naming the field."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from crash_points import Killed, die_at
from hang_guard import guard_s
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from glmport.core.errors import ConfigError
from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from glmport.model import weights as weights_module
from glmport.model.config import MAX_PARAMETER_BYTES
from glmport.model.weights import INDEX_FILE, SINGLE_FILE, checkpoint_plan, read_tensors

SHARD_BYTES = 200_000  # the tiny model (~1.3 MB in float32) in a handful of shards


def _model(seed: int) -> GlmMoeDsaForCausalLM:
    return GlmMoeDsaForCausalLM.from_config("tiny", seed=seed)


def _one_line_error(err: pytest.ExceptionInfo, *needles: str) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


@pytest.fixture
def sharded(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    folder = tmp_path / "ckpt"
    _model(0).save_pretrained(folder, max_shard_bytes=SHARD_BYTES)
    weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    assert len(set(weight_map.values())) >= 3
    return folder, weight_map


def _write_index(folder: Path, weight_map: dict) -> None:
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _two_shards(weight_map: dict[str, str]) -> tuple[str, str, str]:
    """A key of the first shard that holds several, that shard and another one."""
    by_file: dict[str, list[str]] = {}
    for key, name in sorted(weight_map.items()):
        by_file.setdefault(name, []).append(key)
    first = next(name for name, keys in sorted(by_file.items()) if len(keys) > 1)
    other = next(name for name in sorted(by_file) if name != first)
    return by_file[first][0], first, other


def _load_error(folder: Path) -> pytest.ExceptionInfo:
    with pytest.raises(ConfigError) as err:
        GlmMoeDsaForCausalLM.from_pretrained(folder)
    # The same error comes from the header check, before a single tensor is read.
    with pytest.raises(ConfigError):
        next(read_tensors(folder))
    return err


# -- from_pretrained: exactly the named files, each key from its named file --------


def test_sharded_checkpoint_round_trips_exactly(sharded):
    folder, weight_map = sharded
    want = _model(0).state_dict()
    back = GlmMoeDsaForCausalLM.from_pretrained(folder).state_dict()
    assert back.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(back[key], value), key
    plan = checkpoint_plan(folder)
    assert sorted(f.name for f, _ in plan) == sorted(set(weight_map.values()))
    assert {k for _, keys in plan for k in keys} == set(weight_map)


def test_a_key_in_two_shards_is_refused(sharded):
    folder, weight_map = sharded
    key, home, other = _two_shards(weight_map)
    extra = load_file(str(folder / other))
    extra[key] = load_file(str(folder / home))[key]
    save_file(extra, str(folder / other))
    _one_line_error(_load_error(folder), key, "two shards", home, other)


def test_a_key_in_another_shard_than_the_map_names_is_refused(sharded):
    folder, weight_map = sharded
    key, home, other = _two_shards(weight_map)
    source = load_file(str(folder / home))
    moved = source.pop(key)
    save_file(source, str(folder / home))
    save_file({**load_file(str(folder / other)), key: moved}, str(folder / other))
    _one_line_error(_load_error(folder), key, home, f"found in {other}")


def test_a_key_missing_from_every_shard_is_refused(sharded):
    folder, weight_map = sharded
    weight_map["model.layers.0.ghost.weight"] = next(iter(weight_map.values()))
    _write_index(folder, weight_map)
    _one_line_error(_load_error(folder), "model.layers.0.ghost.weight", "does not hold it")


def test_a_tensor_the_map_does_not_name_is_refused(sharded):
    folder, weight_map = sharded
    key, home, _ = _two_shards(weight_map)
    del weight_map[key]
    _write_index(folder, weight_map)
    _one_line_error(_load_error(folder), key, home, "not in the weight_map")


def test_files_the_map_does_not_name_are_never_opened(sharded):
    folder, _ = sharded
    (folder / "model-00099-of-00099.safetensors").write_bytes(b"stale garbage, never read")
    (folder / SINGLE_FILE).write_bytes(b"a stale single file, never read either")
    back = GlmMoeDsaForCausalLM.from_pretrained(folder)
    assert torch.equal(back.lm_head.weight, _model(0).lm_head.weight)


@pytest.mark.parametrize("escape", ["parent", "absolute", "nested_parent"])
def test_map_entries_pointing_outside_the_folder_are_refused(sharded, escape):
    folder, weight_map = sharded
    key, home, _ = _two_shards(weight_map)
    outside = folder.parent / "outside.safetensors"
    shutil.copy(folder / home, outside)
    target = {
        "parent": "../outside.safetensors",
        "absolute": str(outside),
        "nested_parent": f"sub/../../{outside.name}",
    }[escape]
    weight_map.update({k: target for k, v in weight_map.items() if v == home})
    _write_index(folder, weight_map)
    _one_line_error(_load_error(folder), key, "points outside the checkpoint folder")


def test_a_symlink_escaping_the_folder_is_refused(sharded):
    folder, weight_map = sharded
    key, home, _ = _two_shards(weight_map)
    outside = folder.parent / "elsewhere.safetensors"
    shutil.move(folder / home, outside)
    (folder / home).symlink_to(outside)
    _one_line_error(_load_error(folder), key, home, "outside the checkpoint folder")


def test_a_single_file_symlink_escaping_the_folder_is_refused(tmp_path):
    folder = tmp_path / "ckpt"
    _model(0).save_pretrained(folder)
    shutil.move(folder / SINGLE_FILE, tmp_path / "elsewhere.safetensors")
    (folder / SINGLE_FILE).symlink_to(tmp_path / "elsewhere.safetensors")
    _one_line_error(_load_error(folder), SINGLE_FILE, "outside the checkpoint folder")


def test_symlinks_that_stay_inside_load(sharded):
    """Containment, not a ban on links: a link within the folder, and the hub cache
    layout (``snapshots/<rev>/*`` -> ``../../blobs/*``), both load."""
    folder, weight_map = sharded
    _, home, _ = _two_shards(weight_map)
    (folder / "real").mkdir()
    shutil.move(folder / home, folder / "real" / home)
    (folder / home).symlink_to(Path("real") / home)
    want = _model(0).lm_head.weight
    assert torch.equal(GlmMoeDsaForCausalLM.from_pretrained(folder).lm_head.weight, want)

    repo = folder.parent / "models--org--glm"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(folder.glob("*.*"))):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    assert torch.equal(GlmMoeDsaForCausalLM.from_pretrained(snapshot).lm_head.weight, want)


def test_a_missing_shard_is_refused(sharded):
    folder, weight_map = sharded
    key, home, _ = _two_shards(weight_map)
    (folder / home).unlink()
    _one_line_error(_load_error(folder), key, home, "missing")


@pytest.mark.parametrize("damage", ["truncated", "header", "empty", "garbage"])
def test_a_truncated_or_corrupt_shard_is_refused(sharded, damage):
    folder, weight_map = sharded
    _, home, _ = _two_shards(weight_map)
    data = (folder / home).read_bytes()
    broken = {
        "truncated": data[:-7],
        "header": data[:20],
        "empty": b"",
        "garbage": b"\xff" * 64,
    }[damage]
    (folder / home).write_bytes(broken)
    _one_line_error(_load_error(folder), home, "not a readable safetensors file")


def test_a_truncated_single_file_is_refused(tmp_path):
    _model(0).save_pretrained(tmp_path)
    data = (tmp_path / SINGLE_FILE).read_bytes()
    (tmp_path / SINGLE_FILE).write_bytes(data[: len(data) // 2])
    _one_line_error(_load_error(tmp_path), SINGLE_FILE, "not a readable safetensors file")


@pytest.mark.parametrize(
    ("index", "needle"),
    [
        ({"metadata": {}}, "no weight_map"),
        ({"weight_map": []}, "no weight_map"),
        ({"weight_map": {}}, "no weight_map"),
        ([1, 2], "must hold a JSON object"),
        ("{not json", "cannot read"),
    ],
)
def test_a_bad_index_is_refused(sharded, index, needle):
    folder, _ = sharded
    text = index if isinstance(index, str) else json.dumps(index)
    (folder / INDEX_FILE).write_text(text)
    _one_line_error(_load_error(folder), INDEX_FILE, needle)


def test_a_map_entry_that_is_not_a_file_name_is_refused(sharded):
    folder, weight_map = sharded
    key = sorted(weight_map)[0]
    weight_map[key] = 7
    _write_index(folder, weight_map)
    _one_line_error(_load_error(folder), key, "must be a file name")


def test_a_non_finite_weight_in_a_checkpoint_is_refused(tmp_path):
    _model(0).save_pretrained(tmp_path)
    state = load_file(str(tmp_path / SINGLE_FILE))
    state["model.norm.weight"][3] = math.nan
    save_file(state, str(tmp_path / SINGLE_FILE))
    with pytest.raises(ConfigError) as err:
        GlmMoeDsaForCausalLM.from_pretrained(tmp_path)
    _one_line_error(err, "model.norm.weight", "NaN or Inf")


def test_an_expert_alias_with_a_leading_zero_is_not_merged(tmp_path):
    """``experts.07`` must not silently overwrite ``experts.7``."""
    _model(0).save_pretrained(tmp_path)
    state = load_file(str(tmp_path / SINGLE_FILE))
    key = "model.layers.1.mlp.experts.7.down_proj.weight"
    state[key.replace(".7.", ".07.")] = torch.zeros_like(state[key])
    save_file(state, str(tmp_path / SINGLE_FILE))
    with pytest.raises(ConfigError) as err:
        GlmMoeDsaForCausalLM.from_pretrained(tmp_path)
    _one_line_error(err, "unexpected", "experts.07.down_proj")


def test_an_expert_of_the_wrong_shape_is_a_config_error(tmp_path):
    _model(0).save_pretrained(tmp_path)
    state = load_file(str(tmp_path / SINGLE_FILE))
    key = "model.layers.2.mlp.experts.3.gate_proj.weight"
    state[key] = state[key][:, :-1].contiguous()
    save_file(state, str(tmp_path / SINGLE_FILE))
    with pytest.raises(ConfigError) as err:
        GlmMoeDsaForCausalLM.from_pretrained(tmp_path)
    _one_line_error(err, "experts.3.gate_proj.weight")


# -- save_pretrained: atomic, nothing stale, never a pickle ------------------------


def _digest(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def _assert_loads_as(folder: Path, model: GlmMoeDsaForCausalLM) -> None:
    back = GlmMoeDsaForCausalLM.from_pretrained(folder).state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(back[key], value), key


@pytest.mark.parametrize("first_shard", [SHARD_BYTES, 5 << 30])
@pytest.mark.parametrize("exc", [RuntimeError("disk on fire"), OSError(28, "No space left")])
def test_a_failed_save_leaves_the_old_checkpoint_and_no_temp_dirs(
    tmp_path, monkeypatch, first_shard, exc
):
    folder = tmp_path / "ckpt"
    old = _model(0)
    old.save_pretrained(folder, max_shard_bytes=first_shard)
    before = _digest(folder)
    real_save = weights_module.save_file
    calls = []

    def failing(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:  # the first shard is written, the second fails
            raise exc
        return real_save(*args, **kwargs)

    monkeypatch.setattr(weights_module, "save_file", failing)
    expected = ConfigError if isinstance(exc, OSError) else RuntimeError
    with pytest.raises(expected):
        _model(1).save_pretrained(folder, max_shard_bytes=SHARD_BYTES)
    assert len(calls) == 2
    assert _digest(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    monkeypatch.undo()
    _assert_loads_as(folder, old)


def test_a_failed_rename_into_place_restores_the_old_checkpoint(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    old = _model(0)
    old.save_pretrained(folder)
    before = _digest(folder)
    real_rename = os.rename

    def rename(src, dst):
        if Path(src).name.startswith(".ckpt.tmp-"):
            raise OSError(18, "Invalid cross-device link")
        return real_rename(src, dst)

    monkeypatch.setattr(weights_module.os, "rename", rename)
    with pytest.raises(ConfigError, match="cannot save a checkpoint"):
        _model(1).save_pretrained(folder)
    monkeypatch.undo()
    assert _digest(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    _assert_loads_as(folder, old)


def _side_folders(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_a_save_killed_at_any_point_loads_as_the_old_or_the_new_checkpoint(tmp_path, monkeypatch):
    """Every step of the publish protocol: a process killed before it leaves side
    folders that the next load turns back into one whole version (the new one once it
    was renamed in), and the next save removes whatever is left."""
    old, new = _model(0), _model(1)
    old.save_pretrained(tmp_path / "probe" / "ckpt")
    with monkeypatch.context() as m:
        full = die_at(m, 10**9, weights_module)
        new.save_pretrained(tmp_path / "probe" / "ckpt")
    renamed_in = full.index("rename", ".ckpt.tmp-")
    steps = len(full.seen)
    assert steps >= 8  # mkdir, writes, fsyncs, two renames, rmtree, ...
    for k in range(steps + 1):
        folder = tmp_path / f"kill{k}" / "ckpt"
        old.save_pretrained(folder)
        with monkeypatch.context() as m:
            ops = die_at(m, k, weights_module)
            with contextlib.suppress(Killed):
                new.save_pretrained(folder)
        assert len(ops.seen) >= min(k + 1, steps)
        _assert_loads_as(folder, new if k > renamed_in else old)
        assert not [n for n in _side_folders(folder.parent) if ".old-" in n], k
        new.save_pretrained(folder)
        assert sorted(p.name for p in folder.parent.iterdir()) == ["ckpt"], k
        _assert_loads_as(folder, new)


def test_a_really_killed_save_is_recovered(tmp_path):
    """The same with a real SIGKILL between the move aside and the rename in: the
    kernel drops the dead save's locks, so the next load restores the old version."""
    folder = tmp_path / "ckpt"
    _model(0).save_pretrained(folder)
    script = f"""
import os, signal
from glmport.model import GlmMoeDsaForCausalLM
real = os.rename
def rename(src, dst):
    if ".ckpt.tmp-" in str(src):  # the rename in: the old version is aside already
        os.kill(os.getpid(), signal.SIGKILL)
    return real(src, dst)
os.rename = rename
GlmMoeDsaForCausalLM.from_config("tiny", seed=1).save_pretrained({str(folder)!r})
"""
    done = subprocess.run([sys.executable, "-c", script], timeout=guard_s(10), check=False)
    assert done.returncode == -signal.SIGKILL
    assert not folder.exists() and any(".old-" in n for n in _side_folders(tmp_path))
    _assert_loads_as(folder, _model(0))


def test_sharded_then_unsharded_save_loads_the_new_weights(tmp_path):
    folder = tmp_path / "ckpt"
    _model(0).save_pretrained(folder, max_shard_bytes=SHARD_BYTES)
    assert (folder / INDEX_FILE).exists()
    new = _model(1)
    new.save_pretrained(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", SINGLE_FILE]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    _assert_loads_as(folder, new)


def test_unsharded_then_sharded_save_leaves_no_single_file(tmp_path):
    folder = tmp_path / "ckpt"
    _model(0).save_pretrained(folder)
    new = _model(1)
    new.save_pretrained(folder, max_shard_bytes=SHARD_BYTES)
    names = {p.name for p in folder.iterdir()}
    assert SINGLE_FILE not in names and INDEX_FILE in names
    index = json.loads((folder / INDEX_FILE).read_text())
    assert names == {"config.json", INDEX_FILE, *index["weight_map"].values()}
    _assert_loads_as(folder, new)


def test_files_beside_the_checkpoint_survive_a_save(tmp_path):
    folder = tmp_path / "ckpt"
    _model(0).save_pretrained(folder, max_shard_bytes=SHARD_BYTES)
    (folder / "tokenizer.json").write_text('{"vocab": 1}')
    (folder / "extras").mkdir()
    (folder / "extras" / "notes.txt").write_text("kept")
    _model(1).save_pretrained(folder)
    assert (folder / "tokenizer.json").read_text() == '{"vocab": 1}'
    assert (folder / "extras" / "notes.txt").read_text() == "kept"
    assert not list(folder.glob("model-*"))


def test_a_saved_folder_has_the_umask_mode_not_a_temp_dirs_0700(tmp_path):
    umask = os.umask(0o022)
    try:
        _model(0).save_pretrained(tmp_path / "ckpt")
    finally:
        os.umask(umask)
    assert (tmp_path / "ckpt").stat().st_mode & 0o777 == 0o755


def test_saving_onto_a_file_is_refused(tmp_path):
    (tmp_path / "taken").write_text("not a folder")
    with pytest.raises(ConfigError, match="not a folder"):
        _model(0).save_pretrained(tmp_path / "taken")
    assert (tmp_path / "taken").read_text() == "not a folder"


@pytest.mark.parametrize("bad", [0, -5, True, 1.5])
def test_a_bad_shard_size_is_refused_before_writing(tmp_path, bad):
    with pytest.raises(ConfigError, match="max_shard_bytes"):
        _model(0).save_pretrained(tmp_path / "ckpt", max_shard_bytes=bad)
    assert list(tmp_path.iterdir()) == []


def test_save_and_load_never_pickle(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("pickle used")

    for name in ("save", "load"):
        monkeypatch.setattr(torch, name, refuse)
    monkeypatch.setattr("pickle.dumps", refuse)
    monkeypatch.setattr("pickle.loads", refuse)
    model = _model(2)
    model.save_pretrained(tmp_path, max_shard_bytes=SHARD_BYTES)
    for file in tmp_path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt"):
            pass  # every weight file is a valid safetensors file
    _assert_loads_as(tmp_path, model)


# -- load_hf_state_dict: all or nothing --------------------------------------------


def _bad(kind: str, good: torch.Tensor) -> object:
    if kind == "nan":
        t = good.clone()
        t.view(-1)[-1] = math.nan
        return t
    if kind == "inf":
        t = good.clone()
        t.view(-1)[0] = -math.inf
        return t
    return {
        "shape": lambda: good[..., :-1].clone(),
        "int_dtype": lambda: good.to(torch.int32),
        "fp8_dtype": lambda: good.to(torch.float8_e4m3fn),
        "not_a_tensor": lambda: good.tolist(),
        "meta": lambda: torch.empty_like(good, device="meta"),
    }[kind]()


@pytest.mark.parametrize(
    "kind", ["nan", "inf", "shape", "int_dtype", "fp8_dtype", "not_a_tensor", "meta"]
)
def test_one_bad_tensor_among_good_ones_changes_nothing(kind):
    model = _model(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params_before = {k: id(p) for k, p in model.named_parameters()}
    state = {k: v + 1.0 for k, v in _model(5).state_dict().items()}
    last = sorted(state)[-1]  # checked last: every other tensor would already be in
    state[last] = _bad(kind, state[last])
    with pytest.raises(ConfigError) as err:
        model.load_hf_state_dict(state)
    _one_line_error(err, last)
    assert {k: id(p) for k, p in model.named_parameters()} == params_before
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("change", ["missing", "unexpected"])
def test_a_missing_or_unexpected_key_changes_nothing(change):
    model = _model(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: v + 1.0 for k, v in model.state_dict().items()}
    if change == "missing":
        state.pop("lm_head.weight")
    else:
        state["model.layers.0.surprise"] = torch.zeros(3)
    with pytest.raises(ConfigError, match=change):
        model.load_hf_state_dict(state)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_a_good_state_replaces_every_tensor_and_keeps_half_precision():
    model = _model(0)
    state = {k: (v + 1.0).to(torch.bfloat16) for k, v in _model(5).state_dict().items()}
    model.load_hf_state_dict(state)
    for key, value in model.state_dict().items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, state[key]), key


# -- config validation -------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"hidden_size": "64"}, "hidden_size"),
        ({"hidden_size": 64.0}, "hidden_size"),
        ({"num_hidden_layers": True}, "num_hidden_layers"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"num_attention_heads": -4}, "num_attention_heads"),
        ({"n_shared_experts": -1}, "n_shared_experts"),
        ({"n_routed_experts": 8, "n_group": 3}, "n_group"),
        ({"n_group": 2, "topk_group": 4}, "topk_group"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "num_experts_per_tok"),
        ({"index_topk": 0}, "index_topk"),
        ({"index_topk": -2048}, "index_topk"),
        ({"rms_norm_eps": -1e-6}, "rms_norm_eps"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
        ({"rms_norm_eps": math.nan}, "rms_norm_eps"),
        ({"rms_norm_eps": "1e-5"}, "rms_norm_eps"),
        ({"routed_scaling_factor": math.inf}, "routed_scaling_factor"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"initializer_range": -0.02}, "initializer_range"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
        ({"attention_bias": 1}, "attention_bias"),
        ({"eos_token_id": [1, -1]}, "eos_token_id"),
        ({"bos_token_id": "0"}, "bos_token_id"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        ({"model_type": ["glm_moe_dsa"]}, "model_type"),
    ],
)
def test_bad_config_fields_are_one_line_errors_naming_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        GlmMoeDsaConfig.tiny(**override)
    _one_line_error(err, field)


@pytest.mark.parametrize(
    "override",
    [{"hidden_size": 10**7}, {"vocab_size": 10**13}, {"num_hidden_layers": 10**9}],
)
def test_absurd_sizes_are_refused_with_the_estimate(override):
    cfg = dataclass_dict(GlmMoeDsaConfig.tiny())
    cfg.update(override)
    with pytest.raises(ConfigError) as err:
        GlmMoeDsaConfig(**cfg)
    message = _one_line_error(err, "parameters", "TiB", "MAX_PARAMETER_BYTES")
    assert f"{MAX_PARAMETER_BYTES / 2**40:.0f} TiB" in message


def dataclass_dict(cfg: GlmMoeDsaConfig) -> dict:
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


@pytest.mark.parametrize(
    "cfg",
    [
        GlmMoeDsaConfig.tiny(),
        GlmMoeDsaConfig.tiny(attention_bias=True, num_nextn_predict_layers=2),
        GlmMoeDsaConfig.tiny(first_k_dense_replace=7, n_shared_experts=2),
        GlmMoeDsaConfig.glm5(),
        GlmMoeDsaConfig.from_dict({"model_type": "deepseek_v32", "n_group": 8, "topk_group": 4}),
    ],
    ids=["tiny", "bias_mtp2", "all_dense", "glm5", "dsv32"],
)
def test_the_parameter_estimate_is_the_exact_state_dict_size(cfg):
    model = GlmMoeDsaForCausalLM.from_config(cfg, device="meta")
    assert cfg.parameter_count() == sum(t.numel() for t in model.state_dict().values())
    assert 4 * cfg.parameter_count() <= MAX_PARAMETER_BYTES


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[1, 2, 3]", "must hold a JSON object"),
        ("null", "must hold a JSON object"),
        ('"glm"', "must hold a JSON object"),
        ("{broken", "cannot read model config"),
        ('{"hidden_size": "64"}', "hidden_size"),
        ('{"rope_parameters": [1]}', "rope_parameters"),
        ('{"rope_parameters": {"rope_theta": "big"}}', "rope_theta"),
    ],
)
def test_a_bad_config_json_is_refused_at_load(tmp_path, text, needle):
    _model(0).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    if text.startswith("{") and not text.startswith("{broken"):  # one field made bad
        text = json.dumps({**saved, **json.loads(text)})
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError) as err:
        GlmMoeDsaForCausalLM.from_pretrained(tmp_path)
    _one_line_error(err, needle)


def test_from_dict_refuses_a_non_object():
    with pytest.raises(ConfigError, match="JSON object"):
        GlmMoeDsaConfig.from_dict([("hidden_size", 64)])
