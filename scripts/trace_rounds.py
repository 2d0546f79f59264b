"""Where a closed-loop bench run's wall time goes, from `ddtree bench --auto-trace` rows: overlapped
rounds (launched before the previous one was read), fresh rounds (after a prefill, a held round or a
change of batch) and the rest (prefills, reads and the host's work before fresh rounds), per repeat.
A traced round's ``s`` is what the engine charges it: the time since the previous read when
overlapped, from its launch (or the end of the prefill before it) to its read when fresh.

python scripts/trace_rounds.py bench/results/trace_he_t0_c1_h100.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def split(trace: list[dict], wall: float) -> dict:
    overlapped = sum(e["s"] for e in trace if e["after"])
    fresh = sum(e["s"] for e in trace if not e["after"])
    n_over = sum(e["after"] for e in trace)
    return {"rounds": len(trace), "overlapped_rounds": n_over, "overlapped_ms": overlapped * 1e3,
            "fresh_ms": fresh * 1e3, "rest_ms": (wall - overlapped - fresh) * 1e3, "wall_ms": wall * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bench_json")
    args = p.parse_args()
    rows = [r for r in json.loads(Path(args.bench_json).read_text())["results"] if r.get("auto_trace_runs")]
    if not rows:
        raise SystemExit(f"{args.bench_json}: no auto_trace_runs (run `ddtree bench` with --auto-trace)")
    print("cell | method | repeat | rounds (overlapped) | ms per overlapped round | overlapped / fresh / rest ms | wall ms")
    for r in rows:
        name = f"{r['method']}:{r['budget']}"
        cell = f"{r['dataset']} T={r['temperature']:g} c={r['concurrency']}"
        for i, run in enumerate(r["auto_trace_runs"]):
            s = split(run["auto_trace"], run["wall_s"])
            print(f"{cell} | {name} | {i} | {s['rounds']} ({s['overlapped_rounds']}) | "
                  f"{s['overlapped_ms'] / max(1, s['overlapped_rounds']):.3f} | "
                  f"{s['overlapped_ms']:.1f} / {s['fresh_ms']:.1f} / {s['rest_ms']:.1f} | {s['wall_ms']:.1f}")


if __name__ == "__main__":
    main()
