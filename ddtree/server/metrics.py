"""Prometheus metrics of one server app (a dedicated CollectorRegistry, never the global one).

Names follow vLLM's where one exists (``vllm:`` -> ``ddtree:``). Speculative decoding counters:

- ``ddtree:spec_decode_num_drafts_total``: verify steps of requests that used a drafter
  (one draft = one request's tree in one step).
- ``ddtree:spec_decode_num_draft_tokens_total``: draft tokens (tree nodes) verified. The engine
  does not report node counts per step, so this is derived: ``budget`` per step for ddtree (the
  tree always has exactly B non-root nodes), ``block_size - 1`` for the dflash chain, 0 for ar.
- ``ddtree:spec_decode_num_accepted_tokens_total``: draft tokens accepted (committed tokens per
  step minus the bonus token).
- ``ddtree:spec_decode_num_accepted_tokens_per_pos_total{position}``: accepted draft tokens by
  depth in the tree (position 0 = depth 1), as vLLM's counter of the same name.
- ``ddtree:spec_decode_mean_acceptance_length``: tau = tokens committed per verify step, bonus
  included, over all decode steps since start (AR gives 1.0).
- ``ddtree:spec_decode_budget{method}``: the configured method and node budget.

Tokens committed after a stop condition are not counted (the engine truncates them), so tau here
is a hair below the raw acceptance length on requests that stop early.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

# No *_created series next to every counter/histogram (as vLLM; a process-wide switch).
disable_created_metrics()

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class ServerMetrics:
    def __init__(self, model_name: str, method: str, budget: int, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r, m = self.registry, {"model_name": model_name}
        labels = list(m)

        def counter(name, doc, extra=()):
            return Counter(name, doc, labels + list(extra), registry=r)

        def gauge(name, doc, extra=()):
            return Gauge(name, doc, labels + list(extra), registry=r)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(**m)

        self._m = m
        self.http_requests = counter("ddtree:http_requests", "HTTP requests by endpoint and status code",
                                     ("endpoint", "status"))
        self.request_errors = counter("ddtree:request_errors", "Requests answered with an error, by type",
                                      ("endpoint", "type"))
        self.request_success = counter("ddtree:request_success", "Finished requests by finish reason",
                                       ("finished_reason",))
        self.engine_step_errors = counter("ddtree:engine_step_errors", "Engine steps that raised").labels(**m)
        self.prompt_tokens = counter("ddtree:prompt_tokens", "Prompt tokens of finished requests").labels(**m)
        self.generation_tokens = counter("ddtree:generation_tokens", "Generated tokens").labels(**m)
        self.num_running = gauge("ddtree:num_requests_running", "Requests in the running batch").labels(**m)
        self.num_waiting = gauge("ddtree:num_requests_waiting", "Requests waiting to be scheduled").labels(**m)
        self.kv_usage = gauge("ddtree:kv_cache_usage_perc", "Share of KV-cache blocks in use (0..1)").labels(**m)
        self.ttft = histogram("ddtree:time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = histogram("ddtree:inter_token_latency_seconds",
                             "Time per output token after the first (a step committing k tokens "
                             "adds k observations of gap/k)", ITL_BUCKETS)
        self.e2e = histogram("ddtree:e2e_request_latency_seconds", "Request latency, arrival to finish",
                             E2E_BUCKETS)
        self.num_drafts = counter("ddtree:spec_decode_num_drafts", "Draft trees verified").labels(**m)
        self.num_draft_tokens = counter("ddtree:spec_decode_num_draft_tokens",
                                        "Draft tokens (tree nodes) verified: budget per step for ddtree, "
                                        "block_size-1 for dflash").labels(**m)
        self.num_accepted_tokens = counter("ddtree:spec_decode_num_accepted_tokens",
                                           "Draft tokens accepted").labels(**m)
        self.accepted_per_pos = counter("ddtree:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by tree depth (position 0 = depth 1)",
                                        ("position",))
        self.mean_acceptance_length = gauge("ddtree:spec_decode_mean_acceptance_length",
                                            "tau: tokens committed per verify step, bonus included").labels(**m)
        self.budget = gauge("ddtree:spec_decode_budget", "Configured speculative method and node budget",
                            ("method",))
        # "auto" reports -1: the budget is chosen per step (num_draft_tokens counts what ran).
        self.budget.labels(method=method, **m).set(-1 if budget == "auto" else budget)
        self._verify_steps = 0
        self._committed = 0

    def request(self, endpoint: str, status: int) -> None:
        endpoint = endpoint if endpoint in ENDPOINTS else "other"
        self.http_requests.labels(endpoint=endpoint, status=str(status), **self._m).inc()

    def error(self, endpoint: str, type_: str) -> None:
        endpoint = endpoint if endpoint in ENDPOINTS else "other"
        self.request_errors.labels(endpoint=endpoint, type=type_, **self._m).inc()

    def finished(self, reason: str) -> None:
        self.request_success.labels(finished_reason=reason, **self._m).inc()

    def verify_step(self, committed: int, draft_tokens: int) -> None:
        """One request's verify step that committed ``committed`` tokens (bonus included)."""
        self._verify_steps += 1
        self._committed += committed
        self.mean_acceptance_length.set(self._committed / self._verify_steps)
        if draft_tokens <= 0:
            return  # ar: no draft
        accepted = max(0, committed - 1)
        self.num_drafts.inc()
        self.num_draft_tokens.inc(draft_tokens)
        self.num_accepted_tokens.inc(accepted)
        for pos in range(accepted):
            self.accepted_per_pos.labels(position=str(pos), **self._m).inc()
