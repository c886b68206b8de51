"""What the TVM export prints: none of the TVM / torch noise glmport knows to be
expected (TVM's native log lines, torch's LeafSpec deprecation), while any other
warning, native or Python, still reaches the user; glmport's own Relax ``take``\\ s never
use the "fast" mode those lines warn about."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import tvm
from tvm import relax

from glmport.export.native_log import dropped_native_lines
from glmport.export.tvm_model import TvmModel
from glmport.export.tvm_ops import op_module
from glmport.export.tvm_runtime import (
    FAST_TAKE,
    SCOPE_SAVING,
    UNKNOWN_PRAGMA,
    compile_relax,
)
from glmport.model import GlmMoeDsaForCausalLM

LEAF_SPEC = "isinstance(treespec, LeafSpec)"


def _fast_take_module() -> tvm.IRModule:
    """``main(x [n, 4] float32, i [k] int64) = take(x, i, axis=0)`` in TVM's default mode."""
    bb = relax.BlockBuilder()
    n, k = tvm.tirx.Var("n", "int64"), tvm.tirx.Var("k", "int64")
    x = relax.Var("x", relax.TensorType([n, 4], "float32"))
    i = relax.Var("i", relax.TensorType([k], "int64"))
    with bb.function("main", [x, i]):
        bb.emit_func_output(bb.emit(relax.op.take(x, i, axis=0)))
    return bb.get()


def test_tvms_fast_take_line_is_dropped_by_compile_relax_only(capfd):
    relax.transform.LegalizeOps()(_fast_take_module())
    assert FAST_TAKE in capfd.readouterr().err  # the message TVM prints, as matched
    executable = compile_relax(_fast_take_module())
    assert FAST_TAKE not in capfd.readouterr().err
    main = relax.VirtualMachine(executable, tvm.cpu())["main"]
    x = torch.arange(12.0).reshape(3, 4)
    got = main(tvm.runtime.from_dlpack(x), tvm.runtime.from_dlpack(torch.tensor([2, 0])))
    assert torch.equal(torch.from_dlpack(got), x[[2, 0]])


@pytest.mark.parametrize("op", ["sparse_attention", "moe_dispatch", "moe_combine"])
def test_glmports_own_takes_are_not_in_fast_mode(op, capfd):
    t, n, k = 3, 5, 2
    args = {
        "sparse_attention": (
            torch.randn(t, 2, 8),
            torch.randn(n, 1, 8),
            torch.randn(n, 1, 8),
            torch.zeros(t, k, dtype=torch.int32),
            0.5,
            True,
            None,
        ),
        "moe_dispatch": (torch.randn(t, 8), torch.zeros(t, k, dtype=torch.int32), 4),
        "moe_combine": (
            torch.randn(t * k, 8),
            torch.zeros(t * k, dtype=torch.int32),
            torch.rand(t, k),
        ),
    }[op]
    relax.transform.LegalizeOps()(op_module(op, args))
    assert FAST_TAKE not in capfd.readouterr().err


def test_unknown_lines_and_warnings_still_reach_the_user(capfd):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="inside"), dropped_native_lines(FAST_TAKE):
            os.write(2, f"[0] transform.h:1261: Warning: {FAST_TAKE}. In bound\n".encode())
            os.write(2, b"[0] other.cc:7: Warning: something new\n")
            warnings.warn("an unexpected warning", UserWarning, stacklevel=1)
            raise RuntimeError("raised inside")
    os.write(2, b"after the block\n")
    err = capfd.readouterr().err
    assert FAST_TAKE not in err
    assert "[0] other.cc:7: Warning: something new\n" in err
    assert err.endswith("after the block\n")  # stderr is back where it was
    assert [(w.category, str(w.message)) for w in seen] == [(UserWarning, "an unexpected warning")]


def test_tvm_export_prints_none_of_the_known_noise(tmp_path, capfd):
    model = GlmMoeDsaForCausalLM.from_config("tiny", seed=0).eval()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        TvmModel.build(model, "prefill").save(tmp_path / "tvm")
    err = capfd.readouterr().err
    noise = {m: err.count(m) for m in (FAST_TAKE, UNKNOWN_PRAGMA, SCOPE_SAVING, LEAF_SPEC)}
    assert noise == dict.fromkeys(noise, 0), err
    assert not [w for w in seen if LEAF_SPEC in str(w.message)]
    assert (tmp_path / "tvm" / "model.so").is_file()
