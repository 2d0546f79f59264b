"""The engine: validates requests, schedules them, runs steps, applies stop rules."""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import torch

from ddtree.engine.auto_budget import AutoBudget, auto_candidates
from ddtree.engine.block_manager import BlockManager
from ddtree.engine.runner import GRAPH_BUCKETS, METHODS, ModelRunner
from ddtree.engine.sampling_params import SamplingParams
from ddtree.engine.scheduler import Scheduler
from ddtree.engine.sequence import Sequence, SequenceMetrics
from ddtree.models.dflash import DFlashDrafter

log = logging.getLogger("ddtree")


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    metrics: SequenceMetrics


@dataclass
class EngineConfig:
    method: str = "ddtree"
    budget: int | str = "auto"   # node budget of a DDTree, or "auto" (chosen per step)
    max_budget: int = 128        # largest tree "auto" (or a request) may use
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_gb: float = 1.0
    block_size: int = 16
    cuda_graphs: bool = True

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.budget != "auto" and (isinstance(self.budget, bool) or not isinstance(self.budget, int)
                                      or self.budget < 0):
            raise ValueError(f"budget must be an integer >= 0 or 'auto', got {self.budget!r}")
        if isinstance(self.max_budget, bool) or not isinstance(self.max_budget, int) or self.max_budget < 1:
            raise ValueError(f"max_budget must be a positive integer, got {self.max_budget!r}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb!r}")


class LLMEngine:
    def __init__(self, target, drafter, tokenizer, config: EngineConfig, device: torch.device,
                 dtype: torch.dtype):
        config.validate()
        if config.method != "ar":
            if drafter is None:
                raise ValueError(f"method {config.method!r} needs a drafter")
            if isinstance(drafter, DFlashDrafter):
                drafter.config.check_fits(target.config)
        self.config, self.tokenizer = config, tokenizer
        self.target_config = target.config
        self.max_model_len = min(config.max_model_len, target.config.max_position_embeddings)
        self.eos_token_ids = self._eos_ids(tokenizer)
        bytes_per_slot = self._bytes_per_slot(target, drafter if config.method != "ar" else None, dtype)
        num_blocks = int(config.kv_cache_gb * 2**30 // (bytes_per_slot * config.block_size))
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.drafter = drafter if config.method != "ar" else None
        self.budget_cap = config.max_budget if config.budget == "auto" else config.budget
        max_lookahead = max(ModelRunner.lookahead_for(m, self.budget_cap, drafter) for m in self._methods())
        self.runner = ModelRunner(target, self.drafter, self.blocks, device, dtype, self.max_model_len,
                                  max_lookahead, config.cuda_graphs)
        self.auto = AutoBudget(auto_candidates(self.budget_cap, self.drafter is not None),
                               lambda n: next((b for b in GRAPH_BUCKETS if b >= n), n))
        self.step_choices: Counter = Counter()  # (method, budget) run for auto requests
        need = self.max_model_len + max_lookahead
        if num_blocks * config.block_size < need:
            raise ValueError(f"kv_cache_gb={config.kv_cache_gb} holds {num_blocks * config.block_size} tokens, "
                             f"fewer than one request of max_model_len {self.max_model_len} needs ({need})")
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs,
                                   max(config.max_num_batched_tokens, 1))
        self.seqs: dict[str, Sequence] = {}

    def _methods(self) -> tuple[str, ...]:
        return METHODS if self.drafter is not None else ("ar",)

    @staticmethod
    def _eos_ids(tokenizer) -> set[int]:
        ids = set()
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        return ids

    @staticmethod
    def _bytes_per_slot(target, drafter, dtype) -> int:
        size = torch.tensor([], dtype=dtype).element_size()
        layers, heads, dim = target.kv_shape()
        total = 2 * layers * heads * dim * size
        if isinstance(drafter, DFlashDrafter):
            layers, heads, dim = drafter.kv_shape()
            total += 2 * layers * heads * dim * size
        return total

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                    request_id: str | None = None, method: str | None = None,
                    budget: int | None = None) -> Sequence:
        """Validate and queue one request. A bad request raises ValueError and changes nothing.
        ``method``/``budget`` override the engine's speculative settings for this request."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        if not isinstance(prompt_token_ids, list) or len(prompt_token_ids) == 0:
            raise ValueError("prompt is empty")
        vocab = self.target_config.vocab_size
        for t in prompt_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens, longer than the context: "
                             f"max_model_len is {self.max_model_len} (prompt + at least 1 output token)")
        if request_id is not None and request_id in self.seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        method = self.config.method if method is None else method
        budget = self.config.budget if budget is None else budget
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if method not in self._methods():
            raise ValueError(f"method {method!r} needs a drafter; this engine runs without one")
        if budget != "auto" and (isinstance(budget, bool) or not isinstance(budget, int)
                                 or not 0 <= budget <= self.budget_cap):
            raise ValueError(f"budget must be 'auto' or an integer in [0, {self.budget_cap}] (the engine's "
                             f"largest budget), got {budget!r}")
        if budget == "auto" and method != "ddtree":
            budget = 0  # "auto" chooses among trees; the other methods have no budget
        seq = Sequence(prompt_token_ids, params, prompt=prompt, request_id=request_id,
                       method=method, budget=budget)
        if self.tokenizer is not None:
            seq.decode_fn = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            seq.finish_reason = "abort"
            self.scheduler.finish(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- stepping ----------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one prefill or decode step; returns the sequences that made progress."""
        kind, seqs, chunks = self.scheduler.schedule(
            lambda s: self.runner.lookahead(s.method, self.budget_cap if s.budget == "auto" else s.budget))
        if kind == "prefill":
            self.runner.prefill(seqs, chunks)
            return []
        if kind == "idle":
            return []
        groups: dict[tuple[str, int | str], list[Sequence]] = {}
        for seq in seqs:  # one verify pass per speculative setting
            groups.setdefault((seq.method, seq.budget), []).append(seq)
        committed = {}
        for (method, budget), group in groups.items():
            committed.update(zip((s.seq_id for s in group), self._decode(group, method, budget)))
        for seq in seqs:
            tokens = committed[seq.seq_id]
            self._append(seq, tokens)
            if seq.is_finished:
                self.scheduler.finish(seq)
                self.seqs.pop(seq.request_id, None)
        return seqs

    def draft_tokens(self, method: str, budget: int) -> int:
        """Draft tokens one verify step checks: tree nodes, the chain's block - 1, or 0."""
        if method == "ddtree":
            return budget
        return self.drafter.block_size - 1 if method == "dflash" else 0

    def _decode(self, group: list[Sequence], method: str, budget) -> list[list[int]]:
        out = self._decode_group(group, method, budget)
        drafted = self.draft_tokens(*self.runner.last_step)
        for seq in group:
            seq.metrics.draft_tokens.append(drafted)
        return out

    def _decode_group(self, group: list[Sequence], method: str, budget) -> list[list[int]]:
        if budget != "auto":
            return self.runner.decode(group, method, budget)
        method, budget = cand = self.auto.choose(len(group))
        self.step_choices[cand] += 1
        graphs_before = len(self.runner.graphs)
        t0 = time.perf_counter()
        out = self.runner.decode(group, method, budget, store_context=True)
        seconds = time.perf_counter() - t0
        # A capture is not a step's cost (prefill steps are timed apart: the runner's timer syncs).
        timed = len(self.runner.graphs) == graphs_before
        self.auto.observe(len(group), cand, seconds if timed else None, sum(map(len, out)) / len(group))
        return out

    def profile_auto(self, batch_sizes=None, sampling: bool = False) -> dict:
        """Start-up cost curve for ``budget="auto"``: capture every candidate's step graph for the
        batch buckets and time its replay (CUDA only; elsewhere costs come from real steps).
        sampling=True also captures the graphs sampled batches use, so no capture stalls a step."""
        if not self.runner.use_graphs:
            return {}
        top = self.auto.bucket_of(self.config.max_num_seqs)
        for n in batch_sizes or [b for b in GRAPH_BUCKETS if b <= top]:
            bucket = self.auto.bucket_of(n)
            for cand in self.auto.candidates:
                self.auto.prior[(bucket, cand)] = self.runner.time_graph(*cand, bucket, greedy=True)
                if sampling:
                    self.runner.time_graph(*cand, bucket, greedy=False, reps=1)
        return dict(self.auto.prior)

    def _append(self, seq: Sequence, tokens: list[int]) -> None:
        """Commit tokens one by one, stopping at the first stop condition (never past max_tokens)."""
        p = seq.params
        added = 0
        for tok in tokens:
            seq.token_ids.append(tok)
            added += 1
            if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
                seq.finish_reason = "stop"
            elif seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
                seq.finish_reason = "length"
            if seq.finish_reason:
                break
        seq.metrics.num_verify_steps += 1
        seq.metrics.accepted_lengths.append(added)
        if self.tokenizer is not None and seq.params.stop:
            self._detokenize(seq)
        if seq.finish_reason:
            seq.status = seq.status.FINISHED

    def _detokenize(self, seq: Sequence) -> None:
        text = seq.text
        stops = seq.params.stop
        if stops:
            hits = [text.find(s) for s in stops if s in text]
            if hits:
                cut = min(hits)
                text = text[:cut]
                # Drop tokens past the one that completed the stop string.
                out = seq.output_token_ids
                for n in range(1, len(out) + 1):
                    if any(s in self.tokenizer.decode(out[:n], skip_special_tokens=True) for s in stops):
                        del seq.token_ids[seq.num_prompt_tokens + n:]
                        break
                seq.finish_reason = "stop"
        seq.text = text

    def output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(seq.request_id, seq.prompt, seq.token_ids[:seq.num_prompt_tokens], seq.text,
                             seq.output_token_ids, seq.is_finished, seq.finish_reason, seq.metrics)
