"""The one object that carries attention metadata for a forward pass (nano-vllm style).

A forward runs a flat batch of new tokens from N sequences. Sequence i has ``cached_lens[i]``
tokens already in the paged cache (all visible to its queries) and its new tokens at the next
positions; the new tokens' K/V are written to ``slot_mapping`` and the new tokens see each other
by ``mask``: "causal" (prefill, plain decode), "full" (a drafter block) or "tree" (a DDTree
verify, ``tree_mask[i, q, k]``). Everything the kernels read is a tensor, so a context built
from static buffers can be replayed by a CUDA graph; the host ints (``max_queries``,
``max_keys``) only size grids and the reference path's padding.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def slots_for(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each (sequence, position): block_tables [N, B], positions [N, P] -> [N, P]."""
    blocks = torch.gather(block_tables, 1, (positions // block_size).clamp(max=block_tables.shape[1] - 1))
    return blocks * block_size + positions % block_size


_QUERY_STARTS: dict = {}


def _query_starts(num_seqs: int, num_new: int, device) -> torch.Tensor:
    """``[0, n, 2n, ...]``, made once per shape (read only, so a captured graph may keep it)."""
    key = (num_seqs, num_new, str(device))
    if key not in _QUERY_STARTS:
        _QUERY_STARTS[key] = torch.arange(num_seqs + 1, device=device) * num_new
    return _QUERY_STARTS[key]


@dataclass
class AttentionContext:
    block_tables: torch.Tensor         # [N, W] blocks of every sequence
    cached_lens: torch.Tensor          # [N] keys before the new tokens
    query_start: torch.Tensor          # [N+1] offsets of each sequence's new tokens in the batch
    slot_mapping: torch.Tensor         # [T] cache slot of every new token
    block_size: int
    max_queries: int                   # host bound on new tokens per sequence
    max_keys: int                      # host bound on cached + new tokens per sequence
    mask: str = "causal"
    tree_mask: torch.Tensor | None = None  # [N, max_queries, max_queries] bool, mask == "tree"
    positions: torch.Tensor | None = None  # [T] of the new tokens (``uniform``)
    rope: torch.Tensor | None = None       # [T, 2D] their rows of a ``Rotary.table`` (``uniform``)
    _dense: tuple | None = field(default=None, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

    @classmethod
    def build(cls, block_tables: torch.Tensor, cached_lens: list[int], new_lens: list[int], block_size: int,
              mask: str = "causal", tree_mask: torch.Tensor | None = None) -> "AttentionContext":
        """From host lengths (prefill chunks and eager steps)."""
        device = block_tables.device
        starts = [0]
        for n in new_lens:
            starts.append(starts[-1] + n)
        cached = torch.tensor(cached_lens, device=device)
        new = torch.tensor(new_lens, device=device)
        q_max = max(new_lens)
        q = torch.arange(q_max, device=device)[None, :]
        slots = slots_for(block_tables, cached[:, None] + q, block_size)[q < new[:, None]]
        return cls(block_tables, cached, torch.tensor(starts, device=device), slots, block_size, q_max,
                   max(c + n for c, n in zip(cached_lens, new_lens)), mask, tree_mask)

    @classmethod
    def uniform(cls, block_tables: torch.Tensor, cached_lens: torch.Tensor, num_new: int, block_size: int,
                max_keys: int, mask: str = "causal", tree_mask: torch.Tensor | None = None,
                depths: torch.Tensor | None = None, rope_table: torch.Tensor | None = None) -> "AttentionContext":
        """Every sequence adds ``num_new`` tokens; no host reads (CUDA-graph safe). Also sets
        ``positions`` (``cached_lens + depths`` for a tree's nodes, else consecutive) and, with
        a ``Rotary.table``, their ``rope`` rows: on CUDA all of it in one launch."""
        N, device = block_tables.shape[0], block_tables.device
        starts = _query_starts(N, num_new, device)
        from ddtree.kernels import triton_enabled
        if triton_enabled(cached_lens):
            from ddtree.kernels.triton_meta import uniform_meta
            slots, positions, rope = uniform_meta(block_tables, cached_lens, num_new, block_size, depths, rope_table)
        else:
            q = torch.arange(num_new, device=device)
            slots = slots_for(block_tables, cached_lens[:, None] + q[None, :], block_size).reshape(-1)
            positions = (cached_lens[:, None] + (q[None, :] if depths is None else depths)).reshape(-1)
            rope = None if rope_table is None else rope_table[positions.clamp(0, rope_table.shape[0] - 1)]
        return cls(block_tables, cached_lens, starts, slots, block_size, num_new, max_keys, mask, tree_mask,
                   positions, rope)

    @classmethod
    def contiguous(cls, lengths: list[int], device=None) -> "AttentionContext":
        """Causal attention over fresh sequences stored back to back in slots 0..sum-1
        (full forwards in tests and training; the cache needs sum(lengths) slots)."""
        # Pages of one slot, so the block size (a compile-time constant of the Triton attention
        # kernel) is the same for every length: a page as long as the longest sequence compiled
        # a kernel per length (~5 s each on an H100, 240 s in one CUDA test).
        starts = torch.tensor([0] + lengths[:-1], device=device).cumsum(0)
        tables = starts[:, None] + torch.arange(max(lengths), device=device)[None, :]
        return cls.build(tables, [0] * len(lengths), lengths, 1)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(key_slots [N, K], allowed [N, Q, K], query_rows [T]) for the padded reference path;
        built once per forward and shared by the layers."""
        if self._dense is None:
            device = self.block_tables.device
            N, Q, K = self.num_seqs, self.max_queries, max(self.max_keys, 1)
            key_pos = torch.arange(K, device=device)[None, :]
            key_slots = slots_for(self.block_tables, key_pos.expand(N, K), self.block_size)
            new = (self.query_start[1:] - self.query_start[:-1])[:, None, None]
            cached = self.cached_lens[:, None, None]
            q = torch.arange(Q, device=device)[None, :, None]
            rel = key_pos[:, None, :] - cached                             # offset among new tokens
            is_new = (rel >= 0) & (rel < new)
            if self.mask == "tree":
                idx = rel.clamp(0, Q - 1).expand(N, Q, K)
                among_new = torch.gather(self.tree_mask[:, :Q, :Q], 2, idx)
            elif self.mask == "full":
                among_new = torch.ones_like(is_new)
            else:
                among_new = rel <= q
            allowed = (rel < 0) | (is_new & among_new)
            valid_q = q < new
            # Padded query rows see key 0 only, so softmax stays finite; their output is dropped.
            allowed = torch.where(valid_q, allowed, key_pos[:, None, :] == 0)
            rows = (torch.arange(N, device=device)[:, None] * Q + q[0, :, 0][None, :])[valid_q[:, :, 0]]
            self._dense = (key_slots, allowed, rows)
        return self._dense
