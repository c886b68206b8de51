"""Trainer checkpoints: what :meth:`Trainer.save <glmport.rl.trainer.Trainer.save>`
writes (:func:`write_checkpoint`) and :meth:`Trainer.resume
<glmport.rl.trainer.Trainer.resume>` reads, checked whole before anything in them is
used.

A checkpoint folder holds:

- ``state.json``: ``step``, ``policy_version``, ``rl_config`` (every
  :class:`~glmport.rl.config.RLConfig` field), ``rng`` (the run's seed and next step:
  step ``s`` draws only from generators seeded by ``(seed, s)``),
  ``optimizer_param_groups`` (Adam's hyper-parameters), ``optimizer_state_params``
  (the indices of the parameters Adam holds state for: parameters that never had a
  gradient, the indexer's, have none) and what the trainer class adds (the
  asynchronous trainer's ``async``);
- ``optimizer.safetensors``: Adam's tensors, ``state.{index}.{step|exp_avg|exp_avg_sq}``;
- ``policy/``: the policy as an HF checkpoint (``from_pretrained`` loads it).

Everything is contained like a model checkpoint (no member is a link out of the
folder: :func:`glmport.model.weights.contained_path`) and checked like one: every
field's type and range, ``state.json`` against itself (``policy_version`` and
``rng`` follow ``step``), the policy against the run's architecture (its
``config.json`` field by field, float32 weights, all or nothing), the optimizer's
tensors against the policy's parameters (every one, its shape, dtype, finite values).
Any failure is a :class:`ConfigError` naming the file and the field, raised before
the trainer takes anything.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

import glmport
from glmport.core.errors import BackendUnavailableError, ConfigError, check_int
from glmport.model import GlmMoeDsaForCausalLM
from glmport.model.weights import atomic_folder, contained_path, read_safetensors, recover_folder

from .config import RLConfig

STATE = "state.json"
OPTIMIZER = "optimizer.safetensors"
POLICY = "policy"
# The keys of state.json every trainer writes; a trainer class adds its own.
STATE_KEYS = (
    "step",
    "policy_version",
    "rl_config",
    "rng",
    "optimizer_param_groups",
    "optimizer_state_params",
)
# Adam's per-parameter tensors (amsgrad, which RL never turns on, would add one).
ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")
MAX_STATE_BYTES = 64 << 20  # the asynchronous trainer's queue makes state.json grow


@dataclass(frozen=True)
class SavedState:
    """A checkpoint's ``state.json``, checked: ``config`` and ``step`` (the policy
    version and the RNG state follow it); ``extra``: the keys beyond
    :data:`STATE_KEYS`, for the trainer class to check; ``data``: the whole object."""

    folder: Path
    file: Path
    config: RLConfig
    step: int
    extra: dict
    data: dict


@dataclass(frozen=True)
class SavedWeights:
    """A checkpoint's tensors, checked against a trainer: ``policy`` (its state dict)
    and ``optimizer`` (an Adam ``state_dict``)."""

    policy: dict[str, torch.Tensor]
    optimizer: dict


def write_checkpoint(
    folder: Path,
    policy: GlmMoeDsaForCausalLM,
    optimizer: torch.optim.Optimizer,
    *,
    step: int,
    version: int,
    config: RLConfig,
    extra: dict,
) -> None:
    """Write a checkpoint into ``folder``, atomically (an earlier one there stays whole
    until the new one is complete: :func:`~glmport.model.weights.atomic_folder`): the
    ``policy`` (float weights) as an HF checkpoint, Adam's tensors (float32) and
    ``state.json`` with ``extra``, the trainer class's own keys."""
    state = optimizer.state_dict()
    tensors = {
        f"state.{index}.{name}": torch.as_tensor(value).clone().contiguous()
        for index, per_param in state["state"].items()
        for name, value in per_param.items()
    }
    with atomic_folder(folder) as tmp:
        policy.save_pretrained(tmp / POLICY)
        save_file(tensors, str(tmp / OPTIMIZER))
        saved = {
            "step": step,
            "policy_version": version,
            "rl_config": config.to_json(),
            # Step s draws only from generators seeded by (seed, s): this is the RNG state.
            "rng": {"seed": config.seed, "next_step": step},
            "optimizer_param_groups": state["param_groups"],
            "optimizer_state_params": sorted(state["state"]),
            **extra,
        }
        (tmp / STATE).write_text(json.dumps(saved, indent=2))


def field_error(where: str, message: str) -> ConfigError:
    """``"<where> <message>"``: ``where`` names the file and the field."""
    return ConfigError(f"{where} {message}")


def exact_keys(value: object, keys: tuple[str, ...] | list[str], where: str) -> dict:
    """``value`` when it is a JSON object with exactly ``keys``; else a ConfigError
    naming the missing or unexpected ones."""
    if not isinstance(value, dict):
        raise field_error(where, f"must be an object, got {_kind(value)}")
    missing = [k for k in keys if k not in value]
    if missing:
        raise field_error(where, f"lacks {', '.join(missing)}")
    unknown = sorted(map(str, set(value) - set(keys)))
    if unknown:
        raise field_error(where, f"has unexpected keys {', '.join(unknown)}")
    return value


def _kind(value: object) -> str:
    return "null" if value is None else f"{type(value).__name__} {_short(value)}"


def _short(value: object) -> str:
    text = repr(value) if not isinstance(value, int) or value.bit_length() <= 64 else "(huge)"
    return text if len(text) <= 60 else text[:57] + "..."


def checkpoint_folder(folder: str | Path) -> Path:
    """The real path of the checkpoint folder ``folder`` (after
    :func:`~glmport.model.weights.recover_folder`), which must be a folder with a
    ``state.json``."""
    given = Path(folder)
    recover_folder(given)
    if given.is_symlink():
        raise ConfigError(
            f"{given} is a link (to {given.resolve()}); a run's checkpoint is its own folder"
        )
    if not given.is_dir() or not (given / STATE).exists():
        raise ConfigError(f"{given} is not an RL checkpoint (no {STATE})")
    return given.resolve()


def member(folder: Path, name: str, *, is_dir: bool = False) -> Path:
    """The real path of ``folder``'s member ``name``, inside it and of the right kind."""
    real = contained_path(folder, name, str(folder))
    if is_dir != real.is_dir() or not (is_dir or real.is_file()):
        kind = "a folder" if is_dir else "a regular file"
        raise ConfigError(f"{folder / name} must be {kind}")
    return real


def read_json(file: Path, max_bytes: int = MAX_STATE_BYTES) -> object:
    """The JSON value in ``file``: UTF-8, at most ``max_bytes``, no NaN or Infinity."""

    def refuse_constant(name: str) -> float:
        raise ValueError(f"{name} is not a JSON number")

    try:
        with file.open("rb") as f:
            raw = f.read(max_bytes + 1)
        if len(raw) > max_bytes:
            raise ValueError(f"larger than {max_bytes} bytes")
        return json.loads(raw.decode("utf-8"), parse_constant=refuse_constant)
    except (OSError, ValueError) as err:  # JSONDecodeError, UnicodeDecodeError: ValueErrors
        raise ConfigError(f"{file} is not readable JSON: {err}") from err


def read_state(folder: str | Path) -> SavedState:
    """Read and check the ``state.json`` of the checkpoint in ``folder`` (nothing else
    is read)."""
    real = checkpoint_folder(folder)
    file = member(real, STATE)
    data = read_json(file)
    if not isinstance(data, dict):
        raise field_error(str(file), f"must hold a JSON object, got {_kind(data)}")
    missing = [k for k in STATE_KEYS if k not in data]
    if missing:
        raise field_error(str(file), f"lacks {', '.join(missing)}")
    try:
        config = RLConfig.from_json(data["rl_config"], complete=True)
    except ConfigError as err:
        raise field_error(f"{file}: rl_config:", str(err)) from err
    for name in ("rollout_backend", "train_backend"):  # an unknown backend fails here
        try:
            with glmport.use_backend(getattr(config, name)):
                pass
        except BackendUnavailableError as err:
            raise field_error(f"{file}: rl_config.{name}:", str(err)) from err
    step = check_int(f"{file}: step", data["step"], 0, config.steps)
    version = data["policy_version"]
    if isinstance(version, bool) or not isinstance(version, int) or version != step:
        raise field_error(
            f"{file}: policy_version",
            f"must equal step ({step}: every step makes one version), got {_kind(version)}",
        )
    rng = exact_keys(data["rng"], ("seed", "next_step"), f"{file}: rng")
    for key, want in (("seed", config.seed), ("next_step", step)):
        got = rng[key]
        if got != want or isinstance(got, bool) or not isinstance(got, int):
            raise field_error(f"{file}: rng.{key}", f"must be {want}, got {_kind(got)}")
    extra = {k: v for k, v in data.items() if k not in STATE_KEYS}
    return SavedState(real, file, config, step, extra, data)


def read_weights(
    saved: SavedState, policy: GlmMoeDsaForCausalLM, optimizer: torch.optim.Optimizer
) -> SavedWeights:
    """The policy's and the optimizer's state in ``saved``'s folder, checked against
    the trainer's fresh ``policy`` and Adam ``optimizer`` (nothing is loaded into
    them)."""
    policy_dir = member(saved.folder, POLICY, is_dir=True)
    config_file = member(policy_dir, "config.json")
    try:
        loaded = GlmMoeDsaForCausalLM.from_pretrained(policy_dir)
    except ConfigError as err:  # the model's messages name the tensor, not always the folder
        raise field_error(f"{policy_dir} (the policy):", str(err)) from err
    want, got = policy.config.to_dict(), loaded.config.to_dict()
    for key in sorted(set(want) | set(got)):
        if want.get(key) != got.get(key):
            raise field_error(
                f"{config_file}: {key}",
                f"is {got.get(key)!r}; the run's policy has {want.get(key)!r}",
            )
    own = policy.state_dict()
    state = loaded.state_dict()
    for key, tensor in state.items():
        if tensor.dtype != own[key].dtype:
            raise field_error(
                f"{policy_dir}: tensor {key}",
                f"is {tensor.dtype}; the trainer's policy is {own[key].dtype}",
            )
    return SavedWeights(state, _read_optimizer(saved, policy, optimizer))


def _read_optimizer(
    saved: SavedState, policy: GlmMoeDsaForCausalLM, optimizer: torch.optim.Optimizer
) -> dict:
    """The Adam ``state_dict`` of the checkpoint, checked against the fresh
    ``optimizer`` over ``policy``'s parameters."""
    fresh = optimizer.state_dict()
    file = saved.file
    groups = saved.data["optimizer_param_groups"]
    plain = json.loads(json.dumps(fresh["param_groups"]))  # tuples as JSON lists
    if not isinstance(groups, list) or len(groups) != len(plain):
        raise field_error(
            f"{file}: optimizer_param_groups",
            f"must be a list of {len(plain)} group(s), got {_kind(groups)}",
        )
    for i, (group, mine) in enumerate(zip(groups, plain, strict=True)):
        exact_keys(group, list(mine), f"{file}: optimizer_param_groups[{i}]")
        for key, value in mine.items():
            if group[key] != value or type(group[key]) is not type(value):
                raise field_error(
                    f"{file}: optimizer_param_groups[{i}].{key}",
                    f"is {_kind(group[key])}; this run's Adam has {value!r}",
                )
    names = [name for name, _ in policy.named_parameters()]
    params = dict(enumerate(p for _, p in policy.named_parameters()))
    held = saved.data["optimizer_state_params"]
    where = f"{file}: optimizer_state_params"
    if not isinstance(held, list):
        raise field_error(where, f"must be a list of parameter indices, got {_kind(held)}")
    for index in held:
        if isinstance(index, bool) or not isinstance(index, int) or index not in params:
            raise field_error(where, f"holds {_kind(index)}, not an index below {len(params)}")
    if held != sorted(set(held)):
        raise field_error(where, "must be increasing, without repeats")
    if saved.step == 0 and held:
        raise field_error(where, "must be empty at step 0 (no update made Adam state yet)")
    opt_file = member(saved.folder, OPTIMIZER)
    tensors = read_safetensors(opt_file, OPTIMIZER)
    wanted = {f"state.{i}.{name}": (i, name) for i in held for name in ADAM_STATE}
    for key, (i, name) in wanted.items():
        if key not in tensors:
            raise field_error(
                f"{opt_file}: tensor {key}",
                f"(Adam's {name} of {names[i]}, listed in {where}) is missing",
            )
    unknown = sorted(set(tensors) - set(wanted))
    if unknown:
        raise field_error(
            f"{opt_file}: tensor {unknown[0]}",
            f"is not Adam state of a parameter that {where} lists",
        )
    updates = saved.step * saved.config.minibatches
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, (i, name) in wanted.items():
        where_tensor = f"{opt_file}: tensor {key}"
        value = tensors[key]
        shape = () if name == "step" else tuple(params[i].shape)
        if tuple(value.shape) != shape or value.dtype != torch.float32:
            raise field_error(
                where_tensor,
                f"is {value.dtype} {list(value.shape)}; Adam's {name} of {names[i]} is "
                f"torch.float32 {list(shape)}",
            )
        if not bool(torch.isfinite(value).all()):
            raise field_error(where_tensor, "holds NaN or Inf")
        if name == "step":
            count = float(value)
            if count != math.floor(count) or not 1 <= count <= updates:
                raise field_error(
                    where_tensor,
                    f"is {count:g}; Adam's step count is a whole number from 1 to "
                    f"{updates} (steps x minibatches) here",
                )
        if name == "exp_avg_sq" and bool((value < 0).any()):
            raise field_error(where_tensor, "holds negative values (it averages squares)")
        state.setdefault(i, {})[name] = value
    return {"state": state, "param_groups": fresh["param_groups"]}
