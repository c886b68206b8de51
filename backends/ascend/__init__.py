"""The ascend backend: adapters from glmport's ops onto torch_npu's fused ops for
Huawei Ascend NPUs (Atlas A2 / A3), and a CPU emulator of those ops' contracts.

Each adapter (one module per op family: ``indexer``, ``attention``, ``moe``, ``gemm``,
``norm_rope``, ``mla``; ``ep`` for expert parallelism over the MC2 pair) converts glmport's
packed layouts and conventions into the vendor op's own (TND / BSND / PA_BSND layouts
with cumulative sequence lengths, softmax max / sum instead of a log-sum-exp, int4
packed eight to an int32) and back.
It takes the torch_npu namespace as its first argument: the real ``torch_npu`` on an
NPU, or, with ``GLMPORT_EMULATE=1``, :mod:`.emulator`, CPU implementations of the same
documented contracts — so the conversions the adapters make are what the conformance
suite judges on a laptop.

torch_npu is imported only here, lazily, in :meth:`AscendBackend.probe`: a torch_npu
without CANN breaks ``import torch``, so it is never a test dependency.

Backward passes are the generic backend's (closed forms or the vector-Jacobian
product of its composites); the GEMMs use glmport's straight-through closed form.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Mapping
from types import ModuleType

import torch

from glmport.core.extras import pip_command
from glmport.core.registry import Availability, Backend, BackendManifest, Capability, Kernel

from .chips import SUPPORTED, chip_generation

_HALF = (torch.bfloat16, torch.float16)
EMULATED = "CPU emulator of the torch_npu op contracts (Atlas A2 / A3 limits)"


def torch_npu_namespace(emulate: bool) -> ModuleType:
    """What the adapters call ``npu.npu_*`` on: the emulator, or the real torch_npu."""
    if emulate:
        from . import emulator

        return emulator
    return importlib.import_module("torch_npu")


def npu_device() -> torch.device:
    """The NPU the start-up check runs on (the current one)."""
    return torch.device("npu")


class AscendBackend(Backend):
    manifest = BackendManifest(
        name="ascend",
        device_type="npu",
        description="adapters onto torch_npu fused ops for Huawei Ascend NPUs (Atlas A2 / A3)",
        ops=(
            "lightning_indexer",
            "indexer_logits",
            "sparse_attention",
            "moe_gate",
            "moe_dispatch",
            "moe_combine",
            "grouped_gemm",
            "quant_gemm",
            "rms_norm",
            "rope",
            "mla_prolog",
            "expert_parallel",
        ),
        # The torch_npu ops' documented limits on Atlas A2 / A3 (sources in each
        # adapter's docstring and docs/ascend.md); calls beyond them run on the generic
        # backend on the same device, logged once per op.
        capabilities={
            # Paged keys (PA_BSND): pages of a multiple of 16 up to 1024 slots.
            "lightning_indexer": Capability(
                dtype=_HALF,
                q_heads=range(1, 65),
                head_dim=128,
                topk=range(1, 8193),
                block_size=range(16, 1025, 16),
            ),
            # indexer_logits reads every key of a range back as a selected value, so a
            # range must fit the largest sparse_count.
            "indexer_logits": Capability(
                dtype=_HALF, q_heads=range(1, 65), head_dim=128, keys=range(0, 8193)
            ),
            # MLA-absorb only: one latent kv head, D 512 + 64 rope, value = key[..., :512].
            "sparse_attention": Capability(
                dtype=_HALF,
                q_heads=(1, 2, 4, 8, 16, 32, 64, 128),
                kv_heads=1,
                head_dim=576,
                v_head_dim=512,
            ),
            "moe_gate": Capability(dtype=torch.float32, experts=range(3, 2049)),
            "moe_dispatch": Capability(experts=range(1, 10240)),
            # W4A8 (no int8 x int4 row on A2 / A3) and FP8-block (no float8 matmul
            # before Ascend 950) run on generic.
            "quant_gemm": Capability(
                dtype=_HALF, scheme=("w8a8", "w4a16"), in_features=range(1, 65536)
            ),
            "grouped_gemm": Capability(
                scheme=("none", "w8a8", "w4a16"),
                experts=range(1, 1025),
                in_features=range(1, 65536),
            ),
            "rope": Capability(rope_dim=range(2, 896, 2)),
            # npu_mla_prolog_v3's page: DeepSeek-V3.2's widths only (GLM-5's hidden 6144,
            # q_lora 2048 and nope 192 run on generic).
            "mla_prolog": Capability(
                dtype=torch.bfloat16,
                hidden=(7168, 7680),
                q_lora=1536,
                q_heads=(1, 2, 4, 8, 16, 32, 64, 128),
                head_dim=128,
                kv_lora=512,
                rope_dim=64,
            ),
        },
        priority=30,
        emulation=EMULATED,
        verified="CPU emulator of the torch_npu op contracts only; not verified on Ascend hardware",
        stack=("torch-npu", "$ASCEND_TOOLKIT_HOME"),
    )

    def probe(self, emulate: bool) -> Availability:
        if emulate:
            return Availability(True, EMULATED, emulated=True)
        if importlib.util.find_spec("torch_npu") is None:
            install = pip_command(["ascend"], ["torch-npu"])
            return Availability(
                False,
                f"torch-npu not installed: {install} on a machine with CANN "
                "(GLMPORT_EMULATE=1 runs the adapters against the CPU emulator)",
            )
        try:
            torch_npu = importlib.import_module("torch_npu")
        except Exception as err:
            return Availability(
                False,
                f"torch_npu failed to import ({type(err).__name__}: {err}); is CANN's "
                "set_env.sh sourced (ASCEND_TOOLKIT_HOME)?",
            )
        if not torch.npu.is_available():
            return Availability(False, "torch_npu found no NPU (ASCEND_RT_VISIBLE_DEVICES?)")
        soc = torch.npu.get_device_name()
        generation = chip_generation(soc)
        if generation not in SUPPORTED:
            return Availability(
                False,
                f"{soc} (generation {generation or 'unknown'}): the adapters target the "
                f"torch_npu DSA ops' documented generations {', '.join(SUPPORTED)}",
            )
        from . import emulator

        lacking = [name for name in emulator.OPS if not hasattr(torch_npu, name)]
        if lacking:
            return Availability(
                False,
                f"torch_npu {torch_npu.__version__} lacks {', '.join(lacking)}: upgrade "
                "torch_npu and CANN",
            )
        from .profile import detect_profile

        try:  # the start-up checks: a tiny indexer call (and MLA prolog call) on the NPU
            profile = detect_profile(torch_npu, npu_device())
        except Exception as err:
            return Availability(
                False,
                f"torch_npu {torch_npu.__version__} on {soc}: the start-up check failed "
                f"({type(err).__name__}: {err})",
            )
        return Availability(
            True,
            f"torch_npu {torch_npu.__version__} on {soc} (Atlas {generation}); "
            f"{profile.describe()}",
        )

    def load_kernels(self, emulate: bool) -> Mapping[str, Kernel]:
        from . import attention, ep, gemm, indexer, mla, moe, norm_rope
        from .profile import detect_profile

        npu = torch_npu_namespace(emulate)
        # The build's conventions, measured once per load (a tiny indexer call).
        profile = detect_profile(npu, torch.device("cpu") if emulate else npu_device())
        adapters = {
            "lightning_indexer": functools.partial(indexer.lightning_indexer, profile=profile),
            "indexer_logits": functools.partial(indexer.indexer_logits, profile=profile),
            "sparse_attention": attention.sparse_attention,
            "moe_gate": moe.moe_gate,
            "moe_dispatch": moe.moe_dispatch,
            "moe_combine": moe.moe_combine,
            "grouped_gemm": gemm.grouped_gemm,
            "grouped_gemm:prepared": gemm.grouped_gemm_prepared,
            "quant_gemm": gemm.quant_gemm,
            "quant_gemm:prepared": gemm.quant_gemm_prepared,
            "rms_norm": norm_rope.rms_norm,
            "rope": norm_rope.rope,
            "mla_prolog": functools.partial(mla.mla_prolog, profile=profile),
        }
        kernels = {name: functools.partial(adapter, npu) for name, adapter in adapters.items()}
        comm_name = npu.hccl_comm_name if emulate else ep.hccl_comm_name
        kernels["expert_parallel"] = functools.partial(
            ep.MC2ExpertParallel, npu=npu, comm_name=comm_name
        )
        return kernels

    def prepare_weight(self, op, w, w_scale, scheme, emulate):
        from .gemm import prepare_weight

        return prepare_weight(torch_npu_namespace(emulate), op, w, w_scale, scheme)


BACKEND = AscendBackend()
