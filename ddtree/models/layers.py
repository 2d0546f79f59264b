"""Building blocks shared by the target models and the DFlash drafter."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.kernels import triton_enabled


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference implementations, then cast back.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                 out: torch.Tensor | None = None):
    """(norm(x + residual), x + residual), the pre-norm residual step; residual None: (norm(x), x).
    ``out`` (a [T, H] view, possibly strided): where x + residual is written and returned."""
    if triton_enabled(x):
        from ddtree.kernels.triton_layers import add_rms_norm as fused
        return fused(x, residual, norm.weight, norm.eps, out)
    if residual is not None:
        x = x + residual
    if out is not None:
        x = out.copy_(x)
    return norm(x), x


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for linears that share an input, so the fast path runs one GEMM.
    Each linear's parameters become views into the fused tensor: no extra memory, and the
    Hugging Face names still load and save."""
    weight = torch.cat([lin.weight.data for lin in linears])
    bias = torch.cat([lin.bias.data for lin in linears]) if linears[0].bias is not None else None
    start = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = weight[start:start + n]
        if bias is not None:
            lin.bias.data = bias[start:start + n]
        start += n
    return weight, bias


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self._gate_up = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_enabled(x):
            from ddtree.kernels.triton_layers import silu_mul
            if self._gate_up is None:
                self._gate_up, _ = fuse_linears(self.gate_proj, self.up_proj)
            return self.down_proj(silu_mul(F.linear(x, self._gate_up)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Rotary(nn.Module):
    """RoPE computed from absolute positions (no table limit, so tree lookahead past
    max_model_len is fine)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], -1)
        return emb.cos(), emb.sin()

    def table(self, length: int) -> torch.Tensor:
        """[length, 2D] rows ``cos | sin`` of positions 0..length-1, computed as ``cos_sin`` computes
        them (so a row is bit-identical to it): a step reads its rows in the launch that makes
        its slots (``AttentionContext.uniform``) instead of five small kernels per forward."""
        return torch.cat(self.cos_sin(torch.arange(length, device=self.inv_freq.device)), -1)

    @staticmethod
    def split(rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``table`` -> (cos, sin) views [T, D]."""
        d = rope.shape[-1] // 2
        return rope[:, :d], rope[:, d:]

    def rope_for(self, positions: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of ``positions``: the rows ``ctx`` carries when it was made with this table."""
        return self.split(ctx.rope) if ctx is not None and ctx.rope is not None else self.cos_sin(positions)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    xf = x.float()
    return (xf * cos[:, None] + rotated.float() * sin[:, None]).to(x.dtype)


class QKVProjection(nn.Module):
    """Query/key/value projections (+ optional per-head RMSNorm and rotary) that write the keys
    and values of the new tokens to their cache slots. Shared by the target and the drafter."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool,
                 qk_norm: bool, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        else:
            self.q_norm = self.k_norm = None
        self.scale = head_dim ** -0.5
        self._qkv = self._kv = None

    def kv(self, x, cos, sin):
        """Rotated keys and values [T, kv_heads, D] (torch path; training calls it directly)."""
        T = x.shape[0]
        k = self.k_proj(x).view(T, self.kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rotary(k, cos, sin), self.v_proj(x).view(T, self.kv_heads, self.head_dim)

    def project_store(self, x, cos, sin, kv_cache, slots, with_queries: bool = True):
        """Store the new tokens' K/V at ``slots``; return their rotated queries [T, heads, D]."""
        k_cache, v_cache = kv_cache
        if triton_enabled(x):
            from ddtree.kernels.triton_layers import qkv_rope_store
            if self._qkv is None:
                self._qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
                n = self.q_proj.weight.shape[0]
                self._kv = (self._qkv[0][n:], None if self._qkv[1] is None else self._qkv[1][n:])
            w, b = self._qkv if with_queries else self._kv
            return qkv_rope_store(F.linear(x, w, b), self.heads if with_queries else 0, self.kv_heads,
                                  self.head_dim, cos, sin, slots, k_cache, v_cache, self.q_norm, self.k_norm)
        k, v = self.kv(x, cos, sin)
        k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
        if not with_queries:
            return None
        q = self.q_proj(x).view(x.shape[0], self.heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rotary(q, cos, sin)

    def forward(self, x, cos, sin, kv_cache, ctx):
        from ddtree.kernels.attention import paged_attention
        q = self.project_store(x, cos, sin, kv_cache, ctx.slot_mapping)
        o = paged_attention(q, kv_cache[0], kv_cache[1], ctx, self.scale)
        return self.o_proj(o.reshape(x.shape[0], -1))


class ResidualBlock(nn.Module):
    """Pre-norm decoder block shared by the target and the drafter (they differ in attention).
    Blocks pass (x, residual) and add lazily, so the add fuses into the next norm; a layer's
    output is ``x + residual``."""

    def __init__(self, attention: nn.Module, hidden: int, intermediate: int, eps: float):
        super().__init__()
        self.self_attn = attention
        self.mlp = MLP(hidden, intermediate)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x, residual, cos, sin, kv_cache, ctx, residual_out=None):
        """``residual_out``: where the incoming stream (the previous layer's output) is written."""
        h, residual = add_rms_norm(x, residual, self.input_layernorm, residual_out)
        h = self.self_attn(h, cos, sin, kv_cache, ctx)
        h, residual = add_rms_norm(h, residual, self.post_attention_layernorm)
        return self.mlp(h), residual
