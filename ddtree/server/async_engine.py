"""Drives one ``LLMEngine`` from one thread for many asyncio clients (continuous batching).

Requests and aborts go in through a thread-safe queue; the engine thread adds them, runs
``engine.step()`` while work is left, and hands each request's progress back to its asyncio queue
with ``loop.call_soon_threadsafe``. The engine itself is touched by this thread only.

Failure isolation: an exception while publishing one request's progress fails that request only
(it gets an error event and is aborted, freeing its KV blocks). If a whole ``engine.step()``
raises, the requests of that step (the running batch) get an error event and are aborted; the
waiting ones and new ones are served on.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ddtree.engine.sampling_params import SamplingParams
from ddtree.engine.sequence import Sequence

log = logging.getLogger("ddtree.server")


class EngineError(Exception):
    """A request failed inside the engine (not the client's fault)."""


class EngineUnavailable(Exception):
    """The engine is stopped or shutting down: no new requests."""


@dataclass
class Event:
    """Progress of one request: its whole text so far (stop strings cut), output token count,
    finish reason once finished, or an error message; with logprobs, the (token, logprob, most
    likely [(token, logprob)]) of the output tokens not reported by an earlier event."""
    index: int
    text: str = ""
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    # prompt_logprobs asked for: every prompt token's (token, logprob, most likely), None for the
    # first token's logprob and list; in the request's first event only
    prompt_logprobs: list[tuple[int, float | None, list[tuple[int, float]] | None]] | None = None


@dataclass
class _Live:
    seq: Sequence
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    index: int
    stream: bool
    arrival: float
    draft_tokens: int  # tree nodes verified per step (0 for ar)
    seen_steps: int = 0
    seen_tokens: int = 0
    last_token_time: float | None = None
    sent_logprobs: int = 0  # output tokens whose logprobs an event carried
    sent_prompt_logprobs: bool = False


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    spec: dict
    sink: asyncio.Queue
    index: int
    stream: bool
    arrival: float
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future = field(repr=False)


_STOP = object()


def _post(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Run ``fn(*args)`` on the event loop's thread (a closed loop has nobody left to tell)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _resolve(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


class AsyncEngine:
    def __init__(self, llm, metrics=None):
        self.llm = llm
        self.engine = llm.engine
        self.metrics = metrics
        self.config = self.engine.config
        self.max_model_len = self.engine.max_model_len
        # Per-request method/budget: passed on when the engine's add_request takes them.
        self.supports_per_request_spec = {"method", "budget"} <= set(
            inspect.signature(self.engine.add_request).parameters)
        self._inbox: queue.Queue = queue.Queue()
        self._live: dict[str, _Live] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._drain_deadline: float | None = None  # engine thread only
        self.fatal_error: str | None = None

    # ---- lifecycle (event-loop side) ---------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._thread = threading.Thread(target=self._run, name="ddtree-engine", daemon=True)
        self._thread.start()
        self._accepting = True

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        return self._accepting and self.alive

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new requests; in-flight ones may finish for ``grace_s`` seconds, then get an error."""
        self._accepting = False
        self._inbox.put(("drain", time.monotonic() + max(0.0, grace_s)))

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the engine thread (blocking); requests still in flight get an error event."""
        self._accepting = False
        if self._thread is None:
            return
        self._inbox.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("engine thread did not stop within %.0fs", timeout)

    # ---- requests (event-loop side) ----------------------------------------------------------
    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                  sink: asyncio.Queue, index: int = 0, prompt: str | None = None, spec: dict | None = None,
                  stream: bool = True, arrival: float | None = None) -> None:
        """Queue one request; returns once the engine accepted it. Raises ValueError (the engine's
        validation message) or EngineUnavailable. Progress then arrives on ``sink`` as Events."""
        if not self.accepting:
            raise EngineUnavailable("the server is shutting down" if self._thread is not None
                                    else "the engine is not running")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        cmd = _Add(request_id, prompt_token_ids, params, prompt, dict(spec or {}), sink, index, stream,
                   time.monotonic() if arrival is None else arrival, loop, done)
        self._inbox.put(("add", cmd))
        try:
            await done
        except asyncio.CancelledError:
            self.abort(request_id)
            raise

    def abort(self, request_id: str) -> None:
        """Abort a request (client gone): its KV blocks are freed on the engine thread's next turn."""
        self._inbox.put(("abort", request_id))

    # ---- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished()
                cmds = []
                if not busy:
                    try:
                        cmds.append(self._inbox.get(timeout=1.0))
                    except queue.Empty:
                        pass
                while True:
                    try:
                        cmds.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                if any(c is _STOP for c in cmds):
                    # Still answer the adds that came before the stop.
                    for c in cmds[:cmds.index(_STOP)]:
                        self._command(c)
                    break
                for c in cmds:
                    self._command(c)
                if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
                    for rid in list(self._live):
                        self._fail(rid, "the server is shutting down")
                if self.engine.has_unfinished():
                    self._step()
                self._update_gauges()
        except BaseException as e:  # noqa: BLE001 - keep the thread's death visible
            self.fatal_error = f"{type(e).__name__}: {e}"
            log.exception("engine thread crashed")
        finally:
            self._accepting = False
            for rid in list(self._live):
                self._fail(rid, "the server is shutting down")
            # Adds still queued are refused.
            while True:
                try:
                    c = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(c, tuple) and c[0] == "add":
                    _post(c[1].loop, _resolve, c[1].done, EngineUnavailable("the server is shutting down"))
            self._update_gauges()

    def _command(self, cmd) -> None:
        kind, arg = cmd
        if kind == "add":
            self._add(arg)
        elif kind == "abort":
            self._abort(arg)
        elif kind == "drain":
            self._drain_deadline = arg

    def _add(self, c: _Add) -> None:
        if self._drain_deadline is not None:
            _post(c.loop, _resolve, c.done, EngineUnavailable("the server is shutting down"))
            return
        try:
            seq = self.engine.add_request(c.prompt_token_ids, c.params, prompt=c.prompt, request_id=c.request_id,
                                          **c.spec)
        except ValueError as e:
            _post(c.loop, _resolve, c.done, ValueError(str(e)))
            return
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the engine
            log.exception("add_request failed for %s", c.request_id)
            _post(c.loop, _resolve, c.done, EngineError(f"could not add the request: {e}"))
            return
        method = getattr(seq, "method", self.config.method)
        budget = getattr(seq, "budget", self.config.budget)
        self._live[c.request_id] = _Live(seq, c.sink, c.loop, c.index, c.stream, c.arrival,
                                         self._draft_tokens(method, budget))
        _post(c.loop, _resolve, c.done, None)

    def _draft_tokens(self, method: str, budget: int) -> int:
        if method == "ddtree":
            return budget
        if method == "dflash":
            return max(0, getattr(self.llm.drafter, "block_size", 1) - 1)
        return 0

    def _abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        try:
            self.engine.abort(request_id)
        except Exception:  # noqa: BLE001
            log.exception("abort of %s failed", request_id)
        if live is not None and self.metrics is not None:
            self.metrics.finished("abort")

    def _fail(self, request_id: str, message: str, live: _Live | None = None) -> None:
        """Error event to the client, then abort (frees the KV blocks)."""
        live = self._live.get(request_id, live)
        self._abort(request_id)
        if live is not None:
            _post(live.loop, live.sink.put_nowait, Event(live.index, error=message))

    def _step(self) -> None:
        try:
            progressed = self.engine.step()
        except Exception as e:  # noqa: BLE001
            log.exception("engine step failed")
            if self.metrics is not None:
                self.metrics.engine_step_errors.inc()
            # The step's batch = the running requests, plus any request that left the scheduler
            # during the failed step (it would otherwise never hear back).
            waiting = {s.request_id for s in self.engine.scheduler.waiting}
            victims = [s.request_id for s in list(self.engine.scheduler.running)]
            victims += [rid for rid in self._live if rid not in waiting and rid not in victims]
            if not victims:  # nothing was running: the failure is not tied to a batch
                victims = list(self._live) + [rid for rid in waiting if rid not in self._live]
            for rid in victims:
                self._fail(rid, f"the engine failed while running this request: {type(e).__name__}: {e}")
            return
        now = time.monotonic()
        lives = [self._live.get(seq.request_id) for seq in progressed]
        # A request that finished without being reported as progressed must still hear back.
        reported = {seq.request_id for seq in progressed}
        lives += [live for rid, live in self._live.items() if live.seq.is_finished and rid not in reported]
        for live in lives:
            if live is None:
                continue
            try:
                self._publish(live, now)
            except Exception as e:  # noqa: BLE001 - fail this request only
                rid = live.seq.request_id
                log.exception("request %s failed", rid)
                self._fail(rid, f"the engine failed while running this request: {type(e).__name__}: {e}", live)

    def _make_event(self, live: _Live) -> Event:
        seq = live.seq
        event = Event(live.index, seq.text, seq.num_output_tokens, seq.num_prompt_tokens, seq.finish_reason)
        if seq.logprobs is not None and (live.stream or seq.is_finished):
            start = min(live.sent_logprobs, len(seq.logprobs))  # earlier rounds' tokens are never cut
            out = seq.output_token_ids
            event.logprobs = [(out[j], lp, best) for j, (lp, best) in enumerate(seq.logprobs[start:], start)]
            live.sent_logprobs = len(seq.logprobs)
        if seq.prompt_logprobs is not None and not live.sent_prompt_logprobs and (live.stream or seq.is_finished):
            prompt = seq.token_ids[:seq.num_prompt_tokens]
            event.prompt_logprobs = [(prompt[0], None, None)] + [
                (t, *(entry or (None, None))) for t, entry in zip(prompt[1:], seq.prompt_logprobs)]
            live.sent_prompt_logprobs = True
        return event

    def _publish(self, live: _Live, now: float) -> None:
        seq, m = live.seq, self.metrics
        event = self._make_event(live)
        steps = seq.metrics.accepted_lengths
        new_tokens = seq.num_output_tokens - live.seen_tokens
        if m is not None:
            drafted = seq.metrics.draft_tokens
            for i, committed in enumerate(steps[live.seen_steps:], live.seen_steps):
                m.verify_step(committed, drafted[i] if i < len(drafted) else live.draft_tokens)
            if new_tokens > 0:
                if live.last_token_time is None:
                    m.ttft.observe(now - live.arrival)
                    if new_tokens > 1:  # several tokens in the first step: the rest came at once
                        for _ in range(new_tokens - 1):
                            m.itl.observe(0.0)
                else:
                    gap = (now - live.last_token_time) / new_tokens
                    for _ in range(new_tokens):
                        m.itl.observe(gap)
                m.generation_tokens.inc(new_tokens)
        live.seen_steps = len(steps)
        if new_tokens > 0:
            live.seen_tokens = seq.num_output_tokens
            live.last_token_time = now
        if seq.is_finished:
            self._live.pop(seq.request_id, None)
            if m is not None:
                m.e2e.observe(now - live.arrival)
                m.prompt_tokens.inc(seq.num_prompt_tokens)
                m.finished(seq.finish_reason or "stop")
        if live.stream or seq.is_finished:
            _post(live.loop, live.sink.put_nowait, event)

    def _update_gauges(self) -> None:
        m = self.metrics
        if m is None:
            return
        try:
            m.num_running.set(len(self.engine.scheduler.running))
            m.num_waiting.set(len(self.engine.scheduler.waiting))
            blocks = self.engine.blocks
            m.kv_usage.set(1.0 - blocks.num_free / max(1, blocks.num_blocks))
        except Exception:  # noqa: BLE001
            log.exception("gauge update failed")
