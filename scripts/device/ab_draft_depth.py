"""An 8-node tree drafting 8 depths (the engine now) against all 15 of the block (before), side by
side: two engines, runs alternating, HumanEval requests, mixed lengths as in ``ddtree bench``.
The trees are the same (tests/test_tree.py), so tau must match at T=0; only the time differs.

python scripts/device/ab_draft_depth.py --target X.gguf --prompts-json .stage/eval_prompts.json \
    --out $OUT/ab_draft_depth_h200.json
"""
import argparse
import json
import statistics
from pathlib import Path

import torch

from ddtree import LLM
from ddtree.bench.speed import request_lengths, run_closed_loop, warm_up

p = argparse.ArgumentParser()
p.add_argument("--target", required=True)
p.add_argument("--prompts-json", required=True)
p.add_argument("--out", required=True)
p.add_argument("--budget", type=int, default=8)
p.add_argument("--concurrency", default="1,16,64")
p.add_argument("--temperatures", default="0,1")
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--max-tokens", type=int, default=128)
args = p.parse_args()

engines = {}
for name in ("cut", "full"):
    llm = LLM(target=args.target, method="ddtree", budget=args.budget, max_budget=args.budget, device="cuda",
              dtype="bfloat16", max_num_seqs=64, kv_cache_gb=8)
    if name == "full":
        llm.engine.runner.draft_depth = lambda kind, r=llm.engine.runner: r.drafter.block_size - 1
    engines[name] = llm
convs = json.loads(Path(args.prompts_json).read_text())["humaneval"]
llm0 = engines["cut"]
ids = [llm0.apply_chat_template(c) for c in convs]
rows = []
for t in [float(x) for x in args.temperatures.split(",")]:
    for c in [int(x) for x in args.concurrency.split(",")]:
        count = max(32, 4 * c)
        batch = [ids[i % len(ids)] for i in range(count)]
        lengths = request_lengths(args.max_tokens, count, False)
        runs = {name: [] for name in engines}
        for name, llm in engines.items():
            warm_up(llm, batch, "ddtree", args.budget, t, c, lengths)
        for _ in range(args.repeats):
            for name, llm in engines.items():
                runs[name].append(run_closed_loop(llm, batch, "ddtree", args.budget, t, lengths, c))
        row = {"temperature": t, "concurrency": c, "budget": args.budget}
        for name, rs in runs.items():
            row[name] = {"tokens_per_s_runs": [r["tokens_per_s"] for r in rs],
                         "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                         "tau": statistics.median(r["tau"] for r in rs),
                         "ms_per_step": statistics.median(r["wall_s"] / r["engine_decode_steps"] * 1e3 for r in rs)}
        row["cut_over_full"] = row["cut"]["tokens_per_s"] / row["full"]["tokens_per_s"]
        rows.append(row)
        print(f"T={t:g} c={c:3d} B={args.budget}: cut {row['cut']['tokens_per_s']:9.1f} tok/s tau {row['cut']['tau']:.3f} | "
              f"full {row['full']['tokens_per_s']:9.1f} tau {row['full']['tau']:.3f} | cut/full {row['cut_over_full']:.3f}",
              flush=True)
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
