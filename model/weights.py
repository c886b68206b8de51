"""HF-format safetensors: the key names of transformers' ``GlmMoeDsaForCausalLM``
checkpoints (per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``, MTP layers at
``model.layers.{num_hidden_layers}.*``), single files or sharded with an index.
Never unpickles: only safetensors are read."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from glmport.core.errors import ConfigError

try:
    import fcntl
except ImportError:  # not POSIX: saves take no locks (see _locked)
    fcntl = None

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# The files a save writes (and replaces): anything else in a checkpoint folder is kept.
CHECKPOINT_NAMES = re.compile(
    r"^(config\.json|model\.safetensors|model\.safetensors\.index\.json"
    r"|model-\d+-of-\d+\.safetensors)$"
)
# The side folders of a save (see _side_folder): the target's name, the kind, a uuid.
_SIDE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-[0-9a-f]{32}$")
# How long recover_folder waits for a running save to rename its new version in (the
# gap between two renames, but a loaded machine can stall a process for seconds).
RECOVERY_WAIT_S = 10.0
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


def contained_path(folder: Path, name: str, where: str) -> Path:
    """The real path of ``folder / name``, checked to exist and to stay in ``folder``
    (already resolved): no symlink out of it (the hub cache's links into its own
    ``blobs`` excepted, see :func:`_allowed_roots`). ``where`` names the entry in the
    :class:`ConfigError` (the file and the field or key that named it)."""
    candidate = folder / name
    if not candidate.exists() and not candidate.is_symlink():
        raise _error(f"{where}: {name!r} is missing from the checkpoint folder")
    real = candidate.resolve()
    if not any(real.is_relative_to(root) for root in _allowed_roots(folder)):
        raise _error(f"{where}: {name!r} is a link to {real}, outside the checkpoint folder")
    return real


def _shard_path(folder: Path, name: object, key: str) -> Path:
    """The real path of the file ``name`` that the index gives for ``key``, checked to
    stay in ``folder`` (no absolute path, no ``..``, no symlink out of it)."""
    where = f"{INDEX_FILE} in {folder}: weight_map[{key!r}]"
    if not isinstance(name, str) or not name:
        raise _error(f"{where} must be a file name, got {name!r}")
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts or "\\" in name:
        raise _error(f"{where} = {name!r} points outside the checkpoint folder")
    real = contained_path(folder, name, where)
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
    recover_folder(given)  # a save killed while replacing it may have left it aside
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
        real = contained_path(folder, SINGLE_FILE, str(folder))
        if not real.is_file():
            raise _error(f"{single} is not a regular file")
        with _open(real, SINGLE_FILE) as f:
            return [(real, sorted(f.keys()))]
    raise _error(f"no {SINGLE_FILE} or {INDEX_FILE} in {given} (only safetensors are read)")


def read_tensors(
    path: str | Path, keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a checkpoint folder (or those whose key ``keep`` accepts), one
    at a time, after :func:`checkpoint_plan` has checked every file's header and the
    index; shards are opened one at a time and memory-mapped, so a tensor not kept is
    never read."""
    for file, keys in checkpoint_plan(path):
        wanted = keys if keep is None else [k for k in keys if keep(k)]
        if wanted:
            yield from _read_keys(file, file.name, wanted)


def read_safetensors(file: Path, name: str) -> dict[str, torch.Tensor]:
    """Every tensor of the one safetensors ``file`` (``name``: how errors call it); a
    missing, truncated or corrupt file or an unreadable tensor is a :class:`ConfigError`
    naming it."""
    with _open(file, name) as f:
        keys = sorted(f.keys())
    return dict(_read_keys(file, name, keys))


def _read_keys(file: Path, name: str, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    with _open(file, name) as f:
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


def _side_folder(target: Path, kind: str) -> Path:
    """A hidden sibling of ``target`` that a save uses: ``.{name}.tmp-{hex}`` (the new
    version being written) or ``.{name}.old-{hex}`` (the previous one, moved aside)."""
    return target.parent / f".{target.name}.{kind}-{uuid.uuid4().hex}"


@contextmanager
def _locked(folder: Path, *, wait: bool) -> Iterator[bool]:
    """Hold an exclusive advisory lock (``flock``) on ``folder`` for the block; yields
    False, holding nothing, when another process holds it and ``wait`` is False.

    A save holds its side folders locked while it needs them and the kernel drops the
    lock when the process dies, however it dies: an unlocked side folder is one a
    killed save left. Without ``fcntl`` (not POSIX) nothing is locked and every side
    folder counts as left behind."""
    if fcntl is None:
        yield True
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _real_target(path: str | Path) -> Path:
    target = Path(path)
    return target.resolve() if target.is_symlink() else target


def recover_folder(path: str | Path, *, clean: bool = False) -> None:
    """Undo or finish what a save killed mid-way left beside the folder ``path``.

    A save (:func:`atomic_folder`) writes ``.{name}.tmp-*``, moves the previous version
    aside to ``.{name}.old-*``, renames the new one in and removes the old one. Side
    folders that no running save holds (see :func:`_locked`) are left-overs: an old
    version beside a missing ``path`` is the last complete checkpoint and is renamed
    back (as if the interrupted save never happened); beside a present ``path`` it was
    replaced already and is removed. ``clean`` (what a save does first) also removes
    left-over temporary folders (a reader leaves them: a save that just made its own
    has not locked it yet). A running save's folders are never touched; while one has
    ``path`` moved aside this waits (up to :data:`RECOVERY_WAIT_S`) for the new
    version. Every save and every load calls this first.

    Raises:
        ConfigError: renaming the previous version back failed, several candidates
            exist, or a running save keeps ``path`` absent.
    """
    target = _real_target(path)
    deadline = time.monotonic() + RECOVERY_WAIT_S
    while True:
        with contextlib.ExitStack() as held:
            busy = _recover_once(target, held, clean)
        if not busy or target.exists():
            return
        if time.monotonic() > deadline:
            raise ConfigError(
                f"{target} is missing while another process's save replaces it; try again"
            )
        time.sleep(0.05)


def _recover_once(target: Path, held: contextlib.ExitStack, clean: bool) -> bool:
    """One pass of :func:`recover_folder`; True when a running save has ``target``'s
    previous version aside (so it is missing for now)."""
    try:
        entries = sorted(target.parent.iterdir())
    except OSError:  # no parent, or one this process may not list: nothing to recover
        return False
    left: dict[str, list[Path]] = {"tmp": [], "old": []}
    busy = False
    for entry in entries:
        side = _SIDE.match(entry.name)
        if side is None or side["name"] != target.name or (side["kind"] == "tmp" and not clean):
            continue
        if entry.is_symlink() or not entry.is_dir():
            continue
        try:
            free = held.enter_context(_locked(entry, wait=False))
        except OSError:  # its save finished with it meanwhile, or it is not ours to open
            continue
        if free:
            left[side["kind"]].append(entry)
        else:
            busy = busy or side["kind"] == "old"
    old = left["old"]
    if old and not target.exists() and not target.is_symlink():
        if len(old) > 1:
            raise ConfigError(
                f"{target} is missing and interrupted saves left several previous versions "
                f"beside it ({', '.join(p.name for p in old)}): rename the one to keep to "
                f"{target.name}"
            )
        try:
            os.rename(old[0], target)
            _fsync(target.parent)
        except OSError as err:
            raise ConfigError(
                f"{target} is missing: an interrupted save moved it aside to {old[0]}, "
                f"and renaming it back failed: {err}"
            ) from err
        log.warning("%s: restored the version an interrupted save had moved aside", target)
        old = []
    for entry in old + left["tmp"]:
        shutil.rmtree(entry, ignore_errors=True)
    return busy


@contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary folder next to ``path``; when the block ends without an
    error, publish it as ``path`` by rename.

    An existing ``path`` stays whole until the new folder is complete: it is renamed
    aside, the new one renamed in, then the old one removed (its non-checkpoint files
    carried over first). An error in the block removes the temporary folder and leaves
    ``path`` as it was. A process killed at any point leaves side folders that
    :func:`recover_folder` (run by the next save or load) turns back into the old or
    the new version, whole. Checkpoint files of an earlier save (shards, index) never
    survive into the new folder, so nothing stale can be read back.
    """
    target = _real_target(path)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"cannot save a checkpoint to {target}: it exists and is not a folder")
    with contextlib.ExitStack() as held:
        tmp = None
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            recover_folder(target, clean=True)
            # mkdir, not tempfile.mkdtemp: the published folder gets the umask's mode, not 0700
            tmp = _side_folder(target, "tmp")
            tmp.mkdir()
            held.enter_context(_locked(tmp, wait=True))
            if target.exists():
                shutil.copymode(target, tmp)
            yield tmp
            if target.exists():
                _carry_over(target, tmp)
            for file in tmp.rglob("*"):
                if file.is_file() and not file.is_symlink():
                    _fsync(file)
            _fsync(tmp)
            _publish(tmp, target, held)
        except OSError as err:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise ConfigError(f"cannot save a checkpoint to {target}: {err}") from err
        except BaseException:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise


def _publish(tmp: Path, target: Path, held: contextlib.ExitStack) -> None:
    """Rename the complete ``tmp`` to ``target``; an existing ``target`` is locked (in
    ``held``) and moved aside first, then removed once the new one is in."""
    if not target.exists():
        os.rename(tmp, target)
        _fsync(target.parent)
        return
    held.enter_context(_locked(target, wait=True))
    old = _side_folder(target, "old")
    os.rename(target, old)
    try:
        os.rename(tmp, target)
    except OSError:
        os.rename(old, target)  # put the previous checkpoint back
        raise
    _fsync(target.parent)
    shutil.rmtree(old, ignore_errors=True)


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
