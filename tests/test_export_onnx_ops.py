"""Every glmport op as an ``ai.glmport`` ONNX node with its function body, and
onnxruntime as a conformance target.

One-node models of every signature family the suite calls pass the ONNX checker and
strict shape inference; a selection of the shared value cases (every dtype, -1
padding, fewer keys than topk, empty rows, ties, fp8, packed weights) runs through
onnxruntime and is judged against the float64 cpu reference; a module calling glmport
ops exports through ``torch.onnx.export`` and runs in onnxruntime like in torch.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import onnx
import onnxruntime as ort
import pytest
import torch

import glmport
from glmport.conformance.runner import run_check, suite_checks
from glmport.core.errors import UnsupportedError
from glmport.core.specs import OP_NAMES
from glmport.export import onnx_ops
from glmport.export.ort_backend import BACKEND

VALUE_CHECKS = [c for c in suite_checks() if c.kind == "value"]


def _family(check) -> tuple:
    """A value case's signature family: what one exported model serves."""
    sig = []
    for a in check.case.args():
        sig.append((a.dtype, a.dim()) if isinstance(a, torch.Tensor) else a)
    return (check.op, *[s if not isinstance(s, float) else "float" for s in sig])


FAMILIES = list({_family(c): c for c in VALUE_CHECKS}.values())

# Edge cases by name (padding, N < topk, empty rows, ties...) in every dtype, plus the
# tiny case of every op / dtype / scheme; the large glm5 shapes run in the CLI suite.
EDGES = {
    "n_lt_topk",
    "all_minus_one",
    "empty_range",
    "ties",
    "group_ties",
    "group_ties_nobias",
    "ragged",
    "empty_experts",
    "ragged_groups",
    "qat",
    "t1",
}
# (The layout family runs on onnxruntime in tests/test_layouts.py.)
SELECTED = [
    c
    for c in VALUE_CHECKS
    if c.case.family != "layout" and (c.case.name in EDGES or c.case.name.startswith("tiny"))
]


def test_the_selection_covers_every_op():
    assert {c.op for c in SELECTED} == set(OP_NAMES)
    assert {c.op for c in FAMILIES} == set(OP_NAMES)


@pytest.mark.parametrize("check", FAMILIES, ids=[c.id for c in FAMILIES])
def test_one_node_model_checks_and_infers(check):
    model = onnx_ops.op_model(check.op, check.case.args())
    (node,) = model.graph.node
    assert (node.domain, node.op_type) == (onnx_ops.DOMAIN, check.op)
    assert {(f.domain, f.name, f.overload) for f in model.functions} == {
        (onnx_ops.DOMAIN, check.op, node.overload)
    }
    onnx.checker.check_model(model, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    for out in inferred.graph.output:
        assert out.type.tensor_type.elem_type != 0, out.name
    # The body uses standard ops only, at the model's opset.
    (fn,) = model.functions
    assert {n.domain for n in fn.node} == {""}
    assert [(o.domain, o.version) for o in fn.opset_import] == [("", onnx_ops.OPSET)]


def test_attributes_and_defaults_follow_the_torch_schema():
    for op in OP_NAMES:
        schema = getattr(torch.ops.glmport, op).default._schema
        scalars = {a.name: a for a in schema.arguments if "Tensor" not in str(a.type)}
        attrs = {a.name: a for a in onnx_ops.op_schema(op).attributes.values()}
        assert set(attrs) == set(scalars), op
        for name, arg in scalars.items():
            if arg.has_default_value():
                got = onnx.helper.get_attribute_value(attrs[name].default_value)
                got = got.decode() if isinstance(got, bytes) else got
                want = arg.default_value
                if isinstance(want, float):  # ONNX float attributes are float32
                    want = pytest.approx(want, rel=1e-7)
                assert got == want, (op, name)
            else:
                assert attrs[name].required, (op, name)


@pytest.mark.parametrize("check", SELECTED, ids=[c.id for c in SELECTED])
def test_onnxruntime_conforms_on_value_cases(check):
    rec = run_check(check, "onnxruntime")
    assert rec.ran_on == "onnxruntime" and rec.own, rec.ran_on
    assert rec.outcome == "pass", f"{rec.outcome}: {rec.reason}"


def test_a_call_the_runtime_cannot_take_is_unsupported_with_the_reason():
    kernel = BACKEND.load_kernels(False)["rms_norm"]
    x = torch.empty(4, 8, device="meta")
    with pytest.raises(UnsupportedError, match=r"rms_norm: onnxruntime runs CPU tensors; 'x'"):
        kernel(x, torch.ones(8), 1e-6)


def test_one_session_serves_every_size():
    from glmport.export import ort_backend

    sessions = ort_backend._Sessions()
    small = (torch.randn(3, 8), torch.ones(8), 1e-6)
    large = (torch.randn(40, 64), torch.ones(64), 1e-6)
    assert sessions.get("rms_norm", small) is sessions.get("rms_norm", large)
    other = (torch.randn(3, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16), 1e-6)
    assert sessions.get("rms_norm", other) is not sessions.get("rms_norm", small)


def test_importing_glmport_and_listing_backends_imports_no_onnx():
    code = textwrap.dedent(
        """
        import sys
        import glmport
        from glmport.core.registry import REGISTRY, backend_names, get_backend
        for name in backend_names():
            get_backend(name).manifest
        get_backend("onnxruntime").probe(False)
        REGISTRY.availability("onnxruntime", False)
        print(sorted(m for m in sys.modules if m.split(".")[0] in
                     ("onnx", "onnxruntime", "onnxscript", "tvm")))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


class _TwoOps(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.norm = torch.nn.Parameter(torch.rand(16, generator=gen) + 0.5)
        self.router = torch.nn.Parameter(torch.randn(16, 8, generator=gen))

    def forward(self, x):
        h = glmport.ops.rms_norm(x, self.norm, 1e-5)
        # bias=None (an absent optional input), string / bool / defaulted attributes.
        weights, ids = glmport.ops.moe_gate(
            h @ self.router, None, 2, n_group=2, topk_group=1, score_func="softmax"
        )
        return h * 2, weights, ids


def test_a_module_exports_with_glmport_nodes_and_runs_in_onnxruntime():
    module = _TwoOps().eval()
    x = torch.randn(5, 16)
    program = torch.onnx.export(
        module,
        (x,),
        dynamo=True,
        custom_translation_table=onnx_ops.translation_table(),
        dynamic_shapes=({0: torch.export.Dim("T")},),
        opset_version=onnx_ops.OPSET,
        optimize=False,
        verbose=False,
    )
    model = onnx_ops.attach_functions(program.model_proto)
    custom = [n.op_type for n in model.graph.node if n.domain == onnx_ops.DOMAIN]
    assert custom == ["rms_norm", "moe_gate"]
    onnx.checker.check_model(model, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    assert all(o.type.tensor_type.elem_type for o in inferred.graph.output)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for rows in (1, 7):
        x = torch.randn(rows, 16)
        got = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        with glmport.use_backend("cpu"), torch.no_grad():
            want = module(x)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.numpy().dtype
            assert torch.allclose(torch.from_numpy(g), w, rtol=0, atol=1e-5)
