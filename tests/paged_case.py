"""A mixed verify batch over a paged KV cache, and its float64 dense reference (shared by the
vLLM plugin's CPU and GPU tree-attention tests)."""
from __future__ import annotations

import torch

from ddtree.tree import ancestor_mask

# Runs of equal tree sizes (batched), a plain decode, a prompt chunk, a lone tree.
Q_LENS, LENGTHS = [9, 9, 9, 1, 20, 5], [70, 9, 140, 33, 20, 64]


def paged_case(num_blocks: int, block_size: int, kv_heads: int, head: int, write, generator,
               dtype=torch.float32):
    """Random trees / causal rows, block tables and K/V; ``write(slots, k, v)`` stores K/V in the
    cache under test. Returns (masks, starts, block_table, keys, values), keys/values in float64."""
    masks, starts, keys, values = [], [0], [], []
    table = torch.zeros(len(Q_LENS), 10, dtype=torch.int32)
    free = torch.randperm(num_blocks, generator=generator)
    for r, (q, length) in enumerate(zip(Q_LENS, LENGTHS)):
        if q in (9, 5):
            parents = torch.tensor([0] + [int(torch.randint(0, i, (), generator=generator)) for i in range(1, q)])
            masks.append(ancestor_mask(parents[None], q)[0])
        else:
            masks.append(None)
        n = (length + block_size - 1) // block_size
        table[r, :n], free = free[:n].int(), free[n:]
        slots = table[r].long()[torch.arange(length) // block_size] * block_size + torch.arange(length) % block_size
        k = torch.randn(length, kv_heads, head, generator=generator).to(dtype)
        v = torch.randn(length, kv_heads, head, generator=generator).to(dtype)
        write(slots, k, v)
        keys.append(k.double())
        values.append(v.double())
        starts.append(starts[-1] + q)
    return masks, starts, table, keys, values


def check_against_reference(out, query, masks, starts, keys, values, scale: float, tol: float) -> None:
    """out / query [T, Hq, D]: every request's rows against float64 dense masked attention."""
    heads, kv_heads = query.shape[1], keys[0].shape[1]
    for r, (q, length) in enumerate(zip(Q_LENS, LENGTHS)):
        own = masks[r] if masks[r] is not None else torch.ones(q, q, dtype=torch.bool).tril()
        allowed = torch.cat([torch.ones(q, length - q, dtype=torch.bool), own], dim=1)
        k = keys[r].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # [Hq, L, D]
        v = values[r].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        scores = query[starts[r]:starts[r + 1]].double().transpose(0, 1) @ k.transpose(1, 2) * scale
        want = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v
        torch.testing.assert_close(out[starts[r]:starts[r + 1]].double().cpu(), want.transpose(0, 1),
                                   rtol=tol, atol=tol)
