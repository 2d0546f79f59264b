"""OpenAI-compatible request bodies (pydantic, strict types) and OpenAI-style errors.

Unknown fields are accepted and ignored (as vLLM does); a few OpenAI features the engine does not
have are rejected with a 400 naming the field when a client asks for them (see ``unsupported``).
Extensions beyond the OpenAI API (vLLM's names): ``top_k``, ``stop_token_ids``, ``ignore_eos``,
``repetition_penalty``, ``min_tokens``, and ``speculative: {"method", "budget"}``.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ddtree.engine.sampling_params import MAX_LOGPROBS

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_PROMPTS = 256  # prompts per /v1/completions request
MAX_CHOICES = 256  # choices (prompts x n) per request


class _Strict(BaseModel):
    # strict: "0.5" is not a number and 1.0 is not an integer (as the OpenAI API answers).
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool | None = False


class Speculative(_Strict):
    """Extension: per-request speculative decoding settings (default: the server's)."""
    model_config = ConfigDict(strict=True, extra="forbid")
    method: Literal["ar", "dflash", "ddtree"] | None = None
    budget: Annotated[int, Field(ge=0)] | Literal["auto"] | None = Field(
        default=None, description="DDTree node budget (tree nodes verified per step), or 'auto'")


class _SamplingRequest(_Strict):
    model: str | None = Field(default=None, description="the served model name (GET /v1/models); optional")
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, description="0 = greedy; default 1")
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, description="extension; 0 or -1 = off")
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, description="extension: stop at these token ids")
    ignore_eos: bool | None = Field(default=False, description="extension: keep generating past EOS")
    n: int | None = Field(default=1, ge=1, description="choices per prompt (with a seed, choice i > 0 "
                                                       "draws from a seed derived from it and i)")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    speculative: Speculative | None = Field(default=None, description="extension: {method, budget} for this request")
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, description="extension (vLLM's); 1 = off")
    logit_bias: dict[str, float] | None = Field(default=None, description="{token id: bias in [-100, 100]}")
    min_tokens: int | None = Field(default=None, ge=0, description="extension (vLLM's): no EOS / stop before")
    min_p: float | None = Field(default=None, ge=0, le=1, description="extension (vLLM's): drop tokens below "
                                                                    "min_p x the top probability; 0 = off")
    allowed_token_ids: list[int] | None = Field(default=None, description="extension (vLLM's): the only tokens "
                                                                          "that may be sampled")
    bad_words: list[str] | None = Field(default=None, description="extension (vLLM's): words that may not be "
                                                                  "generated (with or without a leading space)")
    include_stop_str_in_output: bool | None = Field(default=False, description="extension (vLLM's): keep the "
                                                                              "stop string that ended the text")
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, description="extension (vLLM's): keep the last "
                                               "k prompt tokens; -1 = as many as leave room for one output token")
    user: str | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="a string, a list of token ids, or a list of either (one choice per prompt)")
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS,
                                 description="each token's logprob and this many most likely tokens")
    echo: bool | None = Field(default=False, description="prepend the prompt (with logprobs: its tokens' too)")
    best_of: int | None = Field(default=None, ge=1, description="only equal to n is supported")
    suffix: str | None = Field(default=None, description="not supported")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = Field(default=False, description="each output token's logprob")
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS,
                                     description="this many most likely tokens per position (needs logprobs)")
    tools: list[dict[str, Any]] | None = Field(default=None, description="not supported")
    response_format: dict[str, Any] | None = Field(default=None, description="only {'type': 'text'}")


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = Field(default=True, description="prompt only (the chat template adds its own)")
    add_generation_prompt: bool | None = Field(default=True, description="messages only")


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ApiError(Exception):
    """An error answered to the client as ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Fields of OpenAI's or vLLM's request schema that change what is generated and that this server
# does not implement: refused rather than ignored (other unknown fields, e.g. "store" or "metadata",
# are ignored as extra="allow" lets them through).
UNSUPPORTED_FIELDS = ("functions", "function_call", "structured_outputs",
                      "guided_json", "guided_regex", "guided_choice", "guided_grammar", "use_beam_search",
                      "logits_processors",
                      "prompt_logprobs", "audio")


def unsupported(req: _SamplingRequest) -> ApiError | None:
    """A 400 for the OpenAI and vLLM features this server does not have, when the client asks for one."""
    def err(param, message):
        return ApiError(400, message, param=param, code="unsupported_parameter")

    for name in UNSUPPORTED_FIELDS:
        if (req.model_extra or {}).get(name) not in (None, False, [], {}):
            return err(name, f"{name} is not supported by this server")
    if req.stream_options is not None and not req.stream:
        return err("stream_options", "stream_options is only allowed when stream is true")
    if isinstance(req, CompletionRequest):
        n = req.n or 1
        if req.best_of is not None and req.best_of < n:
            return ApiError(400, f"best_of ({req.best_of}) must be at least n ({n})", param="best_of")
        if req.best_of is not None and req.best_of > n:
            return err("best_of", f"best_of > n is not supported (best_of={req.best_of}, n={n}): every "
                                  "choice generated is returned")
        if req.suffix:
            return err("suffix", "suffix is not supported")
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            return ApiError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
        if req.tools:
            return err("tools", "tools (function calling) are not supported")
        if req.response_format is not None and req.response_format.get("type", "text") != "text":
            return err("response_format", "only response_format {'type': 'text'} is supported")
    return None


_UNION_TAG = re.compile(r"str|int|float|bool|dict|list|none|[a-z_-]*\[.*\]|[A-Z]\w*")


def validation_error(errors: list[dict]) -> ApiError:
    """An ApiError (400) for FastAPI's RequestValidationError list: names the field and problem."""
    if not errors:
        return ApiError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return ApiError(400, f"malformed JSON in the request body{': ' + detail if detail else ''}",
                        code="invalid_json")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if not loc:
        if first.get("type") == "missing":
            return ApiError(400, "the request needs a JSON object body", code="invalid_body")
        return ApiError(400, f"the request body must be a JSON object: {first.get('msg')}", code="invalid_body")
    param = loc[0]
    # pydantic reports one error per member of a union: keep the field and the distinct messages.
    msgs = []
    for e in errors:
        eloc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if eloc[:1] == [param] and e.get("msg") not in msgs:
            msgs.append(e.get("msg"))
    if first.get("type") == "missing" and len(loc) == 1:
        return ApiError(400, f"'{param}' is a required field", param=param, code="missing_required_parameter")
    where = ".".join(x for x in loc if not _UNION_TAG.fullmatch(x))
    return ApiError(400, f"invalid '{where}': " + "; ".join(msgs[:4]), param=param, code="invalid_type"
                    if any(e.get("type", "").endswith("_type") for e in errors) else "invalid_value")
