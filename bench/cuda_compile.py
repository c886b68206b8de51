"""The cuda backend's Triton kernels compiled for a GPU on a machine without one: every
kernel x every autotune config x the specialisations the op wrappers produce, for
sm_90a (Hopper) and sm_100a (Blackwell), with what the hardware would get.

How: a stand-in Triton driver answers "the current target is sm_90 / sm_100" (no GPU is
touched); each conformance case of the chosen families calls the backend's op wrapper
on CPU tensors, and every kernel launch it makes is compiled, not launched, once per
autotune config (``JITFunction.run(..., warmup=True)``). The wrappers take their GPU
branches (compiled Triton, not the interpreter), with ``torch.cuda``'s device queries
answered as an H200 / B200 would (132 / 148 SMs, capability 9.0 / 10.0). The bundled
``ptxas -v`` reads registers and spill bytes off each variant's PTX, Triton's metadata
its (dynamic) shared memory; the PTX names the MMA kind (``wgmma``, ``tcgen05``,
``mma.sync``, or none: FMA) and its first MMA opcode (shape and operand types: e4m3 or
bf16 inputs).

Rows (one per variant and architecture): kernel, the case that produced it, its
autotune config's index (0: the default, listed first; None: not autotuned;
``duplicate_of``: an earlier config of the same launch that compiled to the same binary), its
constexpr meta-parameters and warps / stages, registers, spill stores / loads (bytes),
shared memory (bytes), MMA kind, compile seconds. A compile error is a row with
``error`` and makes the exit status 1.

Run: ``python bench/cuda_compile.py`` (the ``tiny`` and ``glm5`` case families, both
architectures; writes ``bench/results/cuda_compile.json``); ``--families tiny
--arch 90 --ops rms_norm,rope`` or ``--cases sparse_attention-glm5_absorbed-bfloat16``
narrows it (CI). Compile times are of this machine's
CPU, from an empty Triton cache (a temporary one, removed at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its helpers

from common import environment, markdown_table, table

ARCHS = {90: "sm_90a", 100: "sm_100a"}
# What the wrappers' host heuristics ask of the device, per architecture.
DEVICES = {90: ("NVIDIA H200", 132), 100: ("NVIDIA B200", 148)}
FAMILIES = ("tiny", "glm5")


class _Props:
    def __init__(self, arch: int) -> None:
        self.name, self.multi_processor_count = DEVICES[arch]
        self.major, self.minor = divmod(arch, 10)


@contextmanager
def gpu_target(arch: int) -> Iterator[None]:
    """Triton's active driver and torch.cuda's device queries answer as ``sm_<arch>``."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class StandIn:
        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self) -> int:
            return arch  # Triton caches compiled kernels per device: one per target

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

        def get_device_interface(self):
            return torch.cuda

    saved = (
        torch.cuda.get_device_properties,
        torch.cuda.get_device_capability,
        torch.cuda.current_device,
    )
    # The stand-in stays Triton's driver after the block: on a machine without a GPU
    # Triton has no other to go back to (this is a script's process, not a library's).
    driver.set_active(StandIn())
    torch.cuda.get_device_properties = lambda device=None: _Props(arch)
    torch.cuda.get_device_capability = lambda device=None: divmod(arch, 10)
    torch.cuda.current_device = lambda: arch
    try:
        yield
    finally:
        (
            torch.cuda.get_device_properties,
            torch.cuda.get_device_capability,
            torch.cuda.current_device,
        ) = saved


@contextmanager
def compile_only(compiled: list) -> Iterator[None]:
    """Every kernel launch compiles instead (each autotune config in turn), appending
    ``(kernel name, launch keywords, autotune config index or None, compiled kernel or
    exception, seconds)``; config 0 is the default, the one listed first."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    run, tune = JITFunction.run, Autotuner.run
    config_index: list[int | None] = [None]

    def compile_launch(self, *args, grid, warmup, **kwargs):
        t0 = time.perf_counter()
        try:
            kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as e:  # a compile error is a row, not the end of the run
            kernel = e
        seconds = time.perf_counter() - t0
        compiled.append((self.fn.__name__, kwargs, config_index[0], kernel, seconds))
        return kernel

    def every_config(self, *args, **kwargs):
        for index, config in enumerate(self.configs):
            config_index[0] = index
            try:
                self.fn.run(*args, **{**kwargs, **config.all_kwargs()})
            finally:
                config_index[0] = None

    JITFunction.run, Autotuner.run = compile_launch, every_config
    try:
        yield
    finally:
        JITFunction.run, Autotuner.run = run, tune


def ptxas_usage(ptx: str, arch: int) -> dict:
    """Registers and spill stores / loads (bytes) that ``ptxas -v`` reports for the PTX
    on ``sm_<arch>a``."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        proc = subprocess.run(
            [get_ptxas(arch).path, "-v", f"--gpu-name={ARCHS[arch]}", str(src), "-o",
             str(Path(tmp) / "kernel.cubin")],
            capture_output=True, text=True,
        )  # fmt: skip
    text = proc.stdout + proc.stderr
    if proc.returncode:
        raise RuntimeError(f"ptxas -v failed on {ARCHS[arch]}: {text.strip()[-400:]}")

    def number(pattern: str) -> int:
        found = re.search(pattern, text)
        return int(found.group(1)) if found else 0

    return {
        "registers": number(r"Used (\d+) registers"),
        "spill_stores": number(r"(\d+) bytes spill stores"),
        "spill_loads": number(r"(\d+) bytes spill loads"),
    }


def traps_unconditionally(ptx: str) -> bool:
    """Whether the kernel can only trap: no ``ret`` anywhere. Triton lowers a kernel
    whose resources cannot be allocated (tensor memory past its 512 columns on sm_100)
    to a bare ``trap;`` without an error, which ptxas accepts at 4 registers."""
    return re.search(r"\bret;", ptx) is None


def mma_kind(ptx: str) -> str:
    """The tensor-core instruction the kernel's dots lower to, or ``fma`` (none)."""
    for kind, needle in (("tcgen05", "tcgen05.mma"), ("wgmma", "wgmma.mma_async"),
                         ("mma.sync", "mma.sync")):  # fmt: skip
        if needle in ptx:
            return kind
    return "fma"


def mma_instruction(ptx: str) -> str | None:
    """The first tensor-core opcode in the PTX, its shape and operand types spelled
    out (``mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32``), or None."""
    found = re.search(r"\b(?:tcgen05\.mma|wgmma\.mma_async|mma\.sync)[\w.:]*", ptx)
    return found.group(0) if found else None


def _meta(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if isinstance(v, (bool, int, str)) and k.isupper()}


def compile_cases(
    arch: int,
    families: tuple[str, ...],
    ops: tuple[str, ...] | None,
    cases: tuple[str, ...] | None = None,
) -> list:
    """One row per compiled variant of the cases of ``families`` (and ``ops``; and of
    those, only the case ids ``cases`` when given)."""
    from glmport.backends.cuda import BACKEND
    from glmport.conformance.cases import all_cases

    rows, seen = [], {}
    with gpu_target(arch):
        kernels = BACKEND.load_kernels(False)
        for case in all_cases(ops=ops):
            if case.family not in families or case.layout or (cases and case.id not in cases):
                continue
            compiled: list = []
            with compile_only(compiled):
                try:
                    kernels[case.op](*case.args())
                except Exception as e:  # the wrapper itself failed: say which case
                    rows.append({"arch": ARCHS[arch], "case": case.id, "kernel": "-",
                                 "error": f"{type(e).__name__}: {e}"})  # fmt: skip
            for name, kwargs, config, kernel, seconds in compiled:
                row = {
                    "arch": ARCHS[arch],
                    "case": case.id,
                    "op": case.op,
                    "kernel": name,
                    "config": config,
                    "meta": _meta(kwargs),
                    "num_warps": kwargs.get("num_warps", 4),
                    "num_stages": kwargs.get("num_stages", 3),
                    "compile_s": round(seconds, 2),
                }
                if isinstance(kernel, Exception):
                    row["error"] = f"{type(kernel).__name__}: {str(kernel)[:500]}"
                else:
                    key = (name, kernel.hash)
                    if key in seen:
                        first_case, first_config = seen[key]
                        if first_case != case.id:  # the same binary from another case
                            continue
                        row["duplicate_of"] = first_config  # two configs, one binary
                    seen.setdefault(key, (case.id, config))
                    ptx = kernel.asm["ptx"]
                    if traps_unconditionally(ptx):
                        row["error"] = (
                            "compiled to an unconditional trap (no ret): a resource it "
                            "needs (tensor or shared memory) cannot be allocated"
                        )
                    else:
                        try:
                            # Triton's shared memory is dynamic: its own count, not ptxas's.
                            row.update(
                                ptxas_usage(ptx, arch),
                                shared_bytes=kernel.metadata.shared,
                                mma=mma_kind(ptx),
                                mma_op=mma_instruction(ptx),
                            )
                        except RuntimeError as e:
                            row["error"] = str(e)
                rows.append(row)
                print(_line(row), file=sys.stderr, flush=True)
    return rows


def _line(row: dict) -> str:
    if "error" in row:
        return f"{row['arch']} {row['case']} {row['kernel']}: ERROR {row['error'][:200]}"
    return (
        f"{row['arch']} {row['kernel']} ({row['case']}, {row['num_warps']} warps): "
        f"{row['registers']} regs, spills {row['spill_stores']}/{row['spill_loads']} B, "
        f"smem {row['shared_bytes']} B, {row['mma']}, {row['compile_s']} s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help="case families")
    parser.add_argument("--ops", default=None, help="only these ops (comma-separated)")
    parser.add_argument("--cases", default=None, help="only these case ids (comma-separated)")
    parser.add_argument("--arch", default="90,100", help="compute capabilities: 90, 100")
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "cuda_compile.json")
    )
    args = parser.parse_args(argv)
    # Compiled, never interpreted: Triton fixes the mode at its first import (below).
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.pop("GLMPORT_EMULATE", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said aloud
    archs = tuple(int(a) for a in args.arch.split(","))
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        parser.error(f"--arch: unknown {unknown}; known: {', '.join(map(str, ARCHS))}")
    families = tuple(args.families.split(","))
    ops = tuple(args.ops.split(",")) if args.ops else None
    cases = tuple(args.cases.split(",")) if args.cases else None

    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # compile times from an empty cache
        t0 = time.perf_counter()
        rows = [r for arch in archs for r in compile_cases(arch, families, ops, cases)]
        wall = time.perf_counter() - t0
    errors = [r for r in rows if "error" in r]
    ok = [r for r in rows if "error" not in r]
    header = ("arch", "case", "kernel", "config", "warps", "regs", "spill B", "smem B", "mma",
              "compile s")  # fmt: skip
    body = [
        (r["arch"], r["case"], r["kernel"], "-" if r["config"] is None else r["config"],
         r["num_warps"], r["registers"], r["spill_stores"], r["shared_bytes"], r["mma"],
         r["compile_s"])
        for r in ok
    ]  # fmt: skip
    print(table([header, *body]))
    print(f"\n{len(ok)} variants compiled, {len(errors)} errors, {wall:.0f} s")
    result = {
        "environment": environment(),
        "families": families,
        "ops": ops,
        "cases": cases,
        "archs": [ARCHS[a] for a in archs],
        "wall_s": round(wall, 1),
        "rows": rows,
        "markdown": markdown_table([header, *body]),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out}")
    for r in errors:
        print(_line(r), file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
