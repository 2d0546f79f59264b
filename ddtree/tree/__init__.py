"""DDTree draft trees: construction, layout and acceptance (torch + stdlib only)."""

from .accept import (
    accept_walk,
    compaction_moves,
    filtered_probs,
    gather_rows,
    sample_from_logits,
)
from .build import (
    build_tree_batched,
    build_tree_heap,
    chain_tree,
    effective_budget,
    topk_per_depth,
)
from .layout import ancestor_mask, positions, with_root
from .processing import Processing, process_tree_logits

__all__ = [
    "effective_budget",
    "topk_per_depth",
    "build_tree_heap",
    "build_tree_batched",
    "chain_tree",
    "with_root",
    "ancestor_mask",
    "positions",
    "filtered_probs",
    "sample_from_logits",
    "accept_walk",
    "gather_rows",
    "compaction_moves",
    "Processing",
    "process_tree_logits",
]
