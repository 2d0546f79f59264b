"""Tree-builder cost per call (CUDA graph replay, H200): torch batched builder vs the Triton
builder (tree, root and ancestor mask) at several warp counts. Prints a table; JSON to argv[1]. (An earlier rank-by-counting
selection measured 0.22 ms at B=32 and 1.8 ms at B=128 vs 0.19 / 0.41 ms for sorting: removed.)"""
import json
import sys

import torch

from ddtree.kernels.triton_tree import build_tree_triton
from ddtree.tree import ancestor_mask, build_tree_batched, topk_per_depth, with_root


def graph_time(fn, reps=50):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        g.replay()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / reps * 1e3  # us


rows = []
for n in (1, 16, 64):
    for budget in (32, 128):
        lp = torch.log_softmax(torch.randn(n, 15, 49152, device="cuda") * 4, -1)
        roots = torch.zeros(n, dtype=torch.long, device="cuda")

        def torch_build():
            full = with_root(roots, *build_tree_batched(lp, budget))
            return (*full, ancestor_mask(full[1], 15))

        want = torch_build()
        variants = {"torch": torch_build,
                    "topk_only": lambda: topk_per_depth(lp, min(budget, 49152))}
        for w in (1, 2, 4, 8):
            variants[f"triton_w{w}"] = lambda w=w: build_tree_triton(lp, budget, roots, num_warps=w)
        for name, fn in variants.items():
            if name.startswith("triton"):
                assert all(torch.equal(a, b) for a, b in zip(want, fn())), name
            us = graph_time(fn)
            rows.append({"n": n, "budget": budget, "variant": name, "us": us})
            print(f"n={n:3d} B={budget:3d} {name:18s} {us:8.1f} us", flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
