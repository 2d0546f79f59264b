"""Tree-attention kernel variants side by side on the round shapes of SmolLM2-135M (9 query heads
over 3 KV heads, head dim 64): plain decode (1 query, causal), drafter block (16, full), chain
verify (16, causal) and DDTree verify (5 / 9 / 17 / 33 / 64 nodes, random trees), batch 1-64, prefix
400 and 1,500. Variants: the kernel before (if present, ``attention_before.py``, made by ``git show
9f8c327:ddtree/kernels/triton_attention.py > scripts/device/attention_before.py``: 4 rows per query,
one key loop with the mask on every key tile) and the current kernel by its launch plan, with 4
rows per query (SmolLM2's 3 heads padded), with 32-row programs (4 or 2 warps), with 8 warps,
with the unmasked loop over whole tiles of cached keys on or off (by default on for more than
one query), with 128-row programs (4 or 8 warps; a 64-query tree then takes two tiles instead of
four) and with 4 or 8 key splits instead of the chosen count. Every variant's output is checked
against the current default's. ``--max-keys`` sets the launch's key bound as a captured round's
(the engine's context limit), which sizes the key splits as in the engine (batch 1-4 then get
8-16 splits).

python scripts/device/sweep_attention.py --out $OUT/attention_variants_h200.json
python scripts/device/sweep_attention.py --max-keys 2176 --contexts 300,1000 --variants default \
    --out $OUT/attention_variants_engine_bound_h200.json
# The B=63 round at batch 1 (its tree attention: 8.3 against the chain's 6.3 us per launch on an
# H100, bench/results/profile_step_h100.json), as the engine launches it (result on an H100:
# bench/results/attention_b63_h100.json, no variant faster at both contexts):
python scripts/device/sweep_attention.py --max-keys 2112 --contexts 300,1000 --batches 1,4 \
    --cases "chain,tree 63" --variants "default,m128,m128 w8,s4,s8,rows4" --out $OUT/attention_b63_h100.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch

from ddtree.bench.attention import graph_seconds, random_case
from ddtree.kernels.triton_attention import launch_plan, tree_attention

SHAPE = (9, 3, 64)
CASES = [("decode", 1, "causal"), ("drafter block", 16, "full"), ("chain", 16, "causal"),
         ("tree 4", 5, "tree"), ("tree 8", 9, "tree"), ("tree 16", 17, "tree"), ("tree 32", 33, "tree"),
         ("tree 63", 64, "tree")]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="attention_variants.json")
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--contexts", default="400,1500")
    p.add_argument("--max-keys", type=int, default=0,
                   help="the launch's bound on keys (as a captured round's: the engine's context limit); "
                        "0: each case's own length. Key splits are sized from it")
    p.add_argument("--variants", default="", help="comma-separated subset of the variants")
    p.add_argument("--cases", default="", help="comma-separated subset of the cases (e.g. 'chain,tree 63')")
    args = p.parse_args()
    variants = {"default": {}, "rows4": dict(rows_per_query=4), "m32": dict(block_m=32),
                "m32 w2": dict(block_m=32, num_warps=2), "w8": dict(num_warps=8),
                "tiles on": dict(unmasked_tiles=True), "tiles off": dict(unmasked_tiles=False),
                "rows4 off": dict(rows_per_query=4, unmasked_tiles=False), "m128": dict(block_m=128),
                "m128 w8": dict(block_m=128, num_warps=8), "s4": dict(splits=4), "s8": dict(splits=8)}
    if args.variants:
        variants = {k: v for k, v in variants.items() if k in args.variants.split(",")}
    unknown = set(filter(None, args.cases.split(","))) - {c[0] for c in CASES}
    if unknown:
        raise SystemExit(f"unknown cases {sorted(unknown)}; known: {[c[0] for c in CASES]}")
    cases = [c for c in CASES if not args.cases or c[0] in args.cases.split(",")]
    before_path = Path(__file__).with_name("attention_before.py")
    before = None
    if before_path.exists():
        spec = importlib.util.spec_from_file_location("attention_before", before_path)
        before = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(before)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            for name, new, mask in cases:
                q, k, v, ctx = random_case(SHAPE, batch, context, new, gen, mask)
                ctx.max_keys = args.max_keys or ctx.max_keys
                want = tree_attention(q, k, v, ctx, 0.125)
                row = {"case": name, "batch": batch, "context": context, "new": new, "max_keys": ctx.max_keys,
                       "plan": launch_plan(q, k, ctx), "us": {}, "max_diff": {}}
                fns = {v_name: (lambda kw=kw: tree_attention(q, k, v, ctx, 0.125, **kw)) for v_name, kw in variants.items()}
                if before is not None:
                    fns["before"] = lambda: before.tree_attention(q, k, v, ctx, 0.125)
                for v_name, fn in fns.items():
                    row["max_diff"][v_name] = (fn().float() - want.float()).abs().max().item()
                    row["us"][v_name] = graph_seconds(fn) * 1e6
                rows.append(row)
                print(f"ctx {context:5d} n {batch:3d} {name:13s}", " ".join(f"{k} {t:7.1f}" for k, t in row["us"].items()),
                      " maxdiff", max(row["max_diff"].values()), flush=True)
    Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "shape": SHAPE, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
