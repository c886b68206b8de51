"""core/trace.py: what an op trace records, and what it does not."""

from __future__ import annotations

import threading

import torch

import glmport
from glmport.core.trace import active_trace, trace_ops


def _norm_args():
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    return x, torch.ones(8), 1e-6


def test_records_each_call_with_its_backend_scope_and_copies():
    x, w, eps = _norm_args()
    with glmport.use_backend("cpu"), trace_ops() as trace:
        with trace.scope("layers.0.norm"):
            out = glmport.ops.rms_norm(x, w, eps)
        glmport.ops.rope(x[:, None, :4].contiguous(), torch.ones(3, 2), torch.zeros(3, 2), True)
    assert [(c.op, c.backend, c.scope) for c in trace.calls] == [
        ("rms_norm", "cpu", "layers.0.norm"),
        ("rope", "cpu", ""),
    ]
    call = trace.calls[0]
    assert call.args[2] == eps and torch.equal(call.args[0], x)
    want = x / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + eps).float()
    torch.testing.assert_close(call.outputs[0], want, rtol=1e-5, atol=1e-6)
    out.add_(1.0)  # the record is a copy: later changes to the live tensor do not reach it
    x.add_(1.0)
    torch.testing.assert_close(call.outputs[0], want, rtol=1e-5, atol=1e-6)
    assert not torch.equal(call.args[0], x)


def test_nothing_recorded_outside_a_trace_and_the_innermost_trace_records():
    x, w, eps = _norm_args()
    assert active_trace() is None
    with trace_ops() as outer:
        glmport.ops.rms_norm(x, w, eps)
        with trace_ops() as inner:
            glmport.ops.rms_norm(x, w, eps)
        assert active_trace() is outer
    assert active_trace() is None
    glmport.ops.rms_norm(x, w, eps)
    assert len(outer.calls) == 1 and len(inner.calls) == 1


def test_a_trace_sees_only_its_own_thread():
    x, w, eps = _norm_args()
    with trace_ops() as trace:
        worker = threading.Thread(target=glmport.ops.rms_norm, args=(x, w, eps))
        worker.start()
        worker.join()
    assert trace.calls == []
