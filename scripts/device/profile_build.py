"""GPU time of the tree build's two parts, each captured in a CUDA graph: the per-depth top-k over
the vocabulary (``topk_triton``) and the whole ``build_tree_triton`` (top-k + the tree kernel),
for batch sizes and budgets; random drafter log-probabilities of the SmolLM2 shape (15 x 49152).
(It replaces build_bench.py, which set the Triton builder against the torch one at several warp
counts when the builder was chosen; an earlier rank-by-counting selection it measured, 0.22 ms
at B=32 and 1.8 ms at B=128 against 0.19 / 0.41 ms for sorting, was removed.)

python scripts/device/profile_build.py --out $OUT/profile_build_h200.json
"""
from __future__ import annotations

import argparse
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--depth", type=int, default=15)
    p.add_argument("--vocab", type=int, default=49152)
    args = p.parse_args()
    torch.manual_seed(0)
    rows = []
    for n in (1, 4, 16):
        # Peaked like a drafter's output: a few likely tokens per depth.
        lp = torch.log_softmax(torch.randn(n, args.depth, args.vocab, device="cuda") * 3, -1)
        roots = torch.zeros(n, dtype=torch.long, device="cuda")
        for budget in (16, 32, 64, 128):
            K = _plan(budget, args.depth, args.vocab, lp.device)[0]
            topk = graph_ms(lambda: topk_triton(lp, K))
            whole = graph_ms(lambda: build_tree_triton(lp, budget, roots))
            rows.append({"n": n, "budget": budget, "topk_ms": topk, "build_ms": whole, "tree_kernel_ms": whole - topk})
            print(f"n={n:3d} B={budget:4d} topk {topk:.4f} ms  build {whole:.4f} ms  tree kernel {whole - topk:.4f} ms",
                  flush=True)
    json.dump({"gpu": torch.cuda.get_device_name(), "depth": args.depth, "vocab": args.vocab, "rows": rows},
              open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
