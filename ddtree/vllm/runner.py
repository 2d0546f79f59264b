"""vLLM model runners with DDTree verification, on vLLM's V1 ("legacy") runner family: the CPU
backend's runner and, for CUDA, the V1 GPU runner (not verified on a GPU: see the README).

One engine step, for every request that got a draft tree in the previous step:
  verify   the scheduler sends root + tree nodes as "spec tokens"; positions are rewritten to
           start + depth and the target's attention uses the ancestor mask (attention.py)
  accept   the acceptance walk of `ddtree.tree.accept_walk` (greedy or sampling), one depth at
           a time, with target logits computed only for the nodes it visits;
           the accepted tokens + bonus go back to vLLM like the rejection sampler's output,
           so the scheduler's num_computed_tokens rollback stays right
  commit   accepted nodes' target K/V are moved into chain order (start, start+1, ...), and the
           rows the drafter reads its context from (token ids, positions, tapped hidden states)
           are permuted so the accepted nodes come first: vLLM's DFlash context update then takes
           exactly the accepted nodes, by node index
  draft    DDTreeProposer builds the next trees.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.worker.cpu_model_runner import CPUModelRunner, _torch_cuda_wrapper
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from ddtree.tree import (Processing, ancestor_mask, compaction_moves, process_tree_logits, sample_from_logits,
                         with_root)
from ddtree.vllm.attention import StepMasks, active_masks, cache_layout, move_tokens, move_tokens_logical
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
    defer_logits: bool = False     # the next compute_logits call returns its hidden states
    logits_deferred: bool = False  # ... and it did: _sample gets hidden states, not logits


class DDTreeRunnerMixin:
    """The DDTree step on top of a vLLM V1 runner (GPUModelRunner or its CPU subclass). A runner
    class adds `_move_kv(layer, src, dst)` for its KV cache layout."""

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        settings = settings_of(vllm_config)
        if settings is None:
            raise ValueError(f"{type(self).__name__} needs additional_config['ddtree']")
        with self._proposer_setup():
            self.drafter = DDTreeProposer(vllm_config, self.device, self, settings["budget"])
        self._plan: StepPlan | None = None
        self._target_layers: dict[str, Attention] | None = None

    def _proposer_setup(self):
        return contextlib.nullcontext()

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
            out = super()._model_forward(*args, **kwargs)
        self._defer_next_logits()
        return out

    # ---- accept ------------------------------------------------------------------------------
    def _defer_next_logits(self) -> None:
        """Make the runner's next compute_logits call (the one right after this verify forward)
        hand back its hidden states unchanged: _sample computes logits only for the nodes the
        acceptance walk visits (about tau rows instead of every tree node; the LM head is one of
        the largest matmuls of a CPU step)."""
        model = self.model
        if not getattr(model, "_ddtree_deferrable", False):
            original = model.compute_logits
            runner = self

            def compute_logits(hidden_states, *args, **kwargs):
                plan = runner._plan
                if plan is not None and plan.defer_logits and not args and not kwargs:
                    plan.defer_logits, plan.logits_deferred = False, True
                    return hidden_states
                return original(hidden_states, *args, **kwargs)

            model.compute_logits = compute_logits
            model._ddtree_deferrable = True
            self._compute_logits = original
        self._plan.defer_logits = True

    def _sample(self, logits, spec_decode_metadata):
        if spec_decode_metadata is None:
            return super()._sample(logits, spec_decode_metadata)
        plan = self._plan or StepPlan({}, StepMasks([], frozenset()))
        if plan.logits_deferred:  # `logits` holds the sampled rows' hidden states
            logits_of = lambda rows: self._compute_logits(logits[rows])  # noqa: E731
        else:
            logits_of = lambda rows: logits[rows]  # noqa: E731
        plan.defer_logits = plan.logits_deferred = False
        meta = self.input_batch.sampling_metadata
        num_reqs = len(spec_decode_metadata.num_draft_tokens)
        counts = [k + 1 for k in spec_decode_metadata.num_draft_tokens]
        firsts = [0]
        for c in counts[:-1]:
            firsts.append(firsts[-1] + c)
        device = logits.device
        temperature = meta.temperature.float() if meta.temperature is not None else torch.zeros(num_reqs)
        top_k = meta.top_k if meta.top_k is not None else torch.zeros(num_reqs, dtype=torch.long)
        top_p = meta.top_p.float() if meta.top_p is not None else torch.ones(num_reqs)
        temperature, top_k, top_p = (x[:num_reqs].to(device) for x in (temperature, top_k, top_p))
        all_greedy = bool((temperature <= 0).all())

        # The acceptance walk (ddtree.tree.accept_walk), one depth per round: every request
        # still walking draws one target sample at its current node (argmax at T=0, else its
        # sampling rule) and moves to the child carrying that token, if any. Only the visited
        # nodes' logits are computed, one batched LM-head call per round.
        children = [self._children(plan.trees.get(r)) for r in range(num_reqs)]
        tokens = [plan.trees[r].tokens.tolist() if r in plan.trees else [] for r in range(num_reqs)]
        paths = [[0] for _ in range(num_reqs)]
        committed: list[list[int]] = [[] for _ in range(num_reqs)]
        active = list(range(num_reqs))
        processed = {r: p for r in range(num_reqs) if (p := self._processing_params(r)) is not None}
        visited_logits: list[list[torch.Tensor]] = [[] for _ in range(num_reqs)]  # raw, for logprobs
        while active:
            rows = torch.tensor([firsts[r] + paths[r][-1] for r in active], device=device)
            idx = torch.tensor(active, device=device)
            node_logits = logits_of(rows)
            if meta.max_num_logprobs is not None:
                for i, r in enumerate(active):
                    visited_logits[r].append(node_logits[i])
            if processed:
                node_logits = self._process(node_logits, active, paths, tokens, processed)
            samples = sample_from_logits(
                node_logits[:, None, :], temperature[idx], top_k[idx], top_p[idx],
                [meta.generators.get(r) for r in active], all_greedy=all_greedy)[:, 0].tolist()
            walking = []
            for r, sample in zip(active, samples):
                child = children[r].get((paths[r][-1], sample))
                if child is None:  # the sample is the bonus token
                    committed[r] = [tokens[r][n] for n in paths[r][1:]] + [sample]
                else:
                    paths[r].append(child)
                    walking.append(r)
            active = walking

        width = max(counts)
        out = torch.full((num_reqs, width), PLACEHOLDER, dtype=torch.int32)
        for r, toks in enumerate(committed):
            out[r, :len(toks)] = torch.tensor(toks, dtype=torch.int32)
        plan.paths = {r: paths[r] for r in plan.trees}
        self._compact_kv(plan)
        logprobs = None
        if meta.max_num_logprobs is not None:
            logprobs = self._logprobs(visited_logits, committed, width, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=out.to(logits.device), logprobs_tensors=logprobs)

    def _logprobs(self, visited_logits, committed, width, num_logprobs) -> LogprobsTensors:
        """vLLM's logprobs tensors for the committed tokens, laid out like the rejection
        sampler's ([requests x width] rows, placeholder rows filtered out by vLLM): committed token
        j of a request was drawn at the j-th node its walk visited, so its row is that node's raw
        logits."""
        first = next(row for rows in visited_logits for row in rows)
        flat = torch.zeros(len(committed) * width, first.shape[-1], dtype=torch.float32, device=first.device)
        token_ids = torch.zeros(len(committed) * width, dtype=torch.int64, device=first.device)
        for r, toks in enumerate(committed):
            flat[r * width:r * width + len(toks)] = torch.stack(visited_logits[r]).float()
            token_ids[r * width:r * width + len(toks)] = torch.tensor(toks)
        if self.sampler.logprobs_mode == "raw_logprobs":
            flat = self.sampler.compute_logprobs(flat)
        if num_logprobs == -1:  # the full vocabulary, unsorted (vLLM's layout for -1)
            return LogprobsTensors(torch.empty(0), flat, torch.empty(0))
        return self.sampler.gather_logprobs(flat, num_logprobs, token_ids)

    def _processing_params(self, r: int):
        """The SamplingParams of batch row r if its logits need processing (penalties,
        logit_bias, min_tokens, min_p, allowed_token_ids, bad_words), else None."""
        params = self.requests[self.input_batch.req_ids[r]].sampling_params
        if params is None or not (params.presence_penalty or params.frequency_penalty or params.logit_bias
                                  or params.min_tokens or params.repetition_penalty not in (None, 1.0)
                                  or (params.min_p and params.temperature > 0)
                                  or params.allowed_token_ids is not None or params.bad_words_token_ids):
            return None
        return params

    def _process(self, logits, active, paths, tokens, processed):
        """vLLM's logits processing of each visited node for its own prefix: the request's output
        tokens (the root, last of them, included) plus the tree tokens on the node's path, which
        the walk commits only if the node is accepted (ddtree.tree.processing)."""
        picks = [i for i, r in enumerate(active) if r in processed]
        if not picks:
            return logits
        reqs = [active[i] for i in picks]
        params = [processed[r] for r in reqs]
        outputs = [list(self.input_batch.req_output_token_ids[r]) + [tokens[r][n] for n in paths[r][1:]]
                   for r in reqs]
        prompts = [self.requests[self.input_batch.req_ids[r]].prompt_token_ids or [] for r in reqs]
        p = Processing.build(
            outputs, prompts, [sp.logit_bias for sp in params], [sp.repetition_penalty for sp in params],
            [sp.frequency_penalty for sp in params], [sp.presence_penalty for sp in params],
            [(sp.min_tokens or 0) - len(out) for sp, out in zip(params, outputs)],
            [sorted(sp.all_stop_token_ids) for sp in params], logits.shape[-1], logits.device,
            min_p=[sp.min_p for sp in params], temperature=[sp.temperature for sp in params],
            allowed=[sp.allowed_token_ids for sp in params], bad_words=[sp.bad_words_token_ids for sp in params])
        at = torch.tensor(picks, device=logits.device)
        depth0 = torch.zeros(len(picks), 1, dtype=torch.long, device=logits.device)
        out = process_tree_logits(logits[at][:, None, :], depth0, depth0, None, p)[:, 0]
        return logits.float().index_copy(0, at, out)

    @staticmethod
    def _children(tree: RequestTree | None) -> dict[tuple[int, int], int]:
        """(parent node, token) -> child node; siblings carry distinct tokens."""
        if tree is None:
            return {}
        toks, parents = tree.tokens.tolist(), tree.parents.tolist()
        return {(parents[i], toks[i]): i for i in range(1, len(toks))}

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
        slots = plan.slot_mapping
        src = slots[torch.tensor(src_rows, device=slots.device)].long()
        dst = slots[torch.tensor(dst_rows, device=slots.device)].long()
        for layer in self.target_layers().values():
            self._move_kv(layer, src, dst)  # the runner class's cache layout

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
        order = torch.arange(self.positions.shape[0], device=self.positions.device)
        for r, nodes in plan.paths.items():
            tree = plan.trees[r]
            T = tree.tokens.shape[0]
            rest = [i for i in range(T) if i not in set(nodes)]
            order[tree.q0:tree.q0 + T] = tree.q0 + torch.tensor(nodes + rest, device=order.device)
            self.positions[tree.q0:tree.q0 + T] = tree.start + torch.arange(
                T, dtype=self.positions.dtype, device=self.positions.device)
        n = self.input_batch.num_reqs and int(self.query_start_loc.np[self.input_batch.num_reqs])
        idx = order[:n]
        ids = self.input_ids.gpu
        ids[:n] = ids[idx.to(ids.device)]
        for h in aux_hidden_states or ():
            h[:n] = h[idx.to(h.device)]


class DDTreeCPUModelRunner(DDTreeRunnerMixin, CPUModelRunner):
    def _proposer_setup(self):
        return _torch_cuda_wrapper()

    def _move_kv(self, layer, src, dst):
        """Copy the K/V of cache slots src to slots dst in one target layer."""
        kv = layer.kv_cache  # the CPU kernel's layout depends on its ISA: read off the kernel
        move_tokens(kv, cache_layout(layer.isa, kv.shape[2], layer.head_size, kv.dtype), src, dst)


class DDTreeGPUModelRunner(DDTreeRunnerMixin, GPUModelRunner):
    """V1 GPU runner + DDTree (FlashAttention / Triton backends: logical [blocks, kv_heads,
    block_size, 2 * head] caches). Written against vLLM 0.32.0's V1 runner; not run on a GPU here."""

    def _move_kv(self, layer, src, dst):
        move_tokens_logical(layer.kv_cache, src, dst)
