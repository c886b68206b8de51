"""glmport.export: GLM-5 and every glmport op to ONNX (onnxruntime) and TVM (Relax).

- :mod:`.graph`: the model's forward as one static graph (prefill, decode step) for
  ``torch.export``; :mod:`.check` compares an export with the eager model.
- :mod:`.onnx_ops`: each op as an ``ai.glmport`` node with an ONNX function body
  (:mod:`.onnx_bodies`, built with :mod:`.onnx_body`); :mod:`.onnx_model`: the model to
  ONNX and onnxruntime sessions of it; :mod:`.ort_runtime`: tensors in and out of
  onnxruntime.
- :mod:`.tvm_ops`: each op lowered to Relax (:mod:`.tvm_emitters`, built on
  :mod:`.tvm_graph`); :mod:`.tvm_model`: the model to a compiled Relax VM module (from
  torch.export or from the ONNX export); :mod:`.tvm_runtime`: compiling, saving, and
  tensors in and out of the VM, with TVM's expected native log lines dropped
  (:mod:`.native_log`).
- :mod:`.ort_backend`, :mod:`.tvm_backend`: onnxruntime and TVM as glmport backends, so
  the conformance suite judges them (each op exported alone and run in the runtime);
  :mod:`.empty_sources`: the calls they answer from the shapes (no key, no expert).

Everything but :mod:`.graph`, :mod:`.check`, :mod:`.empty_sources` and
:mod:`.native_log` needs the ``export`` extra (onnx, onnxruntime, onnxscript,
apache-tvm); nothing here is imported by ``import glmport``.
"""
