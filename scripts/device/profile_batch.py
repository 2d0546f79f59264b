"""Where a round's GPU time goes under load (random weights of the SmolLM2-135M shape, no
checkpoint needed): for each candidate at batch n, the GPU ms of the whole captured round, of each
stage (draft / build / verify / accept / commit / context, one graph per stage with events between,
as the bench's split), and the kernels of one eager round over n sequences. Greedy and sampled
rounds both, since T=1 samples every verified row.

python scripts/device/profile_batch.py --n 64 --cands ar,dflash,ddtree:4,ddtree:8 --out $OUT/profile_batch.json
"""
from __future__ import annotations

import argparse
import json

import torch

from ddtree import LLM
from ddtree.bench.projection import random_model
from ddtree.engine.runner import STAGES, StepGraph, StepKind

from profile_step import SMOLLM2, kernel_table


KEEP = []  # captured graphs stay alive: a freed graph's pool must not be captured into again


def stage_ms(runner, kind: StepKind, n: int, context: int, reps: int = 50) -> dict:
    """GPU ms per stage of the round captured stage by stage, median over ``reps`` replays."""
    graph = StepGraph(runner, kind, n, runner.graph_pool, split=True, max_keys=runner.max_context)
    KEEP.append(graph)
    graph.replay([], context).synchronize()
    per = [[] for _ in STAGES]
    for i in range(reps):
        graph.replay([], context, slot=i % 2).synchronize()
        for k, s in enumerate(graph.stage_seconds()):
            per[k].append(s * 1e3)
    return {name: sorted(v)[len(v) // 2] for name, v in zip(STAGES, per)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="profile_batch.json")
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--cands", default="ar,dflash,ddtree:4,ddtree:8")
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--kernels", type=int, default=25, help="kernel rows kept per table (0: no tables)")
    args = p.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    target, drafter = random_model(SMOLLM2, 4, 16, device, dtype)
    cands = [(c.split(":")[0], int(c.split(":")[1]) if ":" in c else 0) for c in args.cands.split(",")]
    max_budget = max([b for _, b in cands] + [8])
    llm = LLM(target=target, drafter=drafter, method="ddtree", budget=max_budget, device=device, dtype=dtype,
              max_model_len=2048, max_num_seqs=args.n, kv_cache_gb=8)
    runner = llm.engine.runner
    result = {"gpu": torch.cuda.get_device_name(), "n": args.n, "context": args.context, "rows": []}
    for method, budget in cands:
        for sampling in ("greedy", "sample"):
            kind = StepKind(method, budget, sampling, True)
            KEEP.append(StepGraph(runner, kind, args.n, runner.graph_pool, split=False, max_keys=runner.max_context))
            whole = KEEP[-1].replay_seconds(args.context, 50)
            row = {"method": method, "budget": budget, "sampling": sampling, "round_ms": whole * 1e3,
                   "stage_ms": stage_ms(runner, kind, args.n, args.context)}
            result["rows"].append(row)
            print(f"{method}:{budget} {sampling:6s} round {whole * 1e3:6.3f} ms  " + "  ".join(
                f"{k} {v:.3f}" for k, v in row["stage_ms"].items()), flush=True)
        if args.kernels:
            table = kernel_table(llm, method, budget, args.context, n=args.n, temperature=1.0)
            row["kernels_sampled"] = dict(list(table.items())[:args.kernels])
            row["kernels_sampled_total_us"] = sum(v[1] for v in table.values())
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'cand':12s} {'greedy ms':>9s} {'sample ms':>9s}")
    for i in range(0, len(result["rows"]), 2):
        g, s = result["rows"][i], result["rows"][i + 1]
        print(f"{g['method']}:{g['budget']:<6d} {g['round_ms']:9.3f} {s['round_ms']:9.3f}")


if __name__ == "__main__":
    main()
