"""vLLM model runner with DDTree verification (vLLM's legacy runner, used by its CPU backend).

One engine step, for every request that got a draft tree in the previous step:
  verify   the scheduler sends root + tree nodes as "spec tokens"; positions are rewritten to
           start + depth and the target's attention uses the ancestor mask (attention.py)
  accept   one target sample per node, then `ddtree.tree.accept_walk` (greedy or sampling);
           the accepted tokens + bonus go back to vLLM like the rejection sampler's output,
           so the scheduler's num_computed_tokens rollback stays right
  commit   accepted nodes' target K/V are moved into chain order (start, start+1, ...), and the
           rows the drafter reads its context from (token ids, positions, tapped hidden states)
           are permuted so the accepted nodes come first: vLLM's DFlash context update then takes
           exactly the accepted nodes, by node index
  draft    DDTreeProposer builds the next trees.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.v1.outputs import SamplerOutput
from vllm.v1.worker.cpu_model_runner import CPUModelRunner, _torch_cuda_wrapper

from ddtree.tree import accept_walk, ancestor_mask, compaction_moves, sample_from_logits, with_root
from ddtree.vllm.attention import StepMasks, active_masks, cache_layout, move_tokens
from ddtree.vllm.config import settings_of
from ddtree.vllm.proposer import DDTreeProposer

PLACEHOLDER = -1  # vLLM's PLACEHOLDER_TOKEN_ID for unused sampled slots


@dataclass
class RequestTree:
    """The tree one request verifies this step (root included, node order as scheduled)."""
    q0: int               # first row of the request in the flattened batch
    start: int            # position of the root
    tokens: torch.Tensor  # [T]
    parents: torch.Tensor # [T]
    depths: torch.Tensor  # [T]


@dataclass
class StepPlan:
    trees: dict[int, RequestTree]  # request index -> tree (only requests with drafts)
    masks: StepMasks
    slot_mapping: torch.Tensor | None = None  # target slots of this step's rows
    paths: dict[int, list[int]] | None = None  # request index -> accepted node indices


class DDTreeCPUModelRunner(CPUModelRunner):
    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        settings = settings_of(vllm_config)
        if settings is None:
            raise ValueError("DDTreeCPUModelRunner needs additional_config['ddtree']")
        with _torch_cuda_wrapper():
            self.drafter = DDTreeProposer(vllm_config, self.device, self, settings["budget"])
        self._plan: StepPlan | None = None
        self._target_layers: dict[str, Attention] | None = None

    # ---- helpers -----------------------------------------------------------------------------
    def target_layers(self) -> dict[str, Attention]:
        if self._target_layers is None:
            self._target_layers = {m.layer_name: m for m in self.model.modules() if isinstance(m, Attention)}
        return self._target_layers

    def _stored_tree(self, req_id: str, drafts: list[int]):
        """Parents/depths of the first len(drafts) nodes of the tree proposed for req_id."""
        trees = self.drafter.last_trees
        if trees is None or req_id not in trees.req_ids:
            raise RuntimeError(f"ddtree: request {req_id} has draft tokens but no proposed tree")
        row = trees.req_ids.index(req_id)
        k = len(drafts)
        tokens = trees.tokens[row, :k].cpu()
        if tokens.tolist() != list(drafts):
            raise RuntimeError(f"ddtree: scheduled draft tokens of {req_id} differ from its tree")
        # A prefix of a topologically ordered tree is a tree.
        return tokens, trees.parents[row, :k].cpu(), trees.depths[row, :k].cpu()

    # ---- verify ------------------------------------------------------------------------------
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self._plan = None
        spec = scheduler_output.scheduled_spec_decode_tokens
        if not spec:
            return out
        num_reqs = self.input_batch.num_reqs
        q_starts = self.query_start_loc.np[: num_reqs + 1].tolist()
        trees, per_request = {}, []
        for r, req_id in enumerate(self.input_batch.req_ids[:num_reqs]):
            drafts = spec.get(req_id)
            if not drafts:
                per_request.append(None)
                continue
            tokens, parents, depths = self._stored_tree(req_id, drafts)
            q0 = q_starts[r]
            start = int(self.input_batch.num_computed_tokens_cpu[r])
            root = self.input_ids.cpu[q0:q0 + 1]
            t_full, p_full, d_full = (x[0] for x in with_root(root, tokens[None], parents[None], depths[None]))
            # Siblings share a position: start + depth.
            self.positions[q0:q0 + len(d_full)] = start + d_full.to(self.positions.dtype)
            trees[r] = RequestTree(q0, start, t_full, p_full, d_full)
            per_request.append(ancestor_mask(p_full[None], int(d_full.max()))[0])
        self._plan = StepPlan(trees, StepMasks(per_request, frozenset(self.target_layers())))
        return out

    def _model_forward(self, *args, **kwargs):
        plan = self._plan
        if plan is None or not plan.trees:
            return super()._model_forward(*args, **kwargs)
        name = next(iter(plan.masks.layer_names))
        plan.slot_mapping = get_forward_context().slot_mapping[name].clone()
        with active_masks(plan.masks):
            return super()._model_forward(*args, **kwargs)

    # ---- accept ------------------------------------------------------------------------------
    def _sample(self, logits, spec_decode_metadata):
        if spec_decode_metadata is None:
            return super()._sample(logits, spec_decode_metadata)
        plan = self._plan or StepPlan({}, StepMasks([], frozenset()))
        meta = self.input_batch.sampling_metadata
        num_reqs = len(spec_decode_metadata.num_draft_tokens)
        counts = [k + 1 for k in spec_decode_metadata.num_draft_tokens]
        width = max(counts)
        rows = torch.split(logits, counts)

        temperature = meta.temperature.cpu().float() if meta.temperature is not None else torch.zeros(num_reqs)
        top_k = meta.top_k.cpu() if meta.top_k is not None else torch.zeros(num_reqs, dtype=torch.long)
        top_p = meta.top_p.cpu().float() if meta.top_p is not None else torch.ones(num_reqs)
        out = torch.full((num_reqs, width), PLACEHOLDER, dtype=torch.int32)
        plan.paths = {}
        for r in range(num_reqs):
            tree = plan.trees.get(r)
            if tree is None:  # no drafts: one row, the next token
                tree = RequestTree(0, 0, torch.tensor([-1]), torch.zeros(1, dtype=torch.long),
                                   torch.zeros(1, dtype=torch.long))
            samples = sample_from_logits(
                rows[r][None], temperature[r:r + 1], top_k[r:r + 1], top_p[r:r + 1],
                [meta.generators.get(r)])
            max_depth = int(tree.depths.max())
            path, n, bonus = accept_walk(tree.tokens[None], tree.parents[None], tree.depths[None],
                                         samples.cpu(), max_depth)
            n = int(n[0])
            nodes = path[0, :n].tolist()
            committed = tree.tokens[nodes[1:]].tolist() + [int(bonus[0])]
            out[r, :len(committed)] = torch.tensor(committed, dtype=torch.int32)
            if r in plan.trees:
                plan.paths[r] = nodes
        self._compact_kv(plan)
        return SamplerOutput(sampled_token_ids=out.to(logits.device), logprobs_tensors=None)

    # ---- commit ------------------------------------------------------------------------------
    def _compact_kv(self, plan: StepPlan) -> None:
        """Move accepted nodes' target K/V from their tree rows to chain rows start..start+n-1."""
        src_rows, dst_rows = [], []
        for r, nodes in plan.paths.items():
            q0 = plan.trees[r].q0
            path = torch.tensor(nodes)[None]
            src, dst, needed = compaction_moves(path, torch.tensor([len(nodes)]))
            src_rows += (q0 + src[needed]).tolist()
            dst_rows += (q0 + dst[needed]).tolist()
        if not src_rows:
            return
        src = plan.slot_mapping[src_rows].long()
        dst = plan.slot_mapping[dst_rows].long()
        for layer in self.target_layers().values():
            kv = layer.kv_cache
            move_tokens(kv, cache_layout(layer.isa, kv.shape[2], layer.head_size, kv.dtype), src, dst)

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, sample_hidden_states, aux_hidden_states,
                                spec_decode_metadata, common_attn_metadata, slot_mappings):
        plan = self._plan
        if plan is not None and plan.paths:
            self._chain_order_rows(plan, aux_hidden_states)
        self._plan = None
        return super().propose_draft_token_ids(
            scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
            sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
            slot_mappings)

    def _chain_order_rows(self, plan: StepPlan, aux_hidden_states) -> None:
        """Per tree request, put the accepted nodes' rows first and give every row the chain
        position start + row: the DFlash context update keeps the first n rows (n = tokens
        accepted incl. root) and writes rejected rows past them, where they are overwritten."""
        order = torch.arange(self.positions.shape[0])
        for r, nodes in plan.paths.items():
            tree = plan.trees[r]
            T = tree.tokens.shape[0]
            rest = [i for i in range(T) if i not in set(nodes)]
            order[tree.q0:tree.q0 + T] = tree.q0 + torch.tensor(nodes + rest)
            self.positions[tree.q0:tree.q0 + T] = tree.start + torch.arange(T, dtype=self.positions.dtype)
        n = self.input_batch.num_reqs and int(self.query_start_loc.np[self.input_batch.num_reqs])
        idx = order[:n]
        ids = self.input_ids.gpu
        ids[:n] = ids[idx.to(ids.device)]
        for h in aux_hidden_states or ():
            h[:n] = h[idx.to(h.device)]
