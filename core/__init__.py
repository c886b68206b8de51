"""glmport.core: the backend-neutral op interface.

Op specs and their shared validation (``specs``, ``validate``), the error hierarchy
(``errors``), the canonical quantised formats (``formats``), the backend contract and
registry (``registry``), selection (``selection``), expert parallelism
(``expert_parallel``), prepared weights (``prepared``), dispatch with shadow checks
(``dispatch``, ``shadow``), tolerances (``tolerance``) and the ``torch.library``
registration of every op (``library``). Imports no backend module: backends are
found through the registry when first used.
"""

from . import library
from .errors import (
    BackendUnavailableError,
    ConfigError,
    GlmportError,
    KernelSignatureError,
    OpInputError,
    UnknownBackendError,
    UnsupportedError,
)
from .expert_parallel import ExpertParallel, expert_parallel
from .prepared import PreparedWeight, prepare_weight
from .registry import (
    Availability,
    Backend,
    BackendManifest,
    Capability,
    backend_names,
    get_backend,
    register_backend,
    unregister_backend,
)
from .selection import current_settings, resolve, use_backend
from .specs import OP_NAMES, SPECS

__all__ = [
    "OP_NAMES",
    "SPECS",
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
    "backend_names",
    "current_settings",
    "expert_parallel",
    "get_backend",
    "library",
    "prepare_weight",
    "register_backend",
    "resolve",
    "unregister_backend",
    "use_backend",
]
