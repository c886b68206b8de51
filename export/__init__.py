"""glmport.export: GLM-5 and every glmport op to ONNX (onnxruntime) and TVM (Relax).

- :mod:`.graph`: the model's forward as one static graph (prefill, decode step) for
  ``torch.export``; :mod:`.check` compares an export with the eager model.
- :mod:`.onnx_ops`: each op as an ``ai.glmport`` node with an ONNX function body;
  :mod:`.onnx_model`: the model to ONNX and onnxruntime sessions of it.
- :mod:`.tvm_ops`: each op lowered to Relax; :mod:`.tvm_model`: the model to a
  compiled Relax VM module (from torch.export or from the ONNX export).
- :mod:`.ort_backend`, :mod:`.tvm_backend`: onnxruntime and TVM as glmport backends, so
  the conformance suite judges them (each op exported alone and run in the runtime).

Everything but :mod:`.graph` and :mod:`.check` needs the ``export`` extra (onnx,
onnxruntime, onnxscript, apache-tvm); nothing here is imported by ``import glmport``.
"""

import importlib.util

# The ``export`` extra: import name -> distribution name.
EXTRA = {"onnx": "onnx", "onnxruntime": "onnxruntime", "onnxscript": "onnxscript",
         "tvm": "apache-tvm"}  # fmt: skip
INSTALL = "pip install 'glmport[export]'"


def missing(*modules: str) -> str:
    """``"<distribution> is not installed"`` for the first of ``modules`` (keys of
    :data:`EXTRA`) that is not, found without importing it; "" when all are."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            return f"{EXTRA[module]} is not installed"
    return ""
