"""DFlash block-diffusion drafter (z-lab checkpoint format).

A few Qwen3-style layers with no embedding or LM head of their own (the target's are used). The
target's tapped hidden states of each committed token go through ``fc`` + ``hidden_norm`` once and
enter every layer only as extra keys/values (KV injection), kept in the drafter's own paged cache.
A step runs the block ``[bonus, mask x (S-1)]`` non-causally and returns S-1 hidden states whose
logits are the per-depth marginals q_1..q_{S-1}.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ddtree.context import AttentionContext
from ddtree.kernels import triton_enabled
from ddtree.models.decoder import ModelConfig
from ddtree.models.layers import QKVProjection, RMSNorm, ResidualBlock, Rotary, add_rms_norm


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    extra: dict = field(default_factory=dict)  # unknown config.json fields, kept on save

    @classmethod
    def from_hf(cls, cfg: dict) -> "DFlashConfig":
        dcfg = cfg.get("dflash_config") or {}
        for key in ("target_layer_ids", "mask_token_id"):
            if key not in dcfg:
                raise ValueError(f"drafter config.json: dflash_config.{key} is missing")
        rope = cfg.get("rope_parameters") or {}
        heads = cfg["num_attention_heads"]
        known = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size", "block_size", "rms_norm_eps",
                 "rope_theta", "rope_parameters", "max_position_embeddings", "dflash_config",
                 "num_target_layers"}
        return cls(
            hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"], block_size=int(cfg.get("block_size", 16)),
            target_layer_ids=[int(i) for i in dcfg["target_layer_ids"]],
            mask_token_id=int(dcfg["mask_token_id"]),
            num_target_layers=int(cfg.get("num_target_layers", 0)),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            extra={k: v for k, v in cfg.items() if k not in known},
        )

    def to_hf(self) -> dict:
        cfg = dict(self.extra)
        cfg.update({
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu",
            "block_size": self.block_size, "num_target_layers": self.num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
        })
        return cfg

    def check_fits(self, target: ModelConfig) -> None:
        """Raise ValueError naming the first field that does not fit the target."""
        if self.hidden_size != target.hidden_size:
            raise ValueError(f"drafter hidden_size {self.hidden_size} != target hidden_size {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            raise ValueError(f"drafter vocab_size {self.vocab_size} != target vocab_size {target.vocab_size}")
        for i in self.target_layer_ids:
            if not 0 <= i < target.num_hidden_layers:
                raise ValueError(f"drafter target_layer_ids contains {i}, out of range for a target "
                                 f"with {target.num_hidden_layers} layers")
        if not self.target_layer_ids:
            raise ValueError("drafter target_layer_ids is empty")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ValueError(f"drafter mask_token_id {self.mask_token_id} is outside the vocabulary")
        if self.block_size < 2:
            raise ValueError(f"drafter block_size must be >= 2, got {self.block_size}")


def default_tap_layers(num_target_layers: int, num_taps: int) -> list[int]:
    """Taps spread from layer 1 to the third-to-last layer (DESIGN §1.1)."""
    lo, hi = 1, max(1, num_target_layers - 3)
    if num_taps == 1:
        return [hi]
    return sorted({round(lo + (hi - lo) * i / (num_taps - 1)) for i in range(num_taps)})


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig, learned_mask: bool = False):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(
            ResidualBlock(QKVProjection(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                        cfg.head_dim, False, True, cfg.rms_norm_eps),
                          cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps)
            for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        # A target with no spare vocabulary row for the mask token ships a learned embedding.
        self.mask_embedding = nn.Parameter(torch.zeros(cfg.hidden_size)) if learned_mask else None
        self._kv_all = None  # all layers' K/V weights in one matrix (CUDA inference)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def taps(self) -> tuple[int, ...]:
        return tuple(self.config.target_layer_ids)

    def kv_shape(self) -> tuple[int, int, int]:
        c = self.config
        return c.num_hidden_layers, c.num_key_value_heads, c.head_dim

    def store_context(self, taps: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                      slot_mapping: torch.Tensor, rope: torch.Tensor | None = None) -> None:
        """Project committed tokens' tapped hidden states once and store their K/V in every layer
        (``rope``: their rows of ``self.rotary.table``, when the caller has them)."""
        c = add_rms_norm(self.fc(taps.to(self.fc.weight.dtype)), None, self.hidden_norm)[0]
        cos, sin = self.rotary.split(rope) if rope is not None else self.rotary.cos_sin(positions)
        if triton_enabled(c) and not torch.is_grad_enabled():
            # Every layer projects the same features: one GEMM for all layers' K/V, then each
            # layer's norm + rotary + store (a context update runs every decode step).
            from ddtree.kernels.triton_layers import qkv_rope_store
            if self._kv_all is None:
                self._kv_all = torch.cat([w for layer in self.layers
                                          for w in (layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight)])
            kv = torch.nn.functional.linear(c, self._kv_all)
            cfg = self.config
            width = 2 * cfg.num_key_value_heads * cfg.head_dim
            for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
                qkv_rope_store(kv[:, i * width:(i + 1) * width], 0, cfg.num_key_value_heads, cfg.head_dim, cos,
                               sin, slot_mapping, k_cache, v_cache, None, layer.self_attn.k_norm)
            return
        for layer, kv_cache in zip(self.layers, kv_caches):
            layer.self_attn.project_store(c, cos, sin, kv_cache, slot_mapping, with_queries=False)

    def block_embeddings(self, bonus: torch.Tensor, embed: nn.Embedding) -> torch.Tensor:
        """[N] bonus tokens -> [N*S, H] embeddings of [bonus, mask x (S-1)]."""
        S, N = self.block_size, bonus.shape[0]
        ids = torch.full((N, S), self.config.mask_token_id, dtype=torch.long, device=bonus.device)
        ids[:, 0] = bonus
        x = embed(ids)
        if self.mask_embedding is not None:
            x[:, 1:] = self.mask_embedding.to(x.dtype)
        return x.reshape(N * S, -1)

    def forward(self, block_embeds: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                ctx: AttentionContext) -> torch.Tensor:
        """Block hidden states [N*S, H] (final-normed). ``ctx`` (mask "full") stores the block's K/V
        after the context's, where the next commit overwrites the accepted ones."""
        x, residual = block_embeds.to(self.fc.weight.dtype), None
        cos, sin = self.rotary.rope_for(positions, ctx)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, kv_cache, ctx)
        return add_rms_norm(x, residual, self.norm)[0]

    # ---- checkpoint I/O (z-lab format) -------------------------------------------------------
    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(self.config.to_hf(), indent=2))
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items() if k != "mask_embedding"}
        save_file(state, str(path / "model.safetensors"))
        if self.mask_embedding is not None:
            torch.save({"mask_token_id": self.config.mask_token_id,
                        "embedding": self.mask_embedding.detach().cpu()}, path / "mask_embedding.pt")

    @classmethod
    def from_pretrained(cls, path: str | Path, device=None, dtype=None) -> "DFlashDrafter":
        path = Path(path)
        if not (path / "config.json").exists():
            raise ValueError(f"drafter path {path} has no config.json")
        cfg = DFlashConfig.from_hf(json.loads((path / "config.json").read_text()))
        mask_file = path / "mask_embedding.pt"
        model = cls(cfg, learned_mask=mask_file.exists())
        state = {}
        for f in sorted(path.glob("*.safetensors")):
            state.update(load_file(str(f)))
        state = {k.removeprefix("model."): v for k, v in state.items()
                 if not k.endswith(("embed_tokens.weight", "lm_head.weight"))}
        if model.mask_embedding is not None:
            state["mask_embedding"] = torch.load(mask_file, map_location="cpu")["embedding"]
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"drafter checkpoint {path}: missing weights {missing}, unexpected {unexpected}")
        return model.to(device=device, dtype=dtype)


def random_drafter(target: ModelConfig, num_layers: int = 1, block_size: int = 16, num_taps: int = 3,
                   seed: int = 0, dtype=torch.float32) -> DFlashDrafter:
    """A randomly initialised drafter that fits ``target`` (for tests until one is trained)."""
    heads = max(1, target.num_attention_heads)
    cfg = DFlashConfig(
        hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=target.num_key_value_heads, head_dim=target.head_dim,
        vocab_size=target.vocab_size, block_size=block_size,
        target_layer_ids=default_tap_layers(target.num_hidden_layers, num_taps),
        mask_token_id=0, num_target_layers=target.num_hidden_layers,
        rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
    )
    gen = torch.Generator().manual_seed(seed)
    model = DFlashDrafter(cfg, learned_mask=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / math.sqrt(p.shape[-1])))
    return model.to(dtype)
