"""HF-format safetensors: the key names of transformers' ``GlmMoeDsaForCausalLM``
checkpoints (per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``, MTP layers at
``model.layers.{num_hidden_layers}.*``), single files or sharded with an index.
Never unpickles: only safetensors are read."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from glmport.core.errors import ConfigError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused expert tensors -> the per-expert keys checkpoints store."""
    out = {}
    for key, value in state.items():
        m = _FUSED.match(key)
        if m is None:
            out[key] = value
            continue
        prefix, kind = m.groups()
        for e, w in enumerate(value.unbind(0)):
            if kind == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = w
            else:
                gate, up = w.chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
    return out


def fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint keys -> fused ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for key, value in state.items():
        m = _PER_EXPERT.match(key)
        if m is None:
            out[key] = value
            continue
        prefix, e, kind = m.groups()
        experts.setdefault(prefix, {}).setdefault(kind, {})[int(e)] = value
    for prefix, kinds in experts.items():
        count = len(kinds.get("down_proj", {}))
        for kind in ("gate_proj", "up_proj", "down_proj"):
            got = sorted(kinds.get(kind, {}))
            if got != list(range(count)):
                raise ConfigError(
                    f"checkpoint experts under {prefix}: {kind} has experts {got[:8]}..., "
                    f"expected 0..{count - 1}"
                )
        stack = {k: torch.stack([kinds[k][e] for e in range(count)]) for k in kinds}
        out[f"{prefix}.gate_up_proj"] = torch.cat((stack["gate_proj"], stack["up_proj"]), dim=1)
        out[f"{prefix}.down_proj"] = stack["down_proj"]
    return out


def _files(path: Path) -> list[Path]:
    if (path / INDEX_FILE).exists():
        index = json.loads((path / INDEX_FILE).read_text())
        return [path / f for f in sorted(set(index["weight_map"].values()))]
    if (path / SINGLE_FILE).exists():
        return [path / SINGLE_FILE]
    raise ConfigError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path} (only safetensors are read)")


def read_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a checkpoint folder, one at a time (shards opened lazily)."""
    for file in _files(Path(path)):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield key, f.get_tensor(key)


def save_tensors(
    state: dict[str, torch.Tensor], path: str | Path, max_shard_bytes: int = 5 << 30
) -> None:
    """Write ``state`` as safetensors, sharded with an index past ``max_shard_bytes``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(state):
        t = state[key].detach().contiguous().cpu()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(path / SINGLE_FILE), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        for key, t in shard.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
