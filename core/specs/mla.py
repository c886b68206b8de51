"""The MLA prolog (MLAPO): everything multi-head latent attention computes from a
token before attending, in one op."""

from __future__ import annotations

import torch

from ..validate import FLOAT_DTYPES, Checker, Level
from .base import OpSpec, invoke
from .quant import CODE_MAX

# The three projections a W8A8 prolog takes packed, with their scales' names.
QUANTISED = (("w_dq", "w_dq_scale"), ("w_uq", "w_uq_scale"), ("w_dkv", "w_dkv_scale"))


def _check_prolog(
    c: Checker,
    x,
    w_dq,
    gamma_cq,
    w_uq,
    w_uk,
    w_dkv,
    gamma_ckv,
    cos,
    sin,
    eps,
    w_dq_scale,
    w_uq_scale,
    w_dkv_scale,
    *,
    values,
):
    c.tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    t, hidden = x.shape
    same = (x.dtype,)
    scales = {"w_dq_scale": w_dq_scale, "w_uq_scale": w_uq_scale, "w_dkv_scale": w_dkv_scale}
    given = [name for name, s in scales.items() if s is not None]
    if given and len(given) < len(scales):
        missing = next(name for name, s in scales.items() if s is None)
        c.fail(missing, "a float32 scale, as the other two (W8A8: all three or none)", "None")
    quantised = bool(given)
    # W8A8: the three projections are int8_row weights (glmport.core.formats).
    packed = (torch.int8,) if quantised else same
    c.tensor("w_uk", w_uk, ndim=3, dtypes=same)
    heads, nope, kv_lora = w_uk.shape
    c.tensor("cos", cos, ndim=2, dtypes=(torch.float32,))
    c.tensor("cos", cos, shape=(("T", t), None))
    rope = 2 * cos.shape[1]
    if rope == 0:
        c.fail("cos", "[T, rope / 2] with rope >= 2", f"shape {list(cos.shape)}")
    c.tensor("sin", sin, shape=(("T", t), ("rope / 2", rope // 2)), dtypes=(torch.float32,))
    c.tensor("w_dq", w_dq, ndim=2, dtypes=packed)
    c.tensor("w_dq", w_dq, shape=(None, ("hidden", hidden)))
    q_lora = w_dq.shape[0]
    c.tensor("gamma_cq", gamma_cq, shape=(("q_lora", q_lora),), dtypes=same)
    c.tensor(
        "w_uq",
        w_uq,
        shape=(("heads * (nope + rope)", heads * (nope + rope)), ("q_lora", q_lora)),
        dtypes=packed,
    )
    c.tensor(
        "w_dkv",
        w_dkv,
        shape=(("kv_lora + rope", kv_lora + rope), ("hidden", hidden)),
        dtypes=packed,
    )
    if quantised:
        for (w_name, s_name), w in zip(QUANTISED, (w_dq, w_uq, w_dkv), strict=True):
            rows = (f"{w_name} rows", w.shape[0])
            c.tensor(s_name, scales[s_name], shape=(rows,), dtypes=(torch.float32,))
    c.tensor("gamma_ckv", gamma_ckv, shape=(("kv_lora", kv_lora),), dtypes=same)
    c.positive_float("eps", eps)
    c.same_device(
        x=x,
        w_dq=w_dq,
        gamma_cq=gamma_cq,
        w_uq=w_uq,
        w_uk=w_uk,
        w_dkv=w_dkv,
        gamma_ckv=gamma_ckv,
        cos=cos,
        sin=sin,
        **scales,
    )
    # |w| of a packed weight: its largest code times its largest scale (a scan of the
    # scales only, as quant_gemm's check; their reads feed the bound below).
    w_max = {}
    if quantised and values:
        for w_name, s_name in QUANTISED:
            w_max[w_name] = c.finite_positive(s_name, scales[s_name]) * CODE_MAX[torch.int8]
    if values >= Level.STRICT:
        c.finite("cos", cos)  # a NaN or inf angle makes NaN outputs: loud, not silent
        c.finite("sin", sin)
        # Kernels sum a projected row's squares in float32 for its norm: bounded by
        # (max|x| * max|w| * hidden)^2 * width. A scan of the weights, so strict only
        # (as the GEMMs' weight bounds): at decode it would read them a second time.
        size = c.magnitude(x) * hidden
        for name, w, width in (("w_dq", w_dq, q_lora), ("w_dkv", w_dkv, kv_lora)):
            entry = size * (w_max[name] if quantised else c.magnitude(w))
            c.within_range("x", entry * entry * width, f"the sum of squares of x @ {name}.T")


def _fake(x, w_dq, gamma_cq, w_uq, w_uk, w_dkv, gamma_ckv, cos, sin, eps=1e-6, *scales):
    t = x.shape[0]
    heads, _, kv_lora = w_uk.shape
    rope = 2 * cos.shape[1]
    return (
        x.new_empty((t, heads, kv_lora)),
        x.new_empty((t, heads, rope)),
        x.new_empty((t, w_dq.shape[0])),
        x.new_empty((t, kv_lora)),
        x.new_empty((t, rope)),
    )


MLA_PROLOG = OpSpec(
    name="mla_prolog",
    schema=(
        "(Tensor x, Tensor w_dq, Tensor gamma_cq, Tensor w_uq, Tensor w_uk, Tensor w_dkv, "
        "Tensor gamma_ckv, Tensor cos, Tensor sin, float eps=1e-06, Tensor? w_dq_scale=None, "
        "Tensor? w_uq_scale=None, Tensor? w_dkv_scale=None) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
    check=_check_prolog,
    fake=_fake,
    features=lambda x, w_dq, gamma_cq, w_uq, w_uk, w_dkv, gamma_ckv, cos, *_: {
        "dtype": x.dtype,
        "hidden": x.shape[1],
        "q_lora": w_dq.shape[0],
        "q_heads": w_uk.shape[0],
        "head_dim": w_uk.shape[1],
        "kv_lora": w_uk.shape[2],
        "rope_dim": 2 * cos.shape[1],
        "scheme": "w8a8" if w_dq.dtype == torch.int8 else "none",
    },
    feature_names=(
        "dtype",
        "hidden",
        "q_lora",
        "q_heads",
        "head_dim",
        "kv_lora",
        "rope_dim",
        "scheme",
    ),
)


def mla_prolog(
    x: torch.Tensor,
    w_dq: torch.Tensor,
    gamma_cq: torch.Tensor,
    w_uq: torch.Tensor,
    w_uk: torch.Tensor,
    w_dkv: torch.Tensor,
    gamma_ckv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = 1e-6,
    w_dq_scale: torch.Tensor | None = None,
    w_uq_scale: torch.Tensor | None = None,
    w_dkv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """MLA's preprocessing of ``T`` tokens (MLAPO; torch_npu's ``npu_mla_prolog``):
    the query path to absorbed queries and the key path to one latent cache row each.

    With ``H`` heads, ``nope`` / ``rope`` query-key dims, ``kv_lora`` the latent width::

        q_norm = rms_norm(x @ w_dq.T, gamma_cq, eps)            # [T, q_lora]
        q = (q_norm @ w_uq.T).view(T, H, nope + rope)
        q_latent[:, h] = q[:, h, :nope] @ w_uk[h]               # W_UK absorbed
        q_rope = rope(q[..., nope:], cos, sin)                  # interleaved pairs
        kv = x @ w_dkv.T                                        # [T, kv_lora + rope]
        kv_latent = rms_norm(kv[:, :kv_lora], gamma_ckv, eps)
        k_rope = rope(kv[:, kv_lora:], cos, sin)

    GEMMs accumulate in fp32, norms and rotations compute in fp32; every named
    intermediate is rounded to ``x``'s dtype, as separate ops would leave it. Writing
    ``kv_latent`` / ``k_rope`` into a paged cache is the caller's (one scatter of
    ``T`` rows): the op stays functional, so every backend, the exporters and the
    judges treat it like any other. Inference only (no autograd).

    W8A8 (GLM-5's quantised attention; ``npu_mla_prolog_v3``'s full-quantisation
    scenario): with the three scales given, ``w_dq`` / ``w_uq`` / ``w_dkv`` are packed
    ``int8_row`` weights and each of their GEMMs is ``quant_gemm(a, w, w_scale,
    "w8a8")``: ``a`` (``x``, then ``q_norm``) quantised per token, an exact int32
    accumulation, the two scales applied in float32, rounded to ``x``'s dtype; and
    ``q_norm`` is returned as that up-projection reads it, its per-token int8 codes
    times their scale in ``x``'s dtype (the quantised ``query_norm`` torch_npu's
    MLAPO returns; a W8A8 indexer projection quantises it to the same codes). The
    rest (norms, rope, the ``W_UK`` absorption in ``x``'s dtype) is as above.

    Args:
        x: ``[T, hidden]`` fp32 | bf16 | fp16, the normalised attention input.
        w_dq: ``[q_lora, hidden]`` (``q_a_proj.weight``), ``x``'s dtype like every
            weight and gain.
        gamma_cq: ``[q_lora]`` (``q_a_layernorm.weight``).
        w_uq: ``[H * (nope + rope), q_lora]`` (``q_b_proj.weight``: per head, ``nope``
            rows then ``rope`` rows).
        w_uk: ``[H, nope, kv_lora]``, ``kv_b_proj.weight``'s key half per head.
        w_dkv: ``[kv_lora + rope, hidden]`` (``kv_a_proj_with_mqa.weight``).
        gamma_ckv: ``[kv_lora]`` (``kv_a_layernorm.weight``).
        cos, sin: ``[T, rope / 2]`` fp32, at each token's position (as ``rope``).
        eps: both norms' epsilon, ``> 0``.
        w_dq_scale, w_uq_scale, w_dkv_scale: ``None`` (float weights), or all three:
            float32 ``[rows]`` per-output-channel scales of int8 ``w_dq`` / ``w_uq`` /
            ``w_dkv`` (``glmport.ops.quantize_weight(w, "w8a8")``).

    Returns:
        ``q_latent [T, H, kv_lora]``, ``q_rope [T, H, rope]``, ``q_norm [T, q_lora]``
        (the indexer's query input), ``kv_latent [T, kv_lora]``, ``k_rope [T, rope]``,
        all in ``x``'s dtype.
    """
    return invoke(
        MLA_PROLOG,
        x,
        w_dq,
        gamma_cq,
        w_uq,
        w_uk,
        w_dkv,
        gamma_ckv,
        cos,
        sin,
        eps,
        w_dq_scale,
        w_uq_scale,
        w_dkv_scale,
    )
