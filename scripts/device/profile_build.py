"""GPU time of the tree build's two parts, each captured in a CUDA graph: the per-depth top-k over
the vocabulary (``topk_triton``) and the whole ``build_tree_triton`` (top-k + the tree kernel),
for batch sizes and budgets; random drafter log-probabilities of the SmolLM2 shape (15 x 49152) of
three kinds, since the tree kernel stops at the first depth that cannot enter the tree:
"spread" (randn * 3 logits: ~4 % for the likeliest token, bushy trees of depth ~2), "deep" (one
token per depth 12 logits ahead of randn * 2, ~30 % likely: the deepest of the three, trees of
depth 4-5 at B >= 32) and "mixed" (that token 0-12 logits ahead, uniformly per depth: depth 1-2).
All are shallower than the drafter's trees on real prompts (τ 2-3 at B=32, chains of 15 at
times), so they show the early stop at its most useful; the c=1 bench shows the real effect. ``--baseline FILE``: also time the
``build_tree_triton`` of another copy of ``triton_tree.py`` on the same inputs and check that both
give the same trees. Each row also times the round's path (logits in, the top-k normalises the
entries it keeps) against a log-softmax followed by the build, and says whether their trees agree. (It replaces build_bench.py, which set the Triton builder against the torch one
at several warp counts when the builder was chosen; an earlier rank-by-counting selection it
measured, 0.22 ms at B=32 and 1.8 ms at B=128 against 0.19 / 0.41 ms for sorting, was removed.)

python scripts/device/profile_build.py --out $OUT/profile_build_h200.json [--baseline OLD.py]
"""
from __future__ import annotations

import argparse
import importlib.util
import json

import torch

from ddtree.kernels.triton_tree import _plan, build_tree_triton, topk_triton


def graph_ms(fn, reps: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def drafter_like(kind: str, n: int, depth: int, vocab: int) -> torch.Tensor:
    logits = torch.randn(n, depth, vocab, device="cuda") * (3 if kind == "spread" else 2)
    if kind != "spread":
        lead = torch.full((n, depth), 12.0, device="cuda") if kind == "deep" else \
            torch.rand(n, depth, device="cuda") * 12
        top = torch.randint(0, vocab, (n, depth, 1), device="cuda")
        logits.scatter_add_(2, top, lead[..., None])
    return logits


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--depth", type=int, default=15)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--baseline", help="another triton_tree.py to time on the same inputs")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--budgets", default="16,32,48,64,128")
    args = p.parse_args()
    baseline = None
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_triton_tree", args.baseline)
        baseline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baseline)
    torch.manual_seed(0)
    rows = []
    for kind in ("spread", "mixed", "deep"):
        for n in map(int, args.batches.split(",")):
            logits = drafter_like(kind, n, args.depth, args.vocab)
            lp = torch.log_softmax(logits, -1)
            roots = torch.zeros(n, dtype=torch.long, device="cuda")
            for budget in map(int, args.budgets.split(",")):
                K = _plan(budget, args.depth, args.vocab, lp.device)[0]
                topk = graph_ms(lambda: topk_triton(lp, K))
                whole = graph_ms(lambda: build_tree_triton(lp, budget, roots))
                tree = build_tree_triton(lp, budget, roots)
                # The round's path: logits in, the top-k normalises (against log-softmax, then build).
                from_logits = graph_ms(lambda: build_tree_triton(logits, budget, roots, normalize=True))
                softmax_build = graph_ms(lambda: build_tree_triton(torch.log_softmax(logits, -1), budget, roots))
                same_norm = all(torch.equal(a, b) for a, b in
                                zip(tree, build_tree_triton(logits, budget, roots, normalize=True)))
                row = {"kind": kind, "n": n, "budget": budget, "topk_ms": topk, "build_ms": whole,
                       "tree_kernel_ms": whole - topk, "mean_tree_depth": tree[2].max(1).values.float().mean().item(),
                       "from_logits_ms": from_logits, "log_softmax_then_build_ms": softmax_build,
                       "from_logits_same_trees": same_norm}
                line = f"{kind:6s} n={n:3d} B={budget:4d} depth {row['mean_tree_depth']:5.2f} topk {topk:.4f} ms  " \
                       f"build {whole:.4f} ms  tree kernel {whole - topk:.4f} ms  from logits {from_logits:.4f} " \
                       f"vs log-softmax+build {softmax_build:.4f} ms (same {same_norm})"
                if baseline is not None:
                    old = graph_ms(lambda: baseline.build_tree_triton(lp, budget, roots))
                    same = all(torch.equal(a, b) for a, b in zip(tree, baseline.build_tree_triton(lp, budget, roots)))
                    row.update(baseline_build_ms=old, baseline_tree_kernel_ms=old - topk, same_trees=same)
                    line += f" | baseline build {old:.4f} ms, tree kernel x{(whole - topk) / (old - topk):.2f}, same {same}"
                rows.append(row)
                print(line, flush=True)
    json.dump({"gpu": torch.cuda.get_device_name(), "depth": args.depth, "vocab": args.vocab,
               "baseline": args.baseline, "rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
