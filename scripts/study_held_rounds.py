"""Would another threshold for held rounds pay? Replays the engine's rule (``LLMEngine._ends_soon``:
hold the round behind one in flight when at least 1 in ODDS of the sequence's last
ENDS_SOON_WINDOW rounds would have finished it) on the rounds of a traced c=1 bench run, for
several ODDS. At T=0 the tokens do not depend on holding, so each request's accepted lengths are
the same under every rule. A wrong hold (the request did not end) costs a fresh round's host
gap, a round launched behind the last one is dropped and delays the next prefill.

    python scripts/study_held_rounds.py bench/results/trace_he_t0_c1_h100.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ddtree.bench.speed import request_lengths
from ddtree.engine.llm_engine import ENDS_SOON_ODDS, ENDS_SOON_WINDOW


def requests(trace: list[dict], lengths: list[int]) -> list[tuple[int, list[int]]]:
    """(max_tokens, accepted length of each round) per request of a c=1 run, in order."""
    out, rounds, left = [], [], lengths[0]
    for e in trace:
        rounds.append(int(e["tau"]))
        left -= e["tau"]
        if left <= 0:
            out.append((lengths[len(out)], rounds))
            rounds = []
            left = lengths[len(out)] if len(out) < len(lengths) else 0
    return out


def replay(reqs, odds: int) -> dict:
    held = wrong = dropped = 0
    for max_tokens, accepted in reqs:
        done = 0
        for j, n in enumerate(accepted):  # round j in flight: launch j + 1 behind it?
            left = max_tokens - done
            recent = accepted[max(0, j - ENDS_SOON_WINDOW):j]
            hold = left <= 1 if not recent else sum(a >= left for a in recent) * odds > len(recent)
            ends = n >= left
            held += hold
            wrong += hold and not ends
            dropped += ends and not hold
            done += n
    return {"odds": odds, "held": held, "wrong_holds": wrong, "dropped": dropped}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench_json", help="a `ddtree bench --auto-trace` run at concurrency 1")
    p.add_argument("--odds", default="2,4,5,10,20,1000")
    p.add_argument("--wrong-hold-ms", type=float, default=0.3, help="cost of a wrong hold (README: ~0.3 ms)")
    p.add_argument("--dropped-ms", type=float, default=1.2, help="cost of a dropped round (README: ~1.2 ms)")
    args = p.parse_args()
    data = json.loads(Path(args.bench_json).read_text())
    max_tokens = data["meta"]["max_tokens"]
    for r in data["results"]:
        if r["concurrency"] != 1 or r["temperature"] != 0 or not r.get("auto_trace_runs") or r["budget"] == "auto":
            continue
        run = r["auto_trace_runs"][0]
        count = data["meta"]["requests_per_run"]["1"]
        reqs = requests(run["auto_trace"], request_lengths(max_tokens, count, data["meta"]["fixed_lengths"]))
        base = replay(reqs, ENDS_SOON_ODDS)
        print(f"{r['dataset']} {r['method']}:{r['budget']} ({len(reqs)} requests, {run['wall_s'] * 1e3:.0f} ms; "
              f"traced held/dropped {r['held_rounds']}/{r['dropped_rounds']})")
        for odds in [int(o) for o in args.odds.split(",")]:
            got = replay(reqs, odds)
            saved = ((base["wrong_holds"] - got["wrong_holds"]) * args.wrong_hold_ms
                     + (base["dropped"] - got["dropped"]) * args.dropped_ms)
            print(f"  1 in {odds:4d}: held {got['held']:3d}, wrong {got['wrong_holds']:3d}, dropped {got['dropped']:2d}"
                  f" -> {saved:+6.1f} ms a run against 1 in {ENDS_SOON_ODDS} ({saved / (run['wall_s'] * 1e3):+.2%})")


if __name__ == "__main__":
    main()
