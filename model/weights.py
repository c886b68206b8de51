"""HF-format safetensors: the key names of transformers' ``GlmMoeDsaForCausalLM``
checkpoints (per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``, MTP layers at
``model.layers.{num_hidden_layers}.*``), single files or sharded with an index.
Never unpickles: only safetensors are read."""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from glmport.core.errors import ConfigError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# The files a save writes (and replaces): anything else in a checkpoint folder is kept.
CHECKPOINT_NAMES = re.compile(
    r"^(config\.json|model\.safetensors|model\.safetensors\.index\.json"
    r"|model-\d+-of-\d+\.safetensors)$"
)
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
# Expert numbers without leading zeros: "007" would alias expert 7 and overwrite it.
_PER_EXPERT = re.compile(
    r"^(.*\.mlp\.experts)\.(0|[1-9]\d*)\.(gate_proj|up_proj|down_proj)\.weight$"
)


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
    """Per-expert checkpoint keys -> fused ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``.

    Experts must be numbered ``0..E-1`` (no gaps, no ``007`` aliases), each kind of one
    shape and dtype; a fused tensor beside per-expert ones is refused, not overwritten.
    """
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
        for kind in ("gate_proj", "up_proj", "down_proj"):
            first = kinds[kind][0]
            for e in range(count):
                w = kinds[kind][e]
                if w.shape != first.shape or w.dtype != first.dtype:
                    raise ConfigError(
                        f"checkpoint tensor {prefix}.{e}.{kind}.weight is {w.dtype} "
                        f"{list(w.shape)}, expert 0 is {first.dtype} {list(first.shape)}"
                    )
        if kinds["gate_proj"][0].shape != kinds["up_proj"][0].shape:
            raise ConfigError(
                f"checkpoint experts under {prefix}: gate_proj is "
                f"{list(kinds['gate_proj'][0].shape)}, up_proj "
                f"{list(kinds['up_proj'][0].shape)}; expected the same shape"
            )
        for fused in ("gate_up_proj", "down_proj"):
            if f"{prefix}.{fused}" in out:
                raise ConfigError(
                    f"checkpoint holds both {prefix}.{fused} and per-expert tensors of it"
                )
        stack = {k: torch.stack([kinds[k][e] for e in range(count)]) for k in kinds}
        out[f"{prefix}.gate_up_proj"] = torch.cat((stack["gate_proj"], stack["up_proj"]), dim=1)
        out[f"{prefix}.down_proj"] = stack["down_proj"]
    return out


def _error(message: str) -> ConfigError:
    """A one-line :class:`ConfigError` (library messages may span lines)."""
    return ConfigError(" ".join(message.split()))


def _allowed_roots(folder: Path) -> list[Path]:
    """Where a checkpoint file of ``folder`` (resolved) may really live: inside it, or,
    for a Hugging Face hub cache snapshot (``<repo>/snapshots/<rev>``, whose files are
    symlinks to ``<repo>/blobs/``), in that repository's own ``blobs`` folder."""
    roots = [folder]
    if folder.parent.name == "snapshots":
        roots.append(folder.parent.parent / "blobs")
    return roots


def _shard_path(folder: Path, name: object, key: str) -> Path:
    """The real path of the file ``name`` that the index gives for ``key``, checked to
    stay in ``folder`` (no absolute path, no ``..``, no symlink out of it)."""
    where = f"{INDEX_FILE} in {folder}: weight_map[{key!r}]"
    if not isinstance(name, str) or not name:
        raise _error(f"{where} must be a file name, got {name!r}")
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts or "\\" in name:
        raise _error(f"{where} = {name!r} points outside the checkpoint folder")
    candidate = folder / relative
    if not candidate.exists() and not candidate.is_symlink():
        raise _error(f"{where} names {name!r}, which is missing from the checkpoint folder")
    real = candidate.resolve()
    if not any(real.is_relative_to(root) for root in _allowed_roots(folder)):
        raise _error(f"{where} = {name!r} is a link to {real}, outside the checkpoint folder")
    if not real.is_file():
        raise _error(f"{where} names {name!r}, which is not a regular file")
    return real


def _read_index(folder: Path) -> dict[str, str]:
    index_path = folder / INDEX_FILE
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _error(f"cannot read {index_path}: {err}") from err
    if not isinstance(index, dict):
        raise _error(f"{index_path} must hold a JSON object, got {type(index).__name__}")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise _error(
            f"{index_path} has no weight_map (a non-empty object of tensor name -> "
            f"shard file), got {type(weight_map).__name__}"
        )
    return weight_map


def _open(file: Path, name: str):
    try:
        return safe_open(str(file), framework="pt")
    except Exception as err:  # SafetensorError and OSError: a truncated or corrupt file
        raise _error(
            f"checkpoint file {name} ({file}) is not a readable safetensors file: {err}"
        ) from err


def checkpoint_plan(path: str | Path) -> list[tuple[Path, list[str]]]:
    """Which keys to read from which file, every file's header checked first.

    Sharded (``model.safetensors.index.json``): exactly the files the index's
    ``weight_map`` names, each key from its named file only; a key the map puts in
    another file, one in two shards, one missing from its shard, a shard not in the
    folder (absolute, ``..``, a symlink out of it), a missing, truncated or corrupt
    shard, or an index without ``weight_map`` is a :class:`ConfigError` naming the
    file and key, raised before any tensor is read. Otherwise ``model.safetensors``
    and all its keys. Returns ``[(real file path, sorted keys)]``.
    """
    given = Path(path)
    if not given.is_dir():
        raise _error(f"checkpoint folder {given} does not exist or is not a folder")
    folder = given.resolve()
    if (folder / INDEX_FILE).exists():
        weight_map = _read_index(folder)
        names: dict[Path, str] = {}
        wanted: dict[Path, set[str]] = {}
        for key in sorted(weight_map):
            real = _shard_path(folder, weight_map[key], key)
            names.setdefault(real, weight_map[key])
            wanted.setdefault(real, set()).add(key)
        holders: dict[str, list[str]] = {}
        held: dict[Path, set[str]] = {}
        for real in sorted(wanted):
            with _open(real, names[real]) as f:
                held[real] = set(f.keys())
            for key in held[real]:
                holders.setdefault(key, []).append(names[real])
        for real in sorted(wanted):
            for key in sorted(wanted[real] - held[real]):
                raise _error(
                    f"weight_map puts tensor {key} in {names[real]}, which does not hold it"
                    + (f" (found in {', '.join(holders[key])})" if key in holders else "")
                )
        for key in sorted(holders):
            if len(holders[key]) > 1:
                raise _error(f"tensor {key} is in two shards: {', '.join(holders[key])}")
            if key not in weight_map:
                raise _error(f"tensor {key} in {holders[key][0]} is not in the weight_map")
        return [(real, sorted(wanted[real])) for real in sorted(wanted)]
    single = folder / SINGLE_FILE
    if single.exists() or single.is_symlink():
        real = single.resolve()
        if not any(real.is_relative_to(root) for root in _allowed_roots(folder)):
            raise _error(f"{single} is a link to {real}, outside the checkpoint folder")
        if not real.is_file():
            raise _error(f"{single} is not a regular file")
        with _open(real, SINGLE_FILE) as f:
            return [(real, sorted(f.keys()))]
    raise _error(f"no {SINGLE_FILE} or {INDEX_FILE} in {given} (only safetensors are read)")


def read_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a checkpoint folder, one at a time, after :func:`checkpoint_plan`
    has checked every file's header and the index (shards opened one at a time)."""
    for file, keys in checkpoint_plan(path):
        with _open(file, file.name) as f:
            for key in keys:
                try:
                    tensor = f.get_tensor(key)
                except Exception as err:  # an unsupported dtype or unreadable data
                    raise _error(f"cannot read tensor {key} from {file}: {err}") from err
                yield key, tensor


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file, or on POSIX a folder's entries) to disk, so the rename
    that publishes a checkpoint never lands before its contents."""
    if path.is_dir() and os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _carry_over(old: Path, new: Path) -> None:
    """Put ``old``'s files that are not part of a checkpoint (a tokenizer, a README) in
    ``new`` too: replacing a checkpoint must not delete what was saved beside it. A
    name the new save wrote itself is the new save's."""
    for entry in old.iterdir():
        if CHECKPOINT_NAMES.match(entry.name) or (new / entry.name).exists():
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry), new / entry.name)
        elif entry.is_dir():
            shutil.copytree(entry, new / entry.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(entry), str(new / entry.name))


@contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary folder next to ``path``; when the block ends without an
    error, publish it as ``path`` by rename.

    An existing ``path`` stays whole until the new folder is complete: it is renamed
    aside, the new one renamed in, then the old one removed (its non-checkpoint files
    carried over first). An error in the block removes the temporary folder and leaves
    ``path`` as it was. Checkpoint files of an earlier save (shards, index) never
    survive into the new folder, so nothing stale can be read back.
    """
    target = Path(path)
    if target.is_symlink():
        target = target.resolve()
    if target.exists() and not target.is_dir():
        raise ConfigError(f"cannot save a checkpoint to {target}: it exists and is not a folder")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # mkdir, not tempfile.mkdtemp: the published folder gets the umask's mode, not 0700
        tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex}"
        tmp.mkdir()
        if target.exists():
            shutil.copymode(target, tmp)
    except OSError as err:
        raise ConfigError(f"cannot save a checkpoint to {target}: {err}") from err
    try:
        yield tmp
        if target.exists():
            _carry_over(target, tmp)
        for file in tmp.rglob("*"):
            if file.is_file() and not file.is_symlink():
                _fsync(file)
        _fsync(tmp)
        _publish(tmp, target)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"cannot save a checkpoint to {target}: {err}") from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: Path, target: Path) -> None:
    if not target.exists():
        os.rename(tmp, target)
    else:
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex}"
        os.rename(target, old)
        try:
            os.rename(tmp, target)
        except OSError:
            os.rename(old, target)  # put the previous checkpoint back
            raise
        shutil.rmtree(old, ignore_errors=True)
    _fsync(target.parent)


def save_tensors(
    state: dict[str, torch.Tensor], path: str | Path, max_shard_bytes: int = 5 << 30
) -> None:
    """Write ``state`` as safetensors into the folder ``path`` (made if absent), sharded
    with an index past ``max_shard_bytes``. Not atomic by itself: callers write into
    :func:`atomic_folder`'s temporary folder."""
    if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool):
        raise ConfigError(f"max_shard_bytes must be an integer, got {max_shard_bytes!r}")
    if max_shard_bytes <= 0:
        raise ConfigError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
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
