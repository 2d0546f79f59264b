"""Whole captured rounds with other key-split counts for the DDTree verify's attention only.

A sweep of single attention launches (``sweep_attention.py``) had 8 key splits 1 us faster than
the chosen 16 for a 64-node tree at batch 1 and 300 keys, but forcing 8 splits in every launch of
a round (drafter and chain launches included) made the rounds slower
(``bench/results/profile_splits8_rejected_h100.json``). This measures what the split count of the
tree launches alone (more than 16 queries) does to whole rounds: random weights of the
SmolLM2-135M shape, one graph per (setting, method) captured in one process, replayed on padding
rows at several context lengths, settings interleaved over several passes (the median is kept).
A setting is ``chosen`` (the engine's plan) or ``sN`` (N key splits for the tree launches only).
Graphs per key bound, which this led to, are measured end to end by ``ab_key_bounds.sh``.

PYTHONPATH=$PWD python scripts/device/ab_tree_splits.py --out $OUT/ab_tree_splits.json
    # bench/results/ab_tree_splits_h100.json (H100; that run labelled the settings splits=N)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from profile_step import SMOLLM2  # noqa: E402

from ddtree import LLM  # noqa: E402
from ddtree.bench.projection import random_model  # noqa: E402
from ddtree.engine.runner import StepGraph, StepKind  # noqa: E402
from ddtree.kernels import triton_attention  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="ab_tree_splits.json")
    p.add_argument("--contexts", default="300,500,800,1200")
    p.add_argument("--settings", default="chosen,s8,s4,s32")
    p.add_argument("--methods", default="dflash:0,ddtree:31,ddtree:63")
    p.add_argument("--batches", default="1")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args()
    settings = args.settings.split(",")
    bad = [x for x in settings if x != "chosen" and not (x[:1] == "s" and x[1:].isdigit() and int(x[1:]) > 0)]
    if bad:
        raise SystemExit(f"unknown settings {bad}: use 'chosen' or sN (N key splits, N >= 1)")
    chosen = triton_attention.kv_splits_for
    launches = set()

    def splitter(setting: str):
        forced = int(setting[1:]) if setting.startswith("s") else 0

        def splits_for(programs, max_keys, max_queries, device):
            s = forced if forced and max_queries > 16 else chosen(programs, max_keys, max_queries, device)
            launches.add((setting, programs, max_keys, max_queries, s))
            return s
        return splits_for

    device, dtype = torch.device("cuda"), torch.bfloat16
    target, drafter = random_model(SMOLLM2, 4, 16, device, dtype)
    llm = LLM(target=target, drafter=drafter, method="ddtree", budget=63, device=device, dtype=dtype,
              max_model_len=2048, max_num_seqs=4, kv_cache_gb=4)
    runner = llm.engine.runner
    contexts = [int(c) for c in args.contexts.split(",")]
    methods = [(m, int(b)) for m, b in (x.split(":") for x in args.methods.split(","))]
    times: dict[str, list[float]] = {}
    for _ in range(args.passes):
        for n in map(int, args.batches.split(",")):
            for setting in settings:
                triton_attention.kv_splits_for = splitter(setting)
                try:
                    for method, budget in methods:
                        if setting != "chosen" and method != "ddtree":
                            continue  # only DDTree's verify has more than 16 queries
                        graph = StepGraph(runner, StepKind(method, budget, "greedy", True), n,
                                          runner.graph_pool, split=False, max_keys=runner.max_context)
                        for ctx in contexts:
                            key = f"n={n} {method}:{budget} {setting} ctx={ctx}"
                            times.setdefault(key, []).append(graph.replay_seconds(ctx, args.reps) * 1e3)
                finally:
                    triton_attention.kv_splits_for = chosen
    rows = {k: {"median_ms": statistics.median(v), "runs_ms": v} for k, v in times.items()}
    for k, r in rows.items():
        print(f"{k:45s} {r['median_ms']:.4f} ms  runs {' '.join(f'{x:.4f}' for x in r['runs_ms'])}")
    print("launches (setting, programs, max_keys, max_queries, splits):", sorted(launches))
    Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows,
                                          "launches": sorted(launches)}, indent=1))


if __name__ == "__main__":
    main()
