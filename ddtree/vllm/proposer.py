"""DDTree proposer: vLLM's DFlash drafter pass, then our tree builder on its marginals.

vLLM's DFlashProposer runs the drafter once over [bonus, mask x (S-1)] with the context K/V it
keeps in vLLM's KV cache. Instead of taking the argmax at each of the S-1 positions (a chain), the
per-position log-probabilities go to `ddtree.tree.build_tree_batched`, and the `budget` best
nodes (topological order) become the draft tokens the scheduler sends to the next verify step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.v1.spec_decode.dflash import DFlashProposer

from ddtree.tree import build_tree_batched, topk_per_depth


def top_k_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_per_depth(x, k)`` for a CPU float32 ``x [R, V]``, computed faster.

    Same values and token ids, same tie rule (value descending, then smaller token id). The
    sync-free key trick of ``topk_per_depth`` (int64 keys over the whole vocabulary) dominates a
    CPU step; here one ``torch.topk`` of k+1 does the work. When no row has a tie across the cut
    (k-th == (k+1)-th value), its first k are exactly the top-k set and only their order among
    equal values needs fixing (a stable sort of k entries). Otherwise every entry at or above the
    k-th value is ordered exactly (``_top_k_threshold``); NaN takes the reference path.
    """
    R, V = x.shape
    if k <= 0 or k >= V or x.device.type != "cpu":
        return topk_per_depth(x, k)
    vals, ids = torch.topk(x, k + 1, dim=-1)  # descending; order among equal values unspecified
    if bool(torch.isnan(vals).any()):  # topk ranks NaN first, so a NaN anywhere shows here
        return topk_per_depth(x, k)
    if bool((vals[:, k - 1] == vals[:, k]).any()):
        return _top_k_threshold(x, k)
    ids, by_id = ids[:, :k].sort(dim=-1)
    vals, by_val = vals[:, :k].gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(1, by_val)


def _top_k_threshold(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k when ties straddle the cut: order all entries >= each row's k-th value."""
    R = x.shape[0]
    kth = torch.topk(x, k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    rows, cols = (x >= kth).nonzero(as_tuple=True)  # row-major: ids ascending within a row
    vals = x[rows, cols]
    # Stable: by value (descending) and then by row, so a row's entries stay (value desc, id asc).
    order = torch.sort(vals, descending=True, stable=True).indices
    order = order[torch.sort(rows[order], stable=True).indices]
    counts = torch.bincount(rows, minlength=R)
    first = torch.cumsum(counts, 0) - counts
    take = order[first[:, None] + torch.arange(k)[None, :]]
    return vals[take], cols[take]


@dataclass
class ProposedTrees:
    """Trees of one propose call, row n = request n of the batch it was called with."""
    req_ids: list[str]
    tokens: torch.Tensor   # [N, B'] node tokens, topological order
    parents: torch.Tensor  # [N, B'] 0 = root, p = node p-1
    depths: torch.Tensor   # [N, B'] 1..S-1


class DDTreeProposer(DFlashProposer):
    def __init__(self, vllm_config, device, runner, budget: int):
        super().__init__(vllm_config, device, runner)
        self.runner = runner  # its input_batch names the requests of each propose call
        self.budget = budget
        # Drafter block S: one pass predicts depths 1..S-1 (vLLM's DFlash uses num_speculative_tokens
        # for this; here num_speculative_tokens is the tree budget the scheduler reserves).
        block = getattr(self.draft_model_config.hf_config, "block_size", None)
        if not isinstance(block, int) or block < 2:
            raise ValueError(f"ddtree: drafter config.json needs an integer block_size >= 2, got {block!r}")
        self.depth = block - 1
        self.last_trees: ProposedTrees | None = None
        self._logits: torch.Tensor | None = None

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        # Keep the marginals. The parent only reshapes what is returned here and propose()
        # replaces it with the tree, so no argmax is spent on it.
        self._logits = self.model.compute_logits(hidden_states)
        return torch.zeros(hidden_states.shape[0], dtype=torch.long, device=hidden_states.device), None

    def propose(self, num_speculative_tokens, *args, **kwargs):
        runner = self.runner
        req_ids = list(runner.input_batch.req_ids)
        super().propose(self.depth, *args, **kwargs)
        logits = self._logits
        self._logits = None
        n = len(req_ids)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        budget = min(self.budget, num_speculative_tokens)
        # The tree only ever uses each depth's top K = min(budget, V) tokens: select them once,
        # then build on the [n, depth, K] slice (already in the builder's rank order, so its
        # own selection is the identity) and map slice indices back to token ids.
        k = min(budget, logprobs.shape[-1])
        lp, ids = top_k_rows(logprobs, k)
        tokens, parents, depths = build_tree_batched(lp.view(n, self.depth, k), budget)
        tokens = ids.view(n, self.depth, k)[torch.arange(n)[:, None], depths - 1, tokens]
        self.last_trees = ProposedTrees(req_ids, tokens, parents, depths)
        return tokens
