"""Compact decoder-only target models: Llama (SmolLM2), Qwen2 and Qwen3.

One forward runs a flat batch of tokens from many sequences over the paged KV cache and returns
the final hidden states plus the hidden states of the tapped layers (the DFlash conditioning).
Parameter names follow Hugging Face so safetensors folders load as they are.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from ddtree.context import AttentionContext
from ddtree.models.layers import QKVProjection, RMSNorm, ResidualBlock, Rotary, add_rms_norm

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"rope_type {rope_type!r} is not supported (only default RoPE)")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        heads = cfg["num_attention_heads"]
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
        )

    def to_hf(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.pop("qk_norm")
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": d.pop("rope_theta")}
        return d


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            ResidualBlock(QKVProjection(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                        cfg.head_dim, cfg.attention_bias, cfg.qk_norm, cfg.rms_norm_eps),
                          cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps)
            for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                ctx: AttentionContext, taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (final-normed hidden [T, H], concatenated tapped layer outputs [T, len(taps)*H])."""
        x, residual = self.embed(input_ids), None
        cos, sin = self.rotary.rope_for(positions, ctx)
        H = x.shape[-1]
        tap_out = x.new_empty(x.shape[0], len(taps) * H) if taps else None
        # Layer i's output (x + residual) is summed by the next norm, which writes it here.
        tap = {layer: tap_out[:, k * H:(k + 1) * H] for k, layer in enumerate(taps)}
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, cos, sin, kv_caches[i], ctx, tap.get(i - 1))
        return add_rms_norm(x, residual, self.model.norm, tap.get(len(self.model.layers) - 1))[0], tap_out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits. On CUDA a bf16/fp16 GEMM accumulates into fp32 output directly: rounding
        logits to bf16 would create exact ties that flip greedy choices between batch shapes."""
        if hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16):
            flat = hidden.reshape(-1, hidden.shape[-1])
            out = torch.mm(flat, self.lm_head.weight.t(), out_dtype=torch.float32)
            return out.view(*hidden.shape[:-1], -1)
        return self.lm_head(hidden).float()

    def kv_shape(self) -> tuple[int, int, int]:
        c = self.config
        return c.num_hidden_layers, c.num_key_value_heads, c.head_dim
