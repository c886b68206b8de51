"""glmport: a GLM-5-class model and its RL post-training, portable across accelerators.

Model and RL code call one backend-neutral op interface (:mod:`glmport.ops`); vendors
plug in implementations (backends); a shared conformance suite decides whether a
backend is right. Select a backend with ``GLMPORT_BACKEND`` or :func:`use_backend`.

Importing glmport imports torch and registers ``torch.ops.glmport.*``; it never
imports triton, torch_npu, onnx or tvm, and probes no device.
"""

from glmport import ops
from glmport.core import (
    Availability,
    Backend,
    BackendManifest,
    BackendUnavailableError,
    Capability,
    ConfigError,
    ExpertParallel,
    GlmportError,
    KernelSignatureError,
    OpInputError,
    PreparedWeight,
    UnknownBackendError,
    UnsupportedError,
    backend_names,
    expert_parallel,
    get_backend,
    prepare_weight,
    register_backend,
    unregister_backend,
    use_backend,
)

__version__ = "0.1.0"

__all__ = [
    "Availability",
    "Backend",
    "BackendManifest",
    "BackendUnavailableError",
    "Capability",
    "ConfigError",
    "ExpertParallel",
    "GlmportError",
    "KernelSignatureError",
    "OpInputError",
    "PreparedWeight",
    "UnknownBackendError",
    "UnsupportedError",
    "__version__",
    "backend_names",
    "expert_parallel",
    "get_backend",
    "ops",
    "prepare_weight",
    "register_backend",
    "unregister_backend",
    "use_backend",
]
