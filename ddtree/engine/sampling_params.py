from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # most likely tokens a request may ask for per position (as OpenAI's top_logprobs)
MAX_BAD_WORDS = 128  # each is matched at every tree node of every round (vLLM's default cap too)


@dataclass
class SamplingParams:
    """vLLM-shaped sampling settings. temperature 0 = greedy; top_k 0 = off; top_p 1 = off.
    ``logprobs`` = k: each output token's log-probability under the target and its k most likely
    tokens (0: the token's alone; None: none), from the raw logits, before temperature and
    filters (vLLM's default); ``prompt_logprobs`` = k: the same for every prompt token after the
    first (computed by the prefill). As vLLM's: ``allowed_token_ids`` are the only tokens that
    may be sampled; ``bad_words`` (strings, tokenized by the engine with and without a leading
    space) may not be completed: a word's last token is masked where the output ends with its
    other tokens; ``include_stop_str_in_output`` keeps a matched stop string in the text;
    ``min_tokens`` blocks EOS and ``stop_token_ids`` (and
    stop strings ending within them) until that many tokens are out; ``logit_bias`` {token id:
    bias} is added to the logits; then the penalties: ``repetition_penalty`` (1 = off) for prompt
    and output tokens, ``frequency_penalty`` / ``presence_penalty`` (0 = off) for output tokens;
    then, after temperature, ``min_p`` (0 = off) drops tokens less likely than min_p times the most
    likely one, before top-k / top-p."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    min_p: float = 0.0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False

    @property
    def processes_logits(self) -> bool:
        """Whether the target's logits are changed before sampling (penalties, bias, masks,
        min_tokens, min_p when sampling)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens or (self.min_p and self.temperature > 0)
                    or self.allowed_token_ids is not None or self.bad_words)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and (not isinstance(self.stop, list)
                                      or not all(isinstance(s, str) and s for s in self.stop)):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not (math.isfinite(r) and r > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {r!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a {{token id: bias}} dict, got {self.logit_bias!r}")
            for t, b in self.logit_bias.items():
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
                if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1] (0 = off), got {self.min_p!r}")
        a = self.allowed_token_ids
        if a is not None and (not isinstance(a, list) or not a or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in a)):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {a!r}")
        if self.bad_words is not None and (not isinstance(self.bad_words, list) or not all(
                isinstance(w, str) and w.strip() for w in self.bad_words)):
            raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
        if self.bad_words is not None and len(self.bad_words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words has {len(self.bad_words)} words, more than {MAX_BAD_WORDS}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output must be true or false, got {self.include_stop_str_in_output!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
