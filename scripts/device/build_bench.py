"""Tree-builder cost per call (CUDA graph replay, H200): torch batched builder vs the Triton
builder (rank-count or sort selection, several warp counts). Prints a table; JSON to argv[1]."""
import json
import sys

import torch

from ddtree.kernels.triton_tree import build_tree_triton
from ddtree.tree import build_tree_batched, topk_per_depth


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
        want = build_tree_batched(lp, budget)
        variants = {"torch": lambda: build_tree_batched(lp, budget),
                    "topk_only": lambda: topk_per_depth(lp, min(budget, 49152))}
        for rank in (True, False):
            for w in (1, 2, 4, 8):
                variants[f"triton_{'rank' if rank else 'sort'}_w{w}"] = \
                    lambda rank=rank, w=w: build_tree_triton(lp, budget, rank=rank, num_warps=w)
        for name, fn in variants.items():
            if name.startswith("triton"):
                assert all(torch.equal(a, b) for a, b in zip(want, fn())), name
            us = graph_time(fn)
            rows.append({"n": n, "budget": budget, "variant": name, "us": us})
            print(f"n={n:3d} B={budget:3d} {name:18s} {us:8.1f} us", flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
