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

from ddtree.tree import build_tree_batched


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
        self._tree_depth = self.depth

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        # Keep the marginals of the depths a tree can reach: a node at depth d has d - 1
        # ancestors, so a tree of budget B never goes deeper than B (8 of the 15 positions at
        # B = 8; the LM head is one of the largest matmuls of a CPU step). The parent only
        # reshapes what is returned here and propose() replaces it with the tree, so no argmax
        # is spent on it.
        rows = hidden_states.view(-1, self.depth, hidden_states.shape[-1])[:, :self._tree_depth]
        self._logits = self.model.compute_logits(rows.reshape(-1, hidden_states.shape[-1]))
        return torch.zeros(hidden_states.shape[0], dtype=torch.long, device=hidden_states.device), None

    def propose(self, num_speculative_tokens, *args, **kwargs):
        runner = self.runner
        req_ids = list(runner.input_batch.req_ids)
        budget = min(self.budget, num_speculative_tokens)
        self._tree_depth = max(1, min(self.depth, budget))
        super().propose(self.depth, *args, **kwargs)
        logits = self._logits
        self._logits = None
        n = len(req_ids)
        logprobs = torch.log_softmax(logits.float(), dim=-1).view(n, self._tree_depth, -1)
        tokens, parents, depths = build_tree_batched(logprobs, budget)
        self.last_trees = ProposedTrees(req_ids, tokens, parents, depths)
        return tokens
