"""Tree layout helpers for trees that include the root.

A full tree has T = B' + 1 nodes, root at index 0 (its parent is itself,
depth 0); the builders' output node j becomes full-tree node j + 1, and the
builders' parent convention (0 = root, p = output node p-1) is already the
full-tree index.
"""

import torch

__all__ = ["with_root", "ancestor_mask", "positions"]


def with_root(root_tokens: torch.Tensor, tokens: torch.Tensor,
              parents: torch.Tensor, depths: torch.Tensor):
    """Prepend the root (token ``root_tokens[n]``, parent 0, depth 0).

    Returns ``(tokens_full, parents_full, depths_full)``, each [N, T].
    """
    zeros = torch.zeros_like(root_tokens, dtype=torch.long)[:, None]
    tokens_full = torch.cat([root_tokens.to(tokens.dtype)[:, None], tokens], dim=1)
    parents_full = torch.cat([zeros, parents], dim=1)
    depths_full = torch.cat([zeros, depths], dim=1)
    return tokens_full, parents_full, depths_full


def ancestor_mask(parents_full: torch.Tensor, max_depth: int) -> torch.Tensor:
    """mask[n, i, j] = node j is node i or one of its ancestors.

    Follows parent pointers ``max_depth`` times; the root points to itself so
    extra steps are harmless.  No host syncs.
    """
    N, T = parents_full.shape
    device = parents_full.device
    mask = torch.eye(T, dtype=torch.bool, device=device).expand(N, T, T).clone()
    cur = torch.arange(T, device=device).expand(N, T)
    for _ in range(max_depth):
        cur = torch.gather(parents_full, 1, cur)
        mask.scatter_(2, cur[:, :, None], True)
    return mask


def positions(start: torch.Tensor, depths_full: torch.Tensor) -> torch.Tensor:
    """Sequence position of every node: ``start[n] + depth``."""
    return start[:, None] + depths_full
