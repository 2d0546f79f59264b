"""Where a traced bench run's time goes, plain decoding against ``auto`` (``ddtree bench
--auto-trace`` records every round of every method): per cell, full-batch rounds split into
overlapped ones (launched behind an unread round) and fresh ones (after a prefill or a change of
batch), the tail below full batch, and the time between rounds (prefills, scheduling).

python -m ddtree.bench.trace bench/results/bench_h200_before_fused_compaction.json --concurrency 64
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics


def summarize(row: dict) -> dict:
    """One bench row with an ``auto_trace`` -> medians (ms), token rates (tokens/ms) and gaps."""
    c = row["concurrency"]
    rounds = [e for e in row["auto_trace"] if e.get("s") is not None]
    full = [e for e in rounds if e["n"] >= c]
    tail = [e for e in rounds if e["n"] < c]

    def ms(rs):
        return round(statistics.median(e["s"] for e in rs) * 1e3, 3) if rs else None

    def rate(rs):
        s = sum(e["s"] for e in rs)
        return round(sum(e["n"] * e["tau"] for e in rs) / s / 1e3, 2) if s else None

    return {"full_overlapped_ms": ms([e for e in full if e["after"]]),
            "full_fresh_ms": ms([e for e in full if not e["after"]]),
            "full_rounds": len(full), "full_tokens_per_ms": rate(full),
            "tail_rounds": len(tail), "tail_tokens_per_ms": rate(tail),
            "between_rounds_s": round(row["wall_s"] - sum(e["s"] for e in rounds), 4)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddtree.bench.trace", description=__doc__)
    p.add_argument("bench_json", help="a bench JSON (or .json.gz)")
    p.add_argument("--concurrency", type=int, default=64)
    args = p.parse_args(argv)
    opener = gzip.open if args.bench_json.endswith(".gz") else open
    with opener(args.bench_json, "rt") as f:
        results = json.load(f)["results"]
    rows = [r for r in results
            if r["concurrency"] == args.concurrency and (r.get("auto_trace") or r.get("auto_trace_runs"))]
    if not rows:
        raise SystemExit(f"{args.bench_json}: no traced rows at concurrency {args.concurrency} "
                         "(run ddtree bench with --auto-trace)")
    for r in rows:
        name = "auto" if r["budget"] == "auto" else f"{r['method']}:{r['budget']}"
        # Every repeat (older files kept only the reported repeat's, as the row's auto_trace).
        for i, run in enumerate(r.get("auto_trace_runs") or [r]):
            tag = f" #{i + 1}" if "auto_trace_runs" in r else ""
            print(f"{r['dataset']:9s} T={r['temperature']:g} {name + tag:10s}",
                  summarize({"concurrency": r["concurrency"], **run}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
