"""Per-request refusals: sampling features the tree acceptance walk does not implement.

The walk samples from softmax(logits / T) filtered by top-k / top-p (or takes the argmax), which is
exactly vLLM's rule for requests without the features below. Those change the target distribution
(penalties, biases, masks, grammars) or ask for outputs the walk does not produce (logprobs), so
such requests are refused up front with a message naming the parameter, instead of being served
with a silently different distribution.
"""
from __future__ import annotations

from ddtree.vllm.config import settings_of


def unsupported_params(params) -> list[str]:
    """Names (with values) of the set SamplingParams fields DDTree refuses."""
    checks = [
        ("presence_penalty", params.presence_penalty not in (None, 0.0)),
        ("frequency_penalty", params.frequency_penalty not in (None, 0.0)),
        ("repetition_penalty", params.repetition_penalty not in (None, 1.0)),
        ("min_p", bool(params.min_p)),
        ("min_tokens", bool(params.min_tokens)),
        ("logit_bias", bool(params.logit_bias)),
        ("allowed_token_ids", params.allowed_token_ids is not None),
        ("bad_words", bool(params.bad_words)),
        ("logprobs", params.logprobs is not None),
        ("prompt_logprobs", params.prompt_logprobs is not None),
        ("structured_outputs", params.structured_outputs is not None),
        ("logits_processors", bool(getattr(params, "logits_processors", None))),
        ("thinking_token_budget", getattr(params, "thinking_token_budget", None) is not None),
    ]
    return [f"{name}={getattr(params, name)!r}" for name, bad in checks if bad]


def install_request_hook() -> None:
    """Wrap vLLM's request validation so DDTree engines refuse unsupported sampling features."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor._validate_params
    if getattr(original, "_ddtree", False):
        return

    def _validate_params(self, params, supported_tasks):
        result = original(self, params, supported_tasks)
        if isinstance(params, SamplingParams) and settings_of(self.vllm_config) is not None:
            bad = unsupported_params(params)
            if bad:
                raise VLLMValidationError(
                    f"speculative method 'ddtree' does not support {', '.join(bad)}; "
                    "send the request without it or serve without DDTree",
                    parameter=bad[0].split("=")[0])
        return result

    _validate_params._ddtree = True
    InputProcessor._validate_params = _validate_params
