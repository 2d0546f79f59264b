"""Load test of a running ``ddtree serve`` (a benchmark, not a test).

Sends N requests (default 500) with random prompt and output lengths at a fixed concurrency
(default 32) to a server on this machine, streaming, and reports completed / failed / lost,
latency and TTFT percentiles, tokens/s and tau (read from the server's /metrics). Writes JSON.

- completed: the stream ended with a finish_reason, a usage chunk and ``data: [DONE]``;
- failed: the server answered an HTTP error or an error event;
- lost: anything else (connection dropped, stream cut short, per-request timeout);
- unfinished: still in flight at ``--time-limit`` (cancelled by this client) or never sent.

    ddtree serve --drafter random --budget 8 &
    python bench/load_test.py --num-requests 500 --concurrency 32 --min-tokens 16 --max-tokens 48

Only loopback addresses are accepted. The run is bounded by ``--time-limit`` seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one "
         "had by word but not what all were we when your can said there use an each which she do how their "
         "if will up other about out many then them these so some her would make like him into time has look "
         "two more write go see number no way could people my than first water been call who oil its now "
         "find long down day did get come made may part over new sound take only little work know place year "
         "live me back give most very after thing our just name good sentence man think say great where help "
         "through much before line right too mean old any same tell boy follow came want show also around "
         "form three small set put end does another well large must big even such because turn here why ask "
         "went men read need land different home us move try kind hand picture again change off play spell "
         "air away animal house point page letter mother answer found study still learn should america world").split()


def percentile(values, q):
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def parse_metrics(text: str) -> dict[str, float]:
    """Sum of each metric's samples over labels (enough for counters and single gauges)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([^\s{]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            try:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
            except ValueError:
                pass
    return out


def per_pos(text: str) -> dict[int, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(r'^ddtree:spec_decode_num_accepted_tokens_per_pos_total\{.*position="(\d+)".*\}\s+(\S+)$', line)
        if m:
            out[int(m.group(1))] = float(m.group(2))
    return out


async def one_request(client: httpx.AsyncClient, url: str, model: str, rec: dict, endpoint: str) -> None:
    body = {"model": model, "max_tokens": rec["max_tokens"], "temperature": rec["temperature"], "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": rec["prompt"]}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = rec["prompt"]
        path = "/v1/completions"
    start = time.perf_counter()
    rec["status"] = "lost"
    rec["sent"] = True
    try:
        async with client.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                rec["status"], rec["error"] = "failed", f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            done = finished = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec["status"], rec["error"] = "failed", chunk["error"].get("message")
                    return
                for c in chunk.get("choices") or []:
                    text = c.get("text") if endpoint != "chat" else (c.get("delta") or {}).get("content")
                    if text and "ttft" not in rec:
                        rec["ttft"] = time.perf_counter() - start
                    if c.get("finish_reason"):
                        finished = True
                        rec["finish_reason"] = c["finish_reason"]
                if chunk.get("usage"):
                    rec["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
                    rec["completion_tokens"] = chunk["usage"]["completion_tokens"]
            rec["latency"] = time.perf_counter() - start
            if done and finished and "completion_tokens" in rec:
                rec["status"] = "completed"
            else:
                rec["error"] = "stream ended without finish_reason, usage and [DONE]"
    except asyncio.CancelledError:
        rec["status"], rec["error"] = "unfinished", "cancelled at the time limit"
        raise
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec["status"], rec["error"] = "lost", f"{type(e).__name__}: {e}"


async def run(args) -> dict:
    url = args.url.rstrip("/")
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout),
                                 limits=httpx.Limits(max_connections=args.concurrency + 4)) as client:
        models = (await client.get(url + "/v1/models")).json()["data"]
        model = args.model or models[0]["id"]
        server_info = {k: models[0].get(k) for k in ("id", "max_model_len", "speculative")}
        metrics_before = (await client.get(url + "/metrics")).text
        records = []
        for i in range(args.num_requests):
            n_words = rng.randint(args.min_prompt_words, args.max_prompt_words)
            records.append({"i": i, "prompt": " ".join(rng.choice(WORDS) for _ in range(n_words)),
                            "prompt_words": n_words,
                            "max_tokens": rng.randint(args.min_tokens, args.max_tokens),
                            "temperature": 0.0 if rng.random() < args.greedy_share else 0.8})
        todo: asyncio.Queue = asyncio.Queue()
        for rec in records:
            rec["status"] = "unfinished"
            todo.put_nowait(rec)
        start = time.perf_counter()

        async def worker():
            while time.perf_counter() - start < args.time_limit:
                try:
                    rec = todo.get_nowait()
                except asyncio.QueueEmpty:
                    return
                endpoint = args.endpoint if args.endpoint != "mixed" else ("chat" if rec["i"] % 2 else "completions")
                rec["endpoint"] = endpoint
                await one_request(client, url, model, rec, endpoint)

        workers = [asyncio.create_task(worker()) for _ in range(args.concurrency)]
        _, pending = await asyncio.wait(workers, timeout=args.time_limit)
        for w in pending:
            w.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - start
        await asyncio.sleep(0.5)  # let the server process aborts before reading its gauges
        metrics_after_text = (await client.get(url + "/metrics")).text
        health = (await client.get(url + "/health")).status_code

    before, after = parse_metrics(metrics_before), parse_metrics(metrics_after_text)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafts = delta("ddtree:spec_decode_num_drafts_total")
    accepted = delta("ddtree:spec_decode_num_accepted_tokens_total")
    pos_before, pos_after = per_pos(metrics_before), per_pos(metrics_after_text)
    ok = [r for r in records if r["status"] == "completed"]
    out_tokens = sum(r["completion_tokens"] for r in ok)
    in_tokens = sum(r["prompt_tokens"] for r in ok)
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if "ttft" in r]
    tpot = [(r["latency"] - r["ttft"]) / (r["completion_tokens"] - 1) for r in ok
            if "ttft" in r and r["completion_tokens"] > 1]
    ms = lambda xs, q: None if not xs else round(1000 * percentile(xs, q), 1)  # noqa: E731
    summary = {
        "requests": len(records),
        "completed": len(ok),
        "failed": sum(r["status"] == "failed" for r in records),
        "lost": sum(r["status"] == "lost" for r in records),
        "unfinished": sum(r["status"] == "unfinished" for r in records),
        "wall_s": round(wall, 2),
        "request_throughput_per_s": round(len(ok) / wall, 3),
        "output_tokens": out_tokens,
        "prompt_tokens": in_tokens,
        "output_tokens_per_s": round(out_tokens / wall, 2),
        "total_tokens_per_s": round((out_tokens + in_tokens) / wall, 2),
        "latency_ms": {"p50": ms(lat, 50), "p90": ms(lat, 90), "p99": ms(lat, 99), "mean": ms([statistics.mean(lat)] if lat else [], 50)},
        "ttft_ms": {"p50": ms(ttft, 50), "p90": ms(ttft, 90), "p99": ms(ttft, 99)},
        "tpot_ms": {"p50": ms(tpot, 50), "p90": ms(tpot, 90), "p99": ms(tpot, 99)},
        "spec_decode": {
            "num_drafts": drafts,
            "num_draft_tokens": delta("ddtree:spec_decode_num_draft_tokens_total"),
            "num_accepted_tokens": accepted,
            "tau": round((accepted + drafts) / drafts, 4) if drafts else None,
            "acceptance_rate": round(accepted / delta("ddtree:spec_decode_num_draft_tokens_total"), 4)
            if delta("ddtree:spec_decode_num_draft_tokens_total") else None,
            "accepted_per_pos": {p: pos_after[p] - pos_before.get(p, 0.0) for p in sorted(pos_after)},
            "server_mean_acceptance_length_gauge": after.get("ddtree:spec_decode_mean_acceptance_length"),
            "budget": after.get("ddtree:spec_decode_budget"),
        },
        "server_after": {"health": health, "num_requests_running": after.get("ddtree:num_requests_running"),
                         "num_requests_waiting": after.get("ddtree:num_requests_waiting"),
                         "kv_cache_usage_perc": after.get("ddtree:kv_cache_usage_perc"),
                         "engine_step_errors": delta("ddtree:engine_step_errors_total")},
        "errors": sorted({r.get("error") for r in records if r.get("error")})[:10],
    }
    config = {k: v for k, v in vars(args).items() if k != "out"}
    config["started"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - wall))
    config["model"] = model
    config["server"] = server_info
    per_request = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "prompt"}
                   for r in records]
    return {"config": config, "summary": summary, "requests": per_request}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback only)")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--endpoint", default="mixed", choices=["completions", "chat", "mixed"])
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--min-prompt-words", type=int, default=4)
    p.add_argument("--max-prompt-words", type=int, default=200)
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--greedy-share", type=float, default=0.5, help="share of requests at temperature 0 (else 0.8)")
    p.add_argument("--time-limit", type=float, default=600.0, help="seconds; open requests are then cancelled")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", default=None, help="free text stored with the results (hardware, server flags)")
    p.add_argument("--out", default=None, help="JSON path (default: bench/results/load_test_<time>.json)")
    args = p.parse_args(argv)
    host = urlparse(args.url).hostname
    if host not in LOOPBACK and not (host or "").startswith("127."):
        print(f"refusing {args.url}: the load test only targets this machine (127.0.0.0/8, localhost, ::1)",
              file=sys.stderr)
        return 2
    result = asyncio.run(run(args))
    out = Path(args.out) if args.out else \
        Path(__file__).resolve().parent / "results" / f"load_test_{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {out}")
    s = result["summary"]
    return 0 if s["completed"] == s["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
