"""The engine: validates requests, schedules them, runs steps, applies stop rules."""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import torch

from ddtree.engine.auto_budget import PLAIN, AutoBudget, auto_candidates
from ddtree.engine.block_manager import BlockManager
from ddtree.engine.runner import (CATCH_UP_BUCKETS, GRAPH_BUCKETS, METHODS, PREFILL_BUCKETS,
                                  PREFILL_SEQ_BUCKETS, Launched, ModelRunner)
from ddtree.engine.sampling_params import SamplingParams
from ddtree.engine.scheduler import Scheduler
from ddtree.engine.sequence import Sequence, SequenceMetrics
from ddtree.models.dflash import DFlashDrafter

log = logging.getLogger("ddtree")

# A round launched behind one that finishes every sequence is wasted and delays what comes next
# by a whole round; hold it back when at least 1 in ENDS_SOON_ODDS of a sequence's last
# ENDS_SOON_WINDOW rounds would have finished it. A wrong hold costs the host's gap between two
# rounds: ~0.3 ms against ~1.2 ms for a dropped round at c=1 on an H100 (README "Held rounds").
# 1 in 20 guesses wrong often (74 holds for 32 requests, 42 wrong) and still gained 1-2 % there;
# a 1-in-4 version that looked for EOS ahead in the drafter's logits dropped fewer rounds but
# lost 1-2 % (its extra read of the logits every round cost more than it saved).
ENDS_SOON_ODDS, ENDS_SOON_WINDOW = 20, 32


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
    # params.logprobs set: per output token (its logprob, [(token, logprob)] of the most likely)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # params.prompt_logprobs set: the same for prompt tokens 1.. (the first has none)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


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
    # Launch the next decode round before reading the current one (the host's bookkeeping then
    # overlaps the GPU's work). None: on wherever rounds are CUDA graphs.
    overlap_steps: bool | None = None
    # Under load, a request joining a running batch waits until a group can join or this many
    # rounds have passed (see Scheduler); 0 admits at once.
    join_wait_rounds: int = 8

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
        if self.overlap_steps not in (None, True, False):
            raise ValueError(f"overlap_steps must be true, false or null, got {self.overlap_steps!r}")
        if isinstance(self.join_wait_rounds, bool) or not isinstance(self.join_wait_rounds, int) \
                or self.join_wait_rounds < 0:
            raise ValueError(f"join_wait_rounds must be an integer >= 0, got {self.join_wait_rounds!r}")
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
        # Plain rounds under budget="auto" defer the drafter's context (ModelRunner.catch_up).
        defer_context = config.budget == "auto" and config.method != "ar" and isinstance(drafter, DFlashDrafter)
        bytes_per_slot = self._bytes_per_slot(target, drafter if config.method != "ar" else None, dtype,
                                              defer_context)
        num_blocks = int(config.kv_cache_gb * 2**30 // (bytes_per_slot * config.block_size))
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.drafter = drafter if config.method != "ar" else None
        self.budget_cap = config.max_budget if config.budget == "auto" else config.budget
        max_lookahead = max(ModelRunner.lookahead_for(m, self.budget_cap, drafter) for m in self._methods())
        self.runner = ModelRunner(target, self.drafter, self.blocks, device, dtype, self.max_model_len,
                                  max_lookahead, config.cuda_graphs, defer_context)
        self.runner.eos_token_ids = self.eos_token_ids
        self.auto = AutoBudget(auto_candidates(self.budget_cap, self.drafter is not None),
                               lambda n: next((b for b in GRAPH_BUCKETS if b >= n), n))
        self.step_choices: Counter = Counter()  # (method, budget) run for auto requests
        self.auto_trace: list | None = None  # set to [] to record every round (ddtree bench --auto-trace)
        need = self.max_model_len + max_lookahead
        if num_blocks * config.block_size < need:
            raise ValueError(f"kv_cache_gb={config.kv_cache_gb} holds {num_blocks * config.block_size} tokens, "
                             f"fewer than one request of max_model_len {self.max_model_len} needs ({need})")
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs,
                                   max(config.max_num_batched_tokens, 1), config.join_wait_rounds)
        self.seqs: dict[str, Sequence] = {}
        overlap = config.overlap_steps
        self.overlap_steps = self.runner.use_graphs if overlap is None else overlap
        self._inflight: Launched | None = None   # a launched round not read yet
        self._last_read = 0.0                     # when the previous round was read
        self._drained: list[Sequence] = []        # progress read outside step() (an abort)
        self.overlapped_rounds = 0                # rounds launched behind an unread one
        self.held_rounds = 0      # not launched behind one: every sequence probably ended in it
        self.dropped_rounds = 0   # launched behind one, and every sequence ended before it

    def _methods(self) -> tuple[str, ...]:
        return METHODS if self.drafter is not None else ("ar",)

    @staticmethod
    def _eos_ids(tokenizer) -> set[int]:
        ids = set()
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        return ids

    @staticmethod
    def _bytes_per_slot(target, drafter, dtype, tap_cache: bool = False) -> int:
        size = torch.tensor([], dtype=dtype).element_size()
        layers, heads, dim = target.kv_shape()
        total = 2 * layers * heads * dim * size
        if isinstance(drafter, DFlashDrafter):
            layers, heads, dim = drafter.kv_shape()
            total += 2 * layers * heads * dim * size
            if tap_cache:
                total += len(drafter.taps) * target.config.hidden_size * size
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
        for t in params.logit_bias or ():
            if t >= vocab:
                raise ValueError(f"logit_bias token id {t} is outside the vocabulary [0, {vocab})")
        for t in params.allowed_token_ids or ():
            if t >= vocab:
                raise ValueError(f"allowed_token_ids token id {t} is outside the vocabulary [0, {vocab})")
        bad_words = self.bad_words_token_ids(params.bad_words) if params.bad_words else None
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
        seq.bad_words_token_ids = bad_words
        seq.lookahead = self.runner.lookahead(method, self.budget_cap if budget == "auto" else budget)
        if self.tokenizer is not None:
            seq.decode_fn = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens as it would start the text and, where they differ, after a space
        (as vLLM does: a word is banned at the start and inside the text)."""
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer; this engine runs without one")
        out = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def abort(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if self._inflight is not None and seq in self._inflight.seqs:
            # Read the round in flight first: its other sequences keep their tokens, and nothing
            # touches the aborted request's blocks after they are freed.
            inflight, self._inflight = self._inflight, None
            self._drained += self._read(inflight)
        if seq is not None and not seq.is_finished:
            seq.finish_reason = "abort"
            self.scheduler.finish(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None or bool(self._drained)

    # ---- stepping ----------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one prefill or decode step; returns the sequences that made progress.
        With overlapped steps a decode step launches the next round (when the batch stays the
        same) before it reads the current one; a step then returns the current one's progress."""
        if self._drained:
            drained, self._drained = self._drained, []
            return drained
        if self._inflight is not None:
            inflight = self._inflight
            self._inflight = self._launch_after(inflight)
            return self._read(inflight)
        kind, seqs, chunks = self.scheduler.schedule()
        if kind == "prefill":
            self.runner.prefill(seqs, chunks)
            return []
        if kind == "idle":
            return []
        groups: dict[tuple[str, int | str], list[Sequence]] = {}
        for seq in seqs:  # one verify pass per speculative setting
            groups.setdefault((seq.method, seq.budget), []).append(seq)
        if self.overlap_steps and len(groups) == 1 and self.runner.can_launch_after(seqs):
            (method, budget), = groups
            first = self._launch(seqs, method, budget)
            self._inflight = self._launch_after(first)
            return self._read(first)
        progressed = []
        for (method, budget), group in groups.items():
            progressed += self._read(self._launch(group, method, budget))
        return progressed

    def _launch(self, seqs: list[Sequence], method: str, budget, after: Launched | None = None) -> Launched:
        auto = budget == "auto"
        if auto:
            method, budget = cand = self.auto.choose(len(seqs), fresh=after is None)
            self.step_choices[cand] += 1
        graphs_before = self.runner.num_captured
        self.scheduler.rounds += 1
        started = time.perf_counter()
        launched = self.runner.launch(seqs, method, budget, store_context=auto, after=after)
        launched.started, launched.by_auto = started, auto
        launched.timed = self.runner.num_captured == graphs_before  # a capture is not a step's cost
        return launched

    def _launch_after(self, prev: Launched) -> Launched | None:
        """The next round for the same batch, launched before ``prev`` is read, when nothing else
        is due: no request joining (``Scheduler.admits``), every sequence still running with
        room for both rounds (blocks reserved here) within max_model_len. A sequence that
        finishes within ``prev`` (a stop token, EOS or max_tokens) drops this round's tokens, as
        an aborted one does: not
        launching whenever some sequence might reach max_tokens within ``prev`` left most
        speculative rounds at batch >= 4 without overlap once lengths differ (in an H200 trace at
        concurrency 16, 175 of 204 8-node-tree rounds ran unoverlapped, ~0.3 ms slower each)."""
        seqs = prev.seqs
        if (self.scheduler.admits() or len(self.scheduler.running) != len(seqs)
                or any(s.is_finished for s in seqs)):
            return None
        if all(map(self._ends_soon, seqs)):
            # Every sequence probably ends within ``prev``: a round behind it would be dropped, and
            # the next request's prefill would wait for it on the stream (~1.2 ms of its time to
            # first token on an H100, ~4 % of a 128-token DDTree request at concurrency 1). Held,
            # it costs the host's gap between reading ``prev`` and launching it (~0.3 ms) only
            # when the guess was wrong.
            self.held_rounds += 1
            return None
        # One group: every sequence has the same method, budget and lookahead.
        slots = self.runner.lookahead(prev.kind.method, prev.kind.budget) + seqs[0].lookahead - 1
        lengths = [len(s.token_ids) for s in seqs]
        if max(lengths) + slots >= self.max_model_len:
            return None
        # All or none: each alone fitting the free blocks is not enough.
        if sum(self.blocks.blocks_needed(s, n + slots) for s, n in zip(seqs, lengths)) > self.blocks.num_free:
            return None
        if not self.runner.can_launch_after(seqs):
            return None
        for s, n in zip(seqs, lengths):
            self.blocks.reserve(s, n + slots)
        self.overlapped_rounds += 1
        return self._launch(seqs, seqs[0].method, seqs[0].budget, after=prev)

    def _ends_soon(self, seq: Sequence) -> bool:
        """Whether the round in flight for ``seq`` (launched, not read) probably finishes it: the
        last read round saw EOS in its tree (``Sequence.stop_ahead``), or at least one round in
        twenty of its recent ones committed the tokens it has left (max_tokens or the context)."""
        p = seq.params
        if seq.stop_ahead and not p.ignore_eos:
            return True
        left = min(p.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq))
        recent = seq.metrics.accepted_lengths[-ENDS_SOON_WINDOW:]
        if not recent:
            return left <= 1
        return sum(n >= left for n in recent) * ENDS_SOON_ODDS > len(recent)

    def _read(self, launched: Launched) -> list[Sequence]:
        """Read a launched round and commit its tokens; sequences that finished or were aborted
        meanwhile drop theirs. Returns the sequences that made progress."""
        out = self.runner.finish(launched)
        now = time.perf_counter()
        drafted = self.draft_tokens(launched.kind.method, launched.kind.budget)
        progressed = []
        logprobs = launched.token_logprobs or [None] * len(out)
        if launched.after and all(seq.is_finished for seq in launched.seqs):
            self.dropped_rounds += 1
        for seq, tokens, lps in zip(launched.seqs, out, logprobs):
            if seq.is_finished:
                continue
            seq.metrics.draft_tokens.append(drafted)
            self._append(seq, tokens, lps)
            progressed.append(seq)
            if seq.is_finished:
                self.scheduler.finish(seq)
                self.seqs.pop(seq.request_id, None)
        if progressed and (launched.by_auto or self.auto_trace is not None):
            # A round launched behind another costs the time between their reads.
            seconds = now - (self._last_read if launched.after else launched.started) if launched.timed else None
            if seconds is not None and launched.behind_prefill is not None:  # not the prefill's rest
                seconds = min(seconds, launched.seconds_behind_prefill())
            cand, tokens_per_seq = (launched.kind.method, launched.kind.budget), sum(map(len, out)) / len(out)
            fresh = not launched.after
            if launched.by_auto:
                # A speculative round launched behind this plain one: its preparation (and the
                # drafter's catch-up) ran before this read, and is the switch's cost.
                nxt = self._inflight
                switch = cand == PLAIN and nxt is not None and nxt.after and nxt.kind.method != "ar"
                self.auto.observe(len(launched.seqs), cand, seconds, tokens_per_seq, fresh=fresh, switch=switch)
            if self.auto_trace is not None:  # every round, so plain decoding's can be compared
                entry = {"t": now, "n": len(launched.seqs), "cand": f"{cand[0]}:{cand[1]}", "s": seconds,
                         "tau": tokens_per_seq, "after": launched.after}
                if (launched.by_auto and len(self.auto_trace) % 16 == 0
                        and self.auto.best(len(launched.seqs), fresh) is not None):
                    bucket = self.auto.bucket_of(len(launched.seqs))
                    entry["rates"] = {f"{m}:{b}": r for (m, b), r in self.auto.rates(bucket, fresh).items()}
                    entry["costs"] = {f"{m}:{b}": self.auto.step_cost(bucket, (m, b), fresh)
                                      for m, b in self.auto.candidates}
                self.auto_trace.append(entry)
            if launched.by_auto and launched.kind.method == "ddtree":  # what each smaller tree would have accepted
                for method, b in self.auto.candidates:
                    if method == "ddtree" and b < launched.kind.budget:
                        self.auto.observe_tau((method, b), sum(1 + sum(j <= b for j in nodes)
                                                               for nodes in launched.path_nodes) / len(out),
                                              sequences=len(out))
        self._last_read = now
        return progressed

    def draft_tokens(self, method: str, budget: int) -> int:
        """Draft tokens one verify step checks: tree nodes, the chain's block - 1, or 0."""
        if method == "ddtree":
            return budget
        return self.drafter.block_size - 1 if method == "dflash" else 0

    def capture_graphs(self, rounds, modes=("greedy",), max_batch: int | None = None) -> None:
        """Capture up front every graph a step may replay for ``rounds`` ((method, budget,
        store_context) each; a fixed method's rounds do not store the drafter's context, auto's
        do): each batch bucket up to ``max_batch`` (default max_num_seqs), each key bound, each
        sampling mode of ``modes`` ("greedy", "sample", "filtered"), and the prefill and catch-up
        steps. A graph captured when a round first needs it stalls every request in flight: in an
        H100 grid (2026-12-07) fixed-budget runs captured key-bound graphs mid-run as their
        sequences grew past the warm-up's, and lost up to 13 %. CUDA graphs only."""
        if not self.runner.use_graphs:
            return

        def up_to(buckets, limit):  # the buckets a value <= limit can fall in
            return [b for i, b in enumerate(buckets) if i == 0 or buckets[i - 1] < limit]

        for tokens in up_to(PREFILL_BUCKETS, self.config.max_num_batched_tokens):
            for seqs in up_to(PREFILL_SEQ_BUCKETS, self.config.max_num_seqs):
                if seqs <= tokens:
                    self.runner.prefill_graph(tokens, seqs)
        if self.runner.tap_cache is not None:  # the catch-ups of deferred drafter context
            for tokens in CATCH_UP_BUCKETS:
                self.runner.catch_up_graph(tokens)
        for bucket in up_to(GRAPH_BUCKETS, max_batch or self.config.max_num_seqs):
            for method, budget, store_context in rounds:
                for max_keys in self.runner.key_bounds(bucket):
                    for mode in modes:
                        self.runner.round_graph(method, budget, bucket, mode, max_keys, store_context)

    def profile_auto(self, batch_sizes=None, modes=("greedy",)) -> dict:
        """Start-up cost curve for ``budget="auto"``: capture every candidate's step graphs
        (``capture_graphs``, in the sampling ``modes`` requests will use) and time each batch
        bucket's replay (CUDA only; elsewhere costs come from real steps)."""
        if not self.runner.use_graphs:
            return {}
        self.capture_graphs([(method, budget, True) for method, budget in self.auto.candidates], modes,
                            max(batch_sizes) if batch_sizes else None)
        top = self.auto.bucket_of(self.config.max_num_seqs)
        for n in batch_sizes or [b for b in GRAPH_BUCKETS if b <= top]:
            bucket = self.auto.bucket_of(n)
            for cand in self.auto.candidates:
                self.auto.prior[(bucket, cand)] = self.runner.time_graph(*cand, bucket, greedy=True)
        return dict(self.auto.prior)

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list | None = None) -> None:
        """Commit tokens one by one, stopping at the first stop condition (never past max_tokens)."""
        p = seq.params
        added = 0
        for tok in tokens:
            seq.token_ids.append(tok)
            if seq.logprobs is not None:
                seq.logprobs.append(logprobs[added])
            added += 1
            # (the first min_tokens tokens cannot be these: their logits were blocked)
            if seq.num_output_tokens > p.min_tokens and (
                    (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids):
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
        stops, min_tokens = seq.params.stop, seq.params.min_tokens
        out = seq.output_token_ids
        if stops and len(out) > min_tokens:
            # As vLLM: a stop string counts once it ends past the first min_tokens tokens' text.
            floor = len(self.tokenizer.decode(out[:min_tokens], skip_special_tokens=True)) if min_tokens else 0

            def first_stop(t: str) -> int | None:
                hits = [i for s in stops if (i := t.find(s, max(0, floor - len(s) + 1))) >= 0]
                return min(hits) if hits else None

            cut = first_stop(text)
            if cut is not None:
                if seq.params.include_stop_str_in_output:  # the first listed stop string found there
                    text = text[:cut + next(len(s) for s in stops if text.startswith(s, cut))]
                else:
                    text = text[:cut]
                # Drop tokens past the one that completed the stop string.
                for n in range(min_tokens + 1, len(out) + 1):
                    if first_stop(self.tokenizer.decode(out[:n], skip_special_tokens=True)) is not None:
                        del seq.token_ids[seq.num_prompt_tokens + n:]
                        if seq.logprobs is not None:
                            del seq.logprobs[n:]
                        break
                seq.finish_reason = "stop"
        seq.text = text

    def output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(seq.request_id, seq.prompt, seq.token_ids[:seq.num_prompt_tokens], seq.text,
                             seq.output_token_ids, seq.is_finished, seq.finish_reason, seq.metrics,
                             None if seq.logprobs is None else list(seq.logprobs),
                             None if seq.prompt_logprobs is None else list(seq.prompt_logprobs))
