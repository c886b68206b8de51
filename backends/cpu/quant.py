"""Reference quantisation: the canonical formats, and quantised GEMMs with exact
integer accumulation (int8 / int4) or float8 operands through torch's float8 dtypes."""

from __future__ import annotations

import torch

from glmport.core.formats import (
    SCHEMES,
    dequantize_weight,
    fake_quant_activation,
    quantize_tensor,
    unpack_int4,
)

from .precision import acc_dtype, out_dtype


def quantize(x, fmt, group_size=128):
    return quantize_tensor(x, fmt, group_size)


def quant_gemm(x, w, w_scale, scheme, group_size=128):
    s = SCHEMES[scheme]
    acc = acc_dtype()
    if x.shape[0] == 0:
        return x.new_empty((0, w.shape[0]), dtype=out_dtype(x.dtype))
    if w_scale is None or s.activation is None:
        # QAT fake-quant, or W4A16 (float activations): a float GEMM on the grid values.
        xf = fake_quant_activation(x, scheme) if w_scale is None else x.float()
        y = xf.to(acc) @ dequantize_weight(w, w_scale, scheme, group_size).to(acc).T
    elif s.activation.storage == torch.int8:
        y = _int_gemm(x, w, w_scale, scheme, acc)
    else:
        y = _fp8_gemm(x, w, w_scale, scheme, acc)
    return y.to(out_dtype(x.dtype))


def _int_gemm(x, w, w_scale, scheme, acc):
    """``sx[m] * sum_g sw[n, g] * (int32 sum over group g of qx * qw)``."""
    s = SCHEMES[scheme]
    qx, sx = quantize_tensor(x, "int8_row", x.shape[1])
    qw = unpack_int4(w) if s.weight.storage == torch.uint8 else w
    m, k = qx.shape
    n = qw.shape[0]
    sw = w_scale.reshape(n, -1)  # [N, G]: per-channel scales are one group of K
    groups = sw.shape[1]
    a = qx.to(torch.int32).view(m, groups, k // groups).transpose(0, 1)  # [G, M, g]
    b = qw.to(torch.int32).view(n, groups, k // groups).permute(1, 2, 0)  # [G, g, N]
    partial = torch.bmm(a, b)  # [G, M, N] int32, exact
    y = (partial.to(acc) * sw.T.to(acc)[:, None, :]).sum(dim=0)
    return y * sx.to(acc)[:, None]


def _fp8_gemm(x, w, w_scale, scheme, acc):
    """Per 128-wide K block: fp8 x fp8 products summed, then ``sx[m, kb] * sw[nb, kb]``."""
    s = SCHEMES[scheme]
    block = s.fixed_group_size
    qx, sx = quantize_tensor(x, s.activation.name, block)
    k = x.shape[1]
    sw = w_scale.to(acc).repeat_interleave(block, dim=0)[: w.shape[0]]  # [N, KB]
    y = torch.zeros(x.shape[0], w.shape[0], dtype=acc, device=x.device)
    for kb, start in enumerate(range(0, k, block)):
        xa = qx[:, start : start + block].to(acc)
        wb = w[:, start : start + block].to(acc)
        y += (xa @ wb.T) * sx[:, kb].to(acc)[:, None] * sw[:, kb][None, :]
    return y
