"""Tree temperature sweep: tau of DDTree when the tree is built from the drafter's distribution at
temperature t (log_softmax(logits / t)), for greedy and sampled requests apart. The tree is a
heuristic (verification keeps decoding lossless), so any t is correct; this measures which t
picks the nodes the target accepts most. The chain's argmax does not depend on t.

python scripts/device/sweep_tree_temperature.py --target ... --prompts-json .stage/eval_prompts.json \
    --out $OUT/tree_temperature_h200.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ddtree import LLM
from ddtree.bench.eval_drafter import run_setting


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default=None)
    p.add_argument("--drafter", default=None)
    p.add_argument("--prompts-json", required=True)
    p.add_argument("--budgets", default="32,64")
    p.add_argument("--greedy-temps", default="0.5,0.7,1.0,1.4")
    p.add_argument("--sampled-temps", default="0.7,1.0,1.3,1.6,2.0")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    llm = LLM(target=args.target, drafter=args.drafter, method="ddtree", budget=max(budgets),
              max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=16384, kv_cache_gb=16)
    convs = json.loads(Path(args.prompts_json).read_text())
    rows = []
    for name, cs in convs.items():
        ids = [llm.apply_chat_template(c) for c in cs]
        for t_req, temps in ((0.0, args.greedy_temps), (1.0, args.sampled_temps)):
            for t in map(float, temps.split(",")):
                llm.engine.runner.tree_temperature.fill_(1.0)
                llm.engine.runner.tree_temperature[int(t_req > 0)] = t
                for b in budgets:
                    r = run_setting(llm, ids, "ddtree", b, t_req, args.max_tokens, 0)
                    r.update(dataset=name, tree_temperature=t)
                    r.pop("histogram")
                    rows.append(r)
                    print(f"{name:9s} T={t_req:g} tree_t={t:.1f} B={b:3d} tau={r['tau']:.3f}", flush=True)
    Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "max_tokens": args.max_tokens,
                                          "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
