"""The one object that carries attention metadata for a forward pass (nano-vllm style)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionContext:
    query_starts: list[int]          # cumulative query counts, len num_seqs + 1
    cached_lens: list[int]           # tokens already in the cache before this pass, per sequence
    cached_slots: list[torch.Tensor]  # their cache slots, per sequence
    slot_mapping: torch.Tensor | None  # cache slot of every new token [T] (None: do not store)
    tree_mask: torch.Tensor | None = None  # [N, Tq, Tq] bool; None = causal among new tokens

    @property
    def num_seqs(self) -> int:
        return len(self.cached_lens)
