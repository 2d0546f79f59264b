from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from ddtree.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SequenceMetrics:
    num_verify_steps: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # tokens committed per verify step
    draft_tokens: list[int] = field(default_factory=list)      # tree nodes verified per step (0: ar)

    @property
    def mean_accepted_length(self) -> float:
        return sum(self.accepted_lengths) / max(1, len(self.accepted_lengths))


_ids = itertools.count()
CONTEXT_PENDING = -1


class Sequence:
    """One request. ``token_ids`` = prompt + committed output. Invariant while running:
    the target KV (and drafter context) cover the first ``num_cached`` tokens; decode steps run
    with ``num_cached == len(token_ids) - 1`` (the last committed token is the next root)."""

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                 request_id: str | None = None, method: str = "ar", budget: int = 0):
        self.seq_id = next(_ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.prompt = prompt
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.method, self.budget = method, budget  # speculative settings of this request
        self.lookahead = 1  # cache slots one verify step writes past the prefix (set by the engine)
        self.status = Status.WAITING
        self.waiting_since = 0  # the scheduler's round count when it (re)entered the queue
        self.num_cached = 0
        self.block_table: list[int] = []
        # First position whose drafter context is only in the runner's tap cache (the prefill and
        # plain-decoding rounds under budget="auto" defer it); None: none is; CONTEXT_PENDING: the
        # position of the round launched behind an unread one, set when that one is read.
        self.context_from: int | None = None
        self.finish_reason: str | None = None
        # The last read round drafted (or the target predicted) EOS somewhere in its tree.
        self.stop_ahead = False
        self.error: str | None = None
        self._text, self._text_for = "", 0
        self.decode_fn = None  # token ids -> text; set by the engine when it has a tokenizer
        self.metrics = SequenceMetrics()
        self.generator: torch.Generator | None = None  # made on the model's device at first use
        # Read by every round (ModelRunner.eager_only), so worked out once: penalties / bias /
        # min_tokens change the logits; with a seed or logprobs too, no CUDA graph can run it.
        self.processes_logits = params.processes_logits
        self.bad_words_token_ids: list[list[int]] | None = None  # set by the engine's tokenizer
        self.eager_only = params.seed is not None or params.logprobs is not None or self.processes_logits
        # Per output token, when params.logprobs is set: (its log-probability, [(token, logprob)]
        # of the params.logprobs most likely tokens).
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] | None = \
            [] if params.logprobs is not None else None
        # The same for prompt tokens 1.. (params.prompt_logprobs), filled by the prefill by position
        # (a preempted sequence's recompute overwrites them).
        self.prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = \
            [None] * (len(prompt_token_ids) - 1) if params.prompt_logprobs is not None else None

    @property
    def text(self) -> str:
        """Output text, decoded on demand (a step only decodes when stop strings need it)."""
        if self._text_for != len(self.token_ids) and self.decode_fn is not None:
            self._text, self._text_for = self.decode_fn(self.output_token_ids), len(self.token_ids)
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._text, self._text_for = value, len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED
