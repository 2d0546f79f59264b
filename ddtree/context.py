"""The one object that carries attention metadata for a forward pass (nano-vllm style).

Built once per forward on the host and shared by every layer. Queries of all sequences are
padded into [N, Qmax] rows and keys gathered from the paged cache into [N, Kmax] rows, so each
layer runs one batched attention call."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionContext:
    slot_mapping: torch.Tensor | None  # [T] cache slot of every new token (None: not stored)
    key_slots: torch.Tensor            # [N, Kmax] cache slots of the keys each sequence sees
    mask: torch.Tensor                 # [N, Qmax, Kmax] bool: query may attend to key
    query_rows: torch.Tensor           # [T] row of each flat query in the padded [N*Qmax] layout
    num_seqs: int
    max_queries: int

    @classmethod
    def build(cls, cached_slots: list[list[int]], new_slots: list[list[int]] | None, new_lens: list[int],
              device, tree_mask: torch.Tensor | None = None, store: bool = True) -> "AttentionContext":
        """cached_slots[i]: slots of the tokens already cached for sequence i (all visible).
        new_slots[i]: slots the new tokens are written to; when ``store`` they are keys too
        (causal among themselves, or ``tree_mask[i]``); when not (drafter blocks) the new
        tokens' K/V are appended by the caller and see each other fully."""
        N = len(new_lens)
        q_max = max(new_lens)
        keys = [c + (n if store else []) for c, n in zip(cached_slots, new_slots or [[]] * N)]
        k_max = max(max(len(k) for k in keys), 1)
        key_slots = torch.zeros(N, k_max, dtype=torch.long)
        mask = torch.zeros(N, q_max, k_max + (0 if store else q_max), dtype=torch.bool)
        rows = []
        for i, (c, k, n) in enumerate(zip(cached_slots, keys, new_lens)):
            key_slots[i, :len(k)] = torch.tensor(k, dtype=torch.long)
            mask[i, :n, :len(c)] = True
            if store:
                new = tree_mask[i, :n, :n].cpu() if tree_mask is not None else \
                    torch.ones(n, n, dtype=torch.bool).tril_()
                mask[i, :n, len(c):len(c) + n] = new
            else:
                mask[i, :n, k_max:k_max + n] = True
            mask[i, n:, 0] = True  # padded query rows: any valid softmax, output discarded
            rows.extend(range(i * q_max, i * q_max + n))
        slot_mapping = None
        if store and new_slots is not None:
            slot_mapping = torch.tensor([s for ns in new_slots for s in ns], dtype=torch.long, device=device)
        return cls(slot_mapping=slot_mapping, key_slots=key_slots.to(device), mask=mask.to(device),
                   query_rows=torch.tensor(rows, dtype=torch.long, device=device), num_seqs=N,
                   max_queries=q_max)
