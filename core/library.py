"""Registers every op spec as a ``torch.library`` custom op ``torch.ops.glmport.<name>``:
one kernel for all devices (it dispatches to the selected glmport backend), a fake
kernel for torch.compile / torch.export, and autograd where the spec names
differentiable inputs."""

from __future__ import annotations

import functools

import torch

from . import dispatch
from .specs import SPECS, OpSpec
from .specs.base import set_eager_runner

NAMESPACE = "glmport"


def _define(spec: OpSpec) -> torch.library.CustomOpDef:
    def kernel(*args, **kwargs):
        return dispatch.run(spec.name, spec.complete(args, kwargs))

    kernel.__name__ = spec.name
    op = torch.library.custom_op(
        f"{NAMESPACE}::{spec.name}", kernel, mutates_args=(), schema=spec.schema
    )
    op.register_fake(lambda *args, **kw: dispatch.fake(spec.name, spec.complete(args, kw)))
    if spec.differentiable:
        op.register_autograd(
            functools.partial(dispatch.backward, spec.name),
            setup_context=functools.partial(dispatch.setup_context, spec.name),
        )
    return op


CUSTOM_OPS: dict[str, torch.library.CustomOpDef] = {name: _define(s) for name, s in SPECS.items()}
set_eager_runner(dispatch.run)
