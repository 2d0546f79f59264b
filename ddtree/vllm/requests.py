"""Per-request refusals: sampling features the tree acceptance walk does not implement.

The walk samples from softmax(logits / T) filtered by top-k / top-p (or takes the argmax) after
vLLM's allowed_token_ids and bad_words masks, min_tokens, logit_bias, presence / frequency /
repetition penalties and min_p, each applied
to a node's logits for that node's own prefix (runner.py, ddtree.tree.processing): exactly vLLM's rule
for requests without the features below. Those change the target distribution in ways the walk
does not reproduce (grammars, custom logits processors) or ask for outputs it does not produce (logprobs
of chosen token ids), so such requests are refused up front with a message
naming the parameter, instead of being served with a silently different distribution.
"""
from __future__ import annotations

import contextvars

from ddtree.vllm.config import settings_of


def unsupported_params(params) -> list[str]:
    """Names (with values) of the set SamplingParams fields DDTree refuses."""
    checks = [
        ("logprob_token_ids", getattr(params, "logprob_token_ids", None) is not None),
        ("structured_outputs", params.structured_outputs is not None),
        ("logits_processors", bool(getattr(params, "logits_processors", None))),
        ("thinking_token_budget", getattr(params, "thinking_token_budget", None) is not None),
    ]
    return [f"{name}={getattr(params, name)!r}" for name, bad in checks if bad]


# Set while a DDTree engine validates a request: vLLM refuses min_p and logit_bias with any
# speculative method (its rejection sampler does not apply them to draft positions); DDTree's walk does.
_validating_for_ddtree = contextvars.ContextVar("ddtree_validating", default=False)


def install_request_hook() -> None:
    """Wrap vLLM's request validation so DDTree engines refuse unsupported sampling features and
    accept min_p and logit_bias."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor._validate_params
    if getattr(original, "_ddtree", False):
        return
    spec_check = SamplingParams._validate_spec_decode

    def _validate_spec_decode(self, speculative_config):
        if not _validating_for_ddtree.get():  # DDTree's walk applies min_p and logit_bias
            spec_check(self, speculative_config)

    def _validate_params(self, params, supported_tasks):
        if not isinstance(params, SamplingParams) or settings_of(self.vllm_config) is None:
            return original(self, params, supported_tasks)
        bad = unsupported_params(params)
        if bad:
            raise VLLMValidationError(
                f"speculative method 'ddtree' does not support {', '.join(bad)}; "
                "send the request without it or serve without DDTree",
                parameter=bad[0].split("=")[0])
        token = _validating_for_ddtree.set(True)
        try:
            return original(self, params, supported_tasks)
        finally:
            _validating_for_ddtree.reset(token)

    _validate_params._ddtree = True
    SamplingParams._validate_spec_decode = _validate_spec_decode
    InputProcessor._validate_params = _validate_params
