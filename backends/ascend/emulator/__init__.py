"""A CPU emulator of the torch_npu fused ops the ascend adapters call.

Each function reproduces its op's documented contract (cited in its docstring): the
argument names, keyword-only parameters and defaults, the vendor's layouts (BSND,
TND with cumulative sequence lengths, PA_BSND with a block table), its output tuple
and dtypes, and an :class:`NpuContractError` wherever the real op documents a
constraint. It is not glmport's reference under vendor names: it works in the
vendor's conventions, so under ``GLMPORT_EMULATE=1`` the adapters' conversions into
and out of them are what the conformance suite judges. This package stands in for
the ``torch_npu`` module: an adapter calls ``npu.npu_lightning_indexer(...)`` on
either. Arithmetic is float32 (the NPU's accumulation precision) on CPU tensors.
"""

from types import SimpleNamespace

from .attention import npu_sparse_flash_attention
from .build import EmulatedBuild, current_build, emulated_build
from .contract import NpuContractError
from .gemm import (
    npu_convert_weight_to_int4pack,
    npu_quant_matmul,
    npu_weight_quant_batchmatmul,
)
from .grouped_gemm import npu_grouped_matmul
from .indexer import npu_lightning_indexer
from .mc2 import hccl_comm_name, npu_moe_distribute_combine_v2, npu_moe_distribute_dispatch_v2
from .mla import npu_format_cast, npu_mla_prolog_v3
from .moe import npu_moe_gating_top_k, npu_moe_init_routing_v2, npu_moe_token_unpermute
from .norm_rope import npu_rms_norm, npu_rotary_mul

__all__ = [
    "EmulatedBuild",
    "NpuContractError",
    "current_build",
    "emulated_build",
    "hccl_comm_name",
    "npu",
    "npu_convert_weight_to_int4pack",
    "npu_format_cast",
    "npu_grouped_matmul",
    "npu_lightning_indexer",
    "npu_mla_prolog_v3",
    "npu_moe_distribute_combine_v2",
    "npu_moe_distribute_dispatch_v2",
    "npu_moe_gating_top_k",
    "npu_moe_init_routing_v2",
    "npu_moe_token_unpermute",
    "npu_quant_matmul",
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_sparse_flash_attention",
    "npu_weight_quant_batchmatmul",
]
# The torch_npu ops the adapters call (the probe checks a real torch_npu has each).
OPS = tuple(name for name in __all__ if name.startswith("npu_"))

# torch_npu.npu's device queries the adapters read.
npu = SimpleNamespace(get_device_name=lambda: current_build().soc_name)


def __getattr__(name: str) -> str:
    """``__version__``: the emulated build's torch_npu version, like ``torch_npu``'s."""
    if name == "__version__":
        return current_build().version
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
