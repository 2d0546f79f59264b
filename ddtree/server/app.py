"""The OpenAI-compatible FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics. ``build_app(llm)`` returns an app whose lifespan starts and stops the engine thread."""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import hashlib
import json
import logging
import re
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddtree.engine.sampling_params import SamplingParams
from ddtree.server.async_engine import AsyncEngine, EngineError, EngineUnavailable, Event
from ddtree.server.metrics import ServerMetrics
from ddtree.server.protocol import (MAX_CHOICES, MAX_PROMPTS, ApiError, ChatCompletionRequest, CompletionRequest,
                                    DetokenizeRequest, ErrorResponse, TokenizeRequest, unsupported,
                                    validation_error)

log = logging.getLogger("ddtree.server")

# A request that fails inside the engine (not the client's fault) is answered with this status and
# error type "server_error": deliberately not a 5xx (the server itself is fine and serves the rest;
# OpenAI clients would retry a 5xx, repeating the same failure).
ENGINE_ERROR_STATUS = 422
UNAVAILABLE_STATUS = 503  # only while the engine is stopped / shutting down
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_tokens", "stop", "stop_token_ids", "seed", "ignore_eos",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "min_p",
                   "allowed_token_ids", "bad_words")
ERROR_RESPONSES = {400: {"model": ErrorResponse, "description": "invalid request"},
                   404: {"model": ErrorResponse, "description": "unknown model"},
                   ENGINE_ERROR_STATUS: {"model": ErrorResponse, "description": "the engine failed this request"}}


def default_model_name(target_dir) -> str:
    """'SmolLM2-135M-Instruct' for .cache/models/SmolLM2-135M-Instruct.Q4_1-570cbc7fa4."""
    name = Path(str(target_dir)).name
    name = re.sub(r"-[0-9a-f]{10}$", "", name)  # cache key of a converted GGUF
    name = re.sub(r"\.gguf$", "", name, flags=re.I)
    name = re.sub(r"[.-](I?Q\d\w*|F16|F32|BF16)$", "", name, flags=re.I)  # quantization tag
    return name or "ddtree"


def choice_seed(seed: int | None, i: int) -> int | None:
    """The seed of choice ``i`` of a request seeded with ``seed``: choice 0 keeps it (n=1 draws
    what it always did); the others get a 63-bit hash of (seed, i), so no choice of one request
    repeats a choice of a request with a nearby seed."""
    if seed is None or i == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _param_of(message: str, kind: str) -> str | None:
    """The request field a ValueError message from the engine / SamplingParams names."""
    word = message.split(" ", 1)[0].strip("'\":")
    if word in SAMPLING_FIELDS:
        return word
    if word in ("method", "budget"):
        return f"speculative.{word}"
    if word == "prompt" or "context" in message:
        return "messages" if kind == "chat" else "prompt"
    return None


class _Stream:
    """Text deltas of one choice from full-text snapshots. While unfinished, holds back a trailing
    U+FFFD (an incomplete UTF-8 sequence) and the last len(longest stop)-1 characters (a stop
    string may still complete and be cut), so streamed text never has to be taken back."""

    def __init__(self, stops: list[str] | None):
        self.holdback = max((len(s) for s in stops or ()), default=1) - 1
        self.sent = ""

    def delta(self, text: str, finished: bool) -> str:
        if not finished:
            end = len(text) - self.holdback
            while end > 0 and text[end - 1] == "\ufffd":
                end -= 1
            text = text[:max(0, end)]
        if len(text) <= len(self.sent):
            return ""
        if not text.startswith(self.sent):  # not expected with the holdback; sent text stays sent
            log.warning("streamed text diverged from the detokenized text")
        out = text[len(self.sent):]
        self.sent += out
        return out


class OpenAIServer:
    def __init__(self, llm, served_model_name: str | None = None, metrics: ServerMetrics | None = None,
                 shutdown_grace_s: float = 10.0):
        self.llm = llm
        self.model_name = served_model_name or default_model_name(getattr(llm, "target_dir", "ddtree"))
        cfg = llm.engine.config
        self.metrics = metrics or ServerMetrics(self.model_name, cfg.method, cfg.budget)
        self.engine = AsyncEngine(llm, self.metrics)
        self.max_model_len = llm.engine.max_model_len
        # The event loop tokenizes with its own copy: the engine thread decodes with llm.tokenizer.
        self.tokenizer = copy.deepcopy(llm.tokenizer) if llm.tokenizer is not None else None
        self.shutdown_grace_s = shutdown_grace_s
        self.created = int(time.time())
        self._token_texts: dict[int, str] = {}

    # ---- input -------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def encode_prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        p = req.prompt
        if isinstance(p, str):
            items = [p]
        elif p and all(isinstance(x, int) for x in p):
            items = [p]
        else:
            items = list(p)
        if not items:
            raise ApiError(400, "prompt is empty", param="prompt")
        if len(items) > MAX_PROMPTS:
            raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(items)}", param="prompt")
        out = []
        for item in items:
            if isinstance(item, str):
                if self.tokenizer is None:
                    raise ApiError(400, "this server has no tokenizer: send token ids", param="prompt")
                if not item:
                    raise ApiError(400, "prompt is empty", param="prompt")
                try:
                    ids = self.tokenizer.encode(item, add_special_tokens=False)
                except Exception as e:  # noqa: BLE001 - e.g. a lone UTF-16 surrogate
                    raise ApiError(400, f"the prompt cannot be tokenized ({type(e).__name__}: {e}); is it valid "
                                        "Unicode?", param="prompt") from e
                out.append((item, ids))
            else:
                out.append((None, list(item)))
        return out

    def encode_chat(self, req: ChatCompletionRequest, add_generation_prompt: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, "this server has no tokenizer and no chat template", param="messages")
        messages = []
        for i, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):
                content = "\n".join(part.text for part in content)
            if not isinstance(content, str):
                raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                               param="messages")
            messages.append({"role": "system" if m.role == "developer" else m.role, "content": content})
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                     tokenize=True)
        except Exception as e:  # noqa: BLE001 - a template may reject a role order, say
            raise ApiError(400, f"the chat template rejected these messages: {e}", param="messages") from e
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def truncate(self, text: str | None, tokens: list[int], k: int) -> tuple[str | None, list[int]]:
        """vLLM's truncate_prompt_tokens: the last k tokens (an echo then shows their text)."""
        if k == 0:
            raise ApiError(400, "truncate_prompt_tokens must be -1 or an integer >= 1, got 0",
                           param="truncate_prompt_tokens")
        k = self.max_model_len - 1 if k == -1 else k
        return (text, tokens) if len(tokens) <= k else (None, tokens[-k:])

    def sampling_params(self, req, num_prompt_tokens: int, kind: str) -> SamplingParams:
        max_tokens = req.max_tokens
        if kind == "chat" and req.max_completion_tokens is not None:
            max_tokens = req.max_completion_tokens
        what = "messages" if kind == "chat" else "prompt"
        if num_prompt_tokens >= self.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens, but the "
                                f"{what} has {num_prompt_tokens} tokens (prompt + at least 1 output token must "
                                f"fit). Please shorten the {what}.", param=what, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = 16 if kind == "completion" else self.max_model_len - num_prompt_tokens
        elif num_prompt_tokens + max_tokens > self.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                f"you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
                                f"the {what}, {max_tokens} in the completion). Please reduce the length of the "
                                f"{what} or max_tokens.", param="max_completion_tokens"
                           if kind == "chat" and req.max_completion_tokens is not None else "max_tokens",
                           code="context_length_exceeded")
        top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
        prompt_logprobs = None
        if kind == "chat":
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        else:
            logprobs = req.logprobs
            if req.echo:  # the echoed prompt's tokens get logprobs too
                prompt_logprobs = logprobs
        bias = None
        if req.logit_bias:
            try:
                bias = {int(k): v for k, v in req.logit_bias.items()}
            except ValueError:
                raise ApiError(400, f"logit_bias keys must be token ids, got {list(req.logit_bias)!r}",
                               param="logit_bias") from None
        return SamplingParams(
            temperature=1.0 if req.temperature is None else float(req.temperature),
            top_p=1.0 if req.top_p is None else float(req.top_p), top_k=top_k, max_tokens=max_tokens,
            stop=req.stop if req.stop else None, stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=bool(req.ignore_eos), seed=req.seed, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=bias, min_tokens=req.min_tokens or 0, min_p=req.min_p or 0.0,
            allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words or None,
            include_stop_str_in_output=bool(req.include_stop_str_in_output))

    def speculative(self, req) -> dict:
        """Per-request {method, budget}: passed to the engine when it takes them; until then only
        the server's own settings are accepted."""
        spec = req.speculative
        if spec is None:
            return {}
        asked = {k: v for k, v in (("method", spec.method), ("budget", spec.budget)) if v is not None}
        if self.engine.supports_per_request_spec:
            return asked
        cfg = self.llm.engine.config
        for key, mine in (("method", cfg.method), ("budget", cfg.budget)):
            if key in asked and asked[key] != mine:
                raise ApiError(400, f"speculative.{key}={asked[key]!r} differs from this server's {key} "
                                    f"{mine!r}: this engine does not take per-request speculative settings yet",
                               param=f"speculative.{key}", code="unsupported_parameter")
        return {}

    # ---- output --------------------------------------------------------------------------------
    def token_text(self, token: int) -> str:
        """One token as text (vLLM's ``token_id:N`` without a tokenizer); a token holding part of
        a UTF-8 character decodes to U+FFFD."""
        if self.tokenizer is None:
            return f"token_id:{token}"
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    def logprobs_body(self, kind: str, entries, text_offset: int = 0) -> dict | None:
        """OpenAI's logprobs object for these (token, logprob, most likely) entries: chat's
        ``{"content": [...]}``, or completions' parallel lists (whose ``top_logprobs`` maps text
        to logprob and holds the chosen token too, as vLLM's does); ``text_offset``: where the
        first token's text starts in the completion."""
        if entries is None:
            return None
        if kind == "chat":
            def item(token, lp):
                text = self.token_text(token)
                return {"token": text, "logprob": lp, "bytes": list(text.encode())}
            return {"content": [dict(item(t, lp), top_logprobs=[item(b, x) for b, x in best])
                                for t, lp, best in entries], "refusal": None}
        # (an echoed prompt's first token has no logprob: None in both lists, as OpenAI's)
        texts = [self.token_text(t) for t, _, _ in entries]
        offsets = []
        for text in texts:
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": texts, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [None if lp is None else
                                 {self.token_text(t): lp, **{self.token_text(b): x for b, x in best}}
                                 for t, lp, best in entries],
                "text_offset": offsets}

    # ---- one request -------------------------------------------------------------------------
    async def safe_handle(self, kind: str, req, raw: Request):
        """``handle``, with any unexpected exception answered as this request's error (never a 5xx:
        the server is fine and serves the other requests)."""
        try:
            return await self.handle(kind, req, raw)
        except Exception as e:  # noqa: BLE001
            log.exception("request failed")
            self.metrics.error(raw.url.path, "server_error")
            return _error_response(ApiError(ENGINE_ERROR_STATUS, f"{type(e).__name__}: {e}", type="server_error",
                                            code="engine_error"))

    async def handle(self, kind: str, req, raw: Request):
        arrival = time.monotonic()
        endpoint = raw.url.path
        try:
            self.check_model(req.model)
            err = unsupported(req)
            if err is not None:
                raise err
            if kind == "chat":
                prompts = [(None, self.encode_chat(req))]
            else:
                prompts = self.encode_prompts(req)
            if req.truncate_prompt_tokens is not None:
                prompts = [self.truncate(text, tokens, req.truncate_prompt_tokens) for text, tokens in prompts]
            n = req.n or 1
            if len(prompts) * n > MAX_CHOICES:
                raise ApiError(400, f"at most {MAX_CHOICES} choices per request (prompts x n), got "
                                    f"{len(prompts)} x {n}", param="n")
            # Choice i of prompt p has index p * n + i (as OpenAI numbers them).
            choices = []
            for text, tokens in prompts:
                params = self.sampling_params(req, len(tokens), kind)
                choices += [(text, tokens, dataclasses.replace(params, seed=choice_seed(params.seed, i)))
                            for i in range(n)]
            spec = self.speculative(req)
        except ApiError as e:
            self.metrics.error(endpoint, e.type)
            return _error_response(e)
        except ValueError as e:  # SamplingParams validation
            self.metrics.error(endpoint, "invalid_request_error")
            return _error_response(ApiError(400, str(e), param=_param_of(str(e), kind)))
        except Exception as e:  # noqa: BLE001 - unexpected, but while reading this request's input
            log.exception("could not process the input of a request")
            self.metrics.error(endpoint, "invalid_request_error")
            return _error_response(ApiError(400, f"could not process the request: {type(e).__name__}: {e}"))

        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        sink: asyncio.Queue = asyncio.Queue()
        ids = [f"{rid}-{i}" for i in range(len(choices))]
        added = []
        try:
            for i, (text, tokens, p) in enumerate(choices):
                await self.engine.add(ids[i], tokens, p, sink=sink, index=i, prompt=text, spec=spec,
                                      stream=bool(req.stream), arrival=arrival)
                added.append(ids[i])
        except (ValueError, EngineUnavailable, EngineError) as e:
            for a in added:
                self.engine.abort(a)
            if isinstance(e, ValueError):
                err = ApiError(400, str(e), param=_param_of(str(e), kind))
            elif isinstance(e, EngineUnavailable):
                err = ApiError(UNAVAILABLE_STATUS, str(e), type="server_error", code="unavailable")
            else:
                err = ApiError(ENGINE_ERROR_STATUS, str(e), type="server_error", code="engine_error")
            self.metrics.error(endpoint, err.type)
            return _error_response(err)
        except BaseException:
            for a in added:
                self.engine.abort(a)
            raise

        prompt_tokens = sum(len(t) for _, t in prompts)  # each prompt once, however many choices
        echo = None
        if kind == "completion" and req.echo:
            echo = [text if text is not None else (self.tokenizer.decode(tokens) if self.tokenizer else "")
                    for text, tokens, _ in choices]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            open_ids = set(range(len(ids)))

            def abort_open():
                for i in list(open_ids):
                    self.engine.abort(ids[i])
                open_ids.clear()

            gen = self._stream(kind, rid, ids, open_ids, abort_open, sink, req.stop, prompt_tokens,
                               include_usage, endpoint, echo)
            return _AbortingStreamingResponse(gen, abort_open, media_type="text/event-stream",
                                              headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._collect(kind, rid, ids, sink, prompt_tokens, raw, endpoint, echo)

    async def _collect(self, kind, rid, ids, sink: asyncio.Queue, prompt_tokens, raw: Request, endpoint,
                       echo: list[str] | None = None):
        """Non-streaming: wait for every choice; abort them all if the client goes away."""
        results: dict[int, Event] = {}
        watch = asyncio.ensure_future(_wait_disconnect(raw))
        try:
            while len(results) < len(ids):
                get = asyncio.ensure_future(sink.get())
                done, _ = await asyncio.wait({get, watch}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    for i in ids:
                        self.engine.abort(i)
                    return Response(status_code=499)  # nobody is listening
                ev: Event = get.result()
                if ev.error is not None:
                    for i in ids:
                        self.engine.abort(i)
                    self.metrics.error(endpoint, "server_error")
                    return _error_response(ApiError(ENGINE_ERROR_STATUS, ev.error, type="server_error",
                                                    code="engine_error"))
                if ev.finish_reason is not None:
                    results[ev.index] = ev
        except BaseException:
            for i in ids:
                self.engine.abort(i)
            raise
        finally:
            watch.cancel()
        completion_tokens = sum(ev.num_output_tokens for ev in results.values())
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        created = int(time.time())
        if kind == "chat":
            choices = [{"index": i, "message": {"role": "assistant", "content": results[i].text, "refusal": None},
                        "logprobs": self.logprobs_body(kind, results[i].logprobs),
                        "finish_reason": _reason(results[i].finish_reason)}
                       for i in range(len(ids))]
            body = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                    "choices": choices, "usage": usage, "system_fingerprint": None}
        else:
            choices = []
            for i in range(len(ids)):
                ev = results[i]
                entries = ev.logprobs if ev.prompt_logprobs is None else ev.prompt_logprobs + (ev.logprobs or [])
                choices.append({"index": i, "text": (echo[i] if echo else "") + ev.text,
                                "logprobs": self.logprobs_body(kind, entries),
                                "finish_reason": _reason(ev.finish_reason)})
            body = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": choices, "usage": usage, "system_fingerprint": None}
        return JSONResponse(body)

    async def _stream(self, kind, rid, ids, open_ids: set, abort_open, sink: asyncio.Queue, stops, prompt_tokens,
                      include_usage, endpoint, echo: list[str] | None = None):
        """SSE chunks as the OpenAI API sends them; aborts what is unfinished if the client leaves."""
        created = int(time.time())
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        stops = [stops] if isinstance(stops, str) else (stops or [])
        streams = [_Stream(stops) for _ in ids]
        # logprobs of tokens not sent yet, and the completion text their tokens' texts have covered
        pending: list[list] = [[] for _ in ids]
        offsets = [0] * len(ids)
        unechoed = list(echo) if echo else [None] * len(ids)
        completion_tokens = 0

        def chunk(choices, usage=None):
            c = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                 "system_fingerprint": None, "choices": choices}
            if include_usage:
                c["usage"] = usage
            return _sse(c)

        def choice(i, text, finish_reason=None, role=False):
            if unechoed[i] is not None:  # the choice's first chunk starts with the echoed prompt
                text, unechoed[i] = unechoed[i] + text, None
            logprobs = None
            if pending[i]:  # sent with the next chunk of this choice (text may still be held back)
                logprobs = self.logprobs_body(kind, pending[i], offsets[i])
                if kind != "chat":
                    offsets[i] += sum(len(t) for t in logprobs["tokens"])
                pending[i] = []
            if kind == "chat":
                delta = {"role": "assistant", "content": text, "refusal": None} if role else \
                    ({"content": text} if text or finish_reason is None else {})
                return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

        def error(message):
            abort_open()
            self.metrics.error(endpoint, "server_error")
            return _sse({"error": {"message": message, "type": "server_error", "param": None,
                                   "code": "engine_error"}}) + "data: [DONE]\n\n"

        try:
            if kind == "chat":
                for i in range(len(ids)):  # one choice per chunk, as OpenAI streams n > 1
                    yield chunk([choice(i, "", role=True)])
            while open_ids:
                ev: Event = await sink.get()
                if ev.index not in open_ids:
                    continue
                if ev.error is not None:
                    yield error(ev.error)
                    return
                finished = ev.finish_reason is not None
                pending[ev.index] += (ev.prompt_logprobs or []) + (ev.logprobs or [])
                text = streams[ev.index].delta(ev.text, finished)
                if text:
                    yield chunk([choice(ev.index, text)])
                if finished:
                    open_ids.discard(ev.index)
                    completion_tokens += ev.num_output_tokens
                    yield chunk([choice(ev.index, "", _reason(ev.finish_reason))])
            if include_usage:
                yield chunk([], {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                 "total_tokens": prompt_tokens + completion_tokens})
            yield "data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 - the headers are sent: end the stream with an error event
            log.exception("stream %s failed", rid)
            yield error(f"{type(e).__name__}: {e}")
        finally:
            abort_open()  # client disconnected (or the server is cancelling us)


class _AbortingStreamingResponse(StreamingResponse):
    """Calls ``on_close`` however the response ends, also when the client leaves before the body
    generator ever started (then the generator's own ``finally`` never runs)."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _reason(reason: str | None) -> str:
    return reason if reason in ("stop", "length") else "stop"


async def _wait_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


class _CountRequests:
    """Pure ASGI middleware (no buffering, disconnects pass through) counting requests by status."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [None]

        async def _send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, _send)
        finally:
            self.metrics.request(scope.get("path", ""), status[0] if status[0] is not None else 499)


def build_app(llm, served_model_name: str | None = None, shutdown_grace_s: float = 10.0) -> FastAPI:
    """The OpenAI-compatible app for ``llm`` (a ``ddtree.LLM``). Its lifespan starts the engine
    thread and stops it; ``app.state.server`` is the OpenAIServer (engine, metrics)."""
    server = OpenAIServer(llm, served_model_name, shutdown_grace_s=shutdown_grace_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.engine.stop)

    app = FastAPI(title="ddtree", summary="OpenAI-compatible server for DDTree speculative decoding",
                  version=_version(), lifespan=lifespan)
    app.state.server = server
    app.add_middleware(_CountRequests, metrics=server.metrics)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        err = validation_error(list(exc.errors()))
        server.metrics.error(request.url.path, err.type)
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = ApiError(exc.status_code, str(exc.detail), type=type_)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, raw: Request):
        """OpenAI text completions (streaming with stream=true)."""
        return await server.safe_handle("completion", body, raw)

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        """OpenAI chat completions (streaming with stream=true)."""
        return await server.safe_handle("chat", body, raw)

    # vLLM's tokenizer endpoints (lm-eval's local-completions uses them when /tokenizer_info answers)
    def tokenizer_or_400(model):
        server.check_model(model)
        if server.tokenizer is None:
            raise ApiError(400, "this server has no tokenizer")
        return server.tokenizer

    @app.post("/tokenize", responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest):
        """Token ids of a prompt or of chat messages (through the chat template)."""
        try:
            tok = tokenizer_or_400(body.model)
            if (body.prompt is None) == (body.messages is None):
                raise ApiError(400, "give either prompt or messages", param="prompt")
            if body.messages is not None:
                if not body.messages:
                    raise ApiError(400, "messages is empty", param="messages")
                chat = ChatCompletionRequest(messages=body.messages)
                ids = server.encode_chat(chat, add_generation_prompt=body.add_generation_prompt is not False)
            else:
                ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        except ApiError as e:
            return _error_response(e)
        except Exception as e:  # noqa: BLE001 - e.g. a lone surrogate
            return _error_response(ApiError(400, f"cannot tokenize: {type(e).__name__}: {e}", param="prompt"))
        return {"tokens": list(ids), "count": len(ids), "max_model_len": server.max_model_len}

    @app.post("/detokenize", responses=ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest):
        """The text of token ids."""
        try:
            tok = tokenizer_or_400(body.model)
            vocab = llm.engine.target_config.vocab_size
            bad = [t for t in body.tokens if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"token ids outside the vocabulary [0, {vocab}): {bad[:8]}", param="tokens")
        except ApiError as e:
            return _error_response(e)
        return {"prompt": tok.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """The tokenizer's special tokens and chat template (as vLLM's endpoint)."""
        tok = server.tokenizer
        if tok is None:
            return _error_response(ApiError(404, "this server has no tokenizer", type="not_found_error"))
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "unk_token": tok.unk_token,
                "chat_template": getattr(tok, "chat_template", None), "model_max_length": server.max_model_len}

    @app.get("/v1/models")
    async def models():
        cfg = llm.engine.config
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": server.created, "owned_by": "ddtree",
            "root": str(getattr(llm, "target_dir", server.model_name)), "parent": None,
            "max_model_len": server.max_model_len,
            "speculative": {"method": cfg.method, "budget": cfg.budget}}]}

    @app.get("/health")
    async def health():
        if not server.engine.alive:
            return JSONResponse({"status": "engine stopped", "error": server.engine.fatal_error},
                                status_code=UNAVAILABLE_STATUS)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("ddtree")
    except Exception:  # noqa: BLE001
        return "0"
