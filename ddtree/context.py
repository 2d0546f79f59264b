"""The one object that carries attention metadata for a forward pass (nano-vllm style).

Built once per forward from the sequences' block tables with tensor ops (no per-token host
loops) and shared by every layer. Queries of all sequences are padded into [N, Qmax] rows and
keys gathered from the paged cache into [N, Kmax] rows, so each layer runs one batched attention
call."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def slots_for(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each (sequence, position): block_tables [N, B], positions [N, P] -> [N, P]."""
    blocks = torch.gather(block_tables, 1, (positions // block_size).clamp(max=block_tables.shape[1] - 1))
    return blocks * block_size + positions % block_size


@dataclass
class AttentionContext:
    slot_mapping: torch.Tensor | None  # [T] cache slot of every new token (None: not stored)
    key_slots: torch.Tensor            # [N, Kmax] cache slots of the keys each sequence sees
    mask: torch.Tensor                 # [N, Qmax, Kmax(+Qmax)] bool: query may attend to key
    query_rows: torch.Tensor           # [T] row of each flat query in the padded [N*Qmax] layout
    num_seqs: int
    max_queries: int

    @classmethod
    def build(cls, block_tables: torch.Tensor, cached_lens: list[int], new_lens: list[int], block_size: int,
              tree_mask: torch.Tensor | None = None, store: bool = True) -> "AttentionContext":
        """block_tables [N, maxblocks] (on the target device). Sequence i has ``cached_lens[i]``
        tokens cached (all visible) and ``new_lens[i]`` new tokens at the next positions.
        store=True: new tokens are written to their slots and are keys too (causal among
        themselves, or ``tree_mask[i]`` [T, T]). store=False (drafter blocks): nothing is written;
        the caller appends the block's K/V after the cached keys and they see each other fully."""
        device = block_tables.device
        N, q_max = len(new_lens), max(new_lens)
        cached = torch.tensor(cached_lens, device=device)[:, None]
        new = torch.tensor(new_lens, device=device)[:, None]
        k_max = max(max(c + (n if store else 0) for c, n in zip(cached_lens, new_lens)), 1)
        key_pos = torch.arange(k_max, device=device)[None, :]
        key_slots = slots_for(block_tables, key_pos.expand(N, k_max), block_size)
        q = torch.arange(q_max, device=device)[None, :, None]             # [1, Q, 1]
        visible_cached = (key_pos < cached)[:, None, :]                    # [N, 1, K]
        if store:
            rel = key_pos[:, None, :] - cached[:, :, None]                 # key offset among new tokens
            is_new = (rel >= 0) & (rel < new[:, :, None])
            if tree_mask is not None:
                T = tree_mask.shape[-1]
                idx = rel.clamp(0, T - 1).expand(N, q_max, k_max)
                allowed = torch.gather(tree_mask[:, :q_max], 2, idx)
            else:
                allowed = rel <= q
            mask = visible_cached | (is_new & allowed)
        else:
            mask = torch.cat([visible_cached.expand(N, q_max, k_max),
                              torch.ones(N, q_max, q_max, dtype=torch.bool, device=device)], 2)
        pad = q >= new[:, :, None]                                         # padded query rows
        mask = mask | (pad & (torch.arange(mask.shape[2], device=device) == 0))
        mask = mask & ~(pad & (torch.arange(mask.shape[2], device=device) != 0))
        if all(n == q_max for n in new_lens):
            rows = torch.arange(N * q_max, device=device)
        else:
            rows = (torch.arange(N, device=device)[:, None] * q_max + q[0, :, 0][None, :])[q[0, :, 0][None, :] < new]
        slot_mapping = None
        if store:
            new_pos = (cached + q[0, :, 0][None, :])                       # [N, Q]
            slot_mapping = slots_for(block_tables, new_pos, block_size)[q[0, :, 0][None, :] < new]
        return cls(slot_mapping=slot_mapping, key_slots=key_slots, mask=mask, query_rows=rows,
                   num_seqs=N, max_queries=q_max)

    @classmethod
    def contiguous(cls, lengths: list[int], device=None) -> "AttentionContext":
        """Causal attention over fresh sequences stored back to back in slots 0..sum-1
        (full forwards in tests and training; the cache needs sum(lengths) slots)."""
        bs = max(lengths)
        tables = torch.tensor([[i] for i in range(len(lengths))], device=device)
        ctx = cls.build(tables, [0] * len(lengths), lengths, bs)
        offsets = torch.tensor([i * bs for i in range(len(lengths))], device=device)
        ctx.slot_mapping = torch.cat([torch.arange(n, device=device) + offsets[i] for i, n in enumerate(lengths)])
        return ctx
