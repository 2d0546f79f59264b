"""Fused Triton kernels for the layer ops around attention (CUDA path).

Each reproduces the torch reference's roundings (fp32 math, a cast back to the model dtype
wherever the reference casts), so the two paths agree to the last bit in most places and to
fp32 rounding order elsewhere. Fusing matters because a 135M-parameter model at batch 1 is
bound by kernel count, not FLOPs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(X, R, W, Y, RO, stride_x, stride_r, stride_y, stride_ro, n_cols, eps,
                         BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(R + row * stride_r + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(RO + row * stride_ro + cols, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n_cols
    y = (xf * tl.math.rsqrt(var + eps)).to(X.dtype.element_ty)
    w = tl.load(W + cols, mask=m, other=0.0)
    tl.store(Y + row * stride_y + cols, (y.to(tl.float32) * w.to(tl.float32)).to(Y.dtype.element_ty), mask=m)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None):
    """(norm(x + residual), x + residual); residual None: (norm(x), x). ``out``: a [T, H] view
    (rows may be strided) that receives x + residual."""
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.empty_like(x2)
    if residual is None and out is not None:
        out.copy_(x2)
        x2 = out
    res_out = x2 if residual is None else (torch.empty_like(x2) if out is None else out)
    r2 = residual.reshape(-1, x.shape[-1]) if residual is not None else x2
    _add_rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, y, res_out, x2.stride(0), r2.stride(0), y.stride(0), res_out.stride(0),
        x2.shape[1], eps, BLOCK=triton.next_power_of_2(x2.shape[1]), HAS_RES=residual is not None,
        num_warps=4)
    return y.view(x.shape), res_out.view(x.shape)


@triton.jit
def _qkv_rope_store_kernel(QKV, QO, KC, VC, COS, SIN, SLOTS, QW, KW, eps,
                           stride_qkv, stride_qo_t, stride_qo_h, stride_kc, stride_kh, stride_vc, stride_vh,
                           stride_cos,
                           NQ: tl.constexpr, NKV: tl.constexpr, NH_P2: tl.constexpr, HALF: tl.constexpr,
                           HAS_NORM: tl.constexpr):
    # One program per token over all its heads (row j = head j: queries, keys, then values):
    # a program per (token, head) meant thousands of 1-warp programs running in several waves.
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, NH_P2)[:, None]
    d = tl.arange(0, HALF)[None, :]
    is_q = j < NQ
    is_k = (j >= NQ) & (j < NQ + NKV)
    is_v = (j >= NQ + NKV) & (j < NQ + 2 * NKV)
    m = j < NQ + 2 * NKV
    base = QKV + t * stride_qkv + j * (2 * HALF)
    x1 = tl.load(base + d, mask=m, other=0.0)
    x2 = tl.load(base + HALF + d, mask=m, other=0.0)
    dtype = x1.dtype
    c = tl.load(COS + t * stride_cos + d)
    s = tl.load(SIN + t * stride_cos + d)
    slot = tl.load(SLOTS + t).to(tl.int64)
    # the same roundings as the per-head kernel had: fp32 math, casts to the input dtype
    y1, y2 = x1, x2
    if HAS_NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        inv = tl.math.rsqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.where(is_q, tl.load(QW + d).to(tl.float32), tl.load(KW + d).to(tl.float32))
        w2 = tl.where(is_q, tl.load(QW + HALF + d).to(tl.float32), tl.load(KW + HALF + d).to(tl.float32))
        y1 = ((f1 * inv).to(dtype).to(tl.float32) * w1).to(dtype)
        y2 = ((f2 * inv).to(dtype).to(tl.float32) * w2).to(dtype)
    f1, f2 = y1.to(tl.float32), y2.to(tl.float32)
    y1, y2 = (f1 * c - f2 * s).to(dtype), (f2 * c + f1 * s).to(dtype)
    # masked-out rows get in-bounds (never used) offsets
    qo = QO + t * stride_qo_t + tl.where(is_q, j, 0) * stride_qo_h + d
    tl.store(qo, y1, mask=is_q)
    tl.store(qo + HALF, y2, mask=is_q)
    ko = KC + slot * stride_kc + tl.where(is_k, j - NQ, 0) * stride_kh + d
    tl.store(ko, y1.to(KC.dtype.element_ty), mask=is_k)
    tl.store(ko + HALF, y2.to(KC.dtype.element_ty), mask=is_k)
    vo = VC + slot * stride_vc + tl.where(is_v, j - NQ - NKV, 0) * stride_vh + d
    tl.store(vo, x1.to(VC.dtype.element_ty), mask=is_v)
    tl.store(vo + HALF, x2.to(VC.dtype.element_ty), mask=is_v)


def qkv_rope_store(qkv: torch.Tensor, num_q: int, num_kv: int, head_dim: int, cos: torch.Tensor,
                   sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   q_norm=None, k_norm=None) -> torch.Tensor | None:
    """qkv [T, (num_q + 2 num_kv) * head_dim] from the fused projection: norm (optional) and rotate
    queries and keys, write keys and values to their cache slots; returns q [T, num_q, head_dim]."""
    T = qkv.shape[0]
    q = torch.empty(T, max(num_q, 1), head_dim, device=qkv.device, dtype=qkv.dtype)
    norm = q_norm if q_norm is not None else k_norm
    eps = norm.eps if norm is not None else 0.0
    qw = q_norm.weight if q_norm is not None else qkv
    kw = k_norm.weight if k_norm is not None else qkv
    nh_p2 = triton.next_power_of_2(num_q + 2 * num_kv)
    tile = nh_p2 * (head_dim // 2)
    _qkv_rope_store_kernel[(T,)](
        qkv, q, k_cache, v_cache, cos, sin, slots, qw, kw, eps,
        qkv.stride(0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), cos.stride(0),
        NQ=num_q, NKV=num_kv, NH_P2=nh_p2, HALF=head_dim // 2, HAS_NORM=norm is not None,
        num_warps=8 if tile >= 8192 else 4 if tile >= 2048 else 2)
    return q if num_q else None


@triton.jit
def _silu_mul_kernel(X, Y, stride_x, stride_y, n, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    g = tl.load(X + t * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(X + t * stride_x + n + cols, mask=m, other=0.0)
    act = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    tl.store(Y + t * stride_y + cols, (act.to(tl.float32) * u.to(tl.float32)).to(u.dtype), mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
    T, two_n = gate_up.shape
    n = two_n // 2
    y = torch.empty(T, n, device=gate_up.device, dtype=gate_up.dtype)
    block = 1024
    _silu_mul_kernel[(T, triton.cdiv(n, block))](gate_up, y, gate_up.stride(0), y.stride(0), n, BLOCK=block,
                                                 num_warps=4)
    return y
