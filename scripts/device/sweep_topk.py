"""GPU time of the tree build's top-k per depth (graph-replayed, so launch overhead is out): the
Triton chunk + merge kernels with full chunk sorts (the plan in use before Triton's tl.topk) and
with tl.topk at several chunk sizes and warp counts, against the int64-key torch.topk.
python scripts/device/sweep_topk.py --out $OUT/topk_sweep.json"""
import argparse
import json

import torch

from ddtree.bench.attention import graph_seconds
from ddtree.kernels import triton_tree
from ddtree.tree.build import _topk_select


def gpu_us(fn) -> float:
    return graph_seconds(fn) * 1e6


p = argparse.ArgumentParser()
p.add_argument("--out", default="topk_sweep.json")
args = p.parse_args()
rows = []
print(f"tl.topk available: {triton_tree.HAS_TL_TOPK}", flush=True)
for R, V, k in [(15, 49152, 32), (15, 49152, 64), (60, 49152, 32), (240, 49152, 32), (15, 151936, 32)]:
    x = torch.log_softmax(torch.randn(R, V, device="cuda") * 3, -1)
    ref = _topk_select(x, k)
    t_ref = gpu_us(lambda: _topk_select(x, k))
    t_sort = gpu_us(lambda: triton_tree.topk_triton(x, k, use_tl_topk=False))
    best = None
    for chunk in ((1024, 2048, 4096, 8192) if triton_tree.HAS_TL_TOPK else ()):
        for w1 in (4, 8):
            for w2 in (4, 8):
                run = lambda: triton_tree.topk_triton(x, k, chunk, (w1, w2), use_tl_topk=True)  # noqa: E731
                got = run()
                assert torch.equal(got[1], ref[1]) and torch.equal(got[0], ref[0])
                us = gpu_us(run)
                rows.append({"rows": R, "vocab": V, "k": k, "chunk": chunk, "chunk_warps": w1, "merge_warps": w2,
                             "tl_topk_us": us, "sort_plan_us": t_sort, "torch_int64_topk_us": t_ref})
                if best is None or us < best[0]:
                    best = (us, chunk, w1, w2)
    got = triton_tree.topk_triton(x, k)
    assert torch.equal(got[1], ref[1]) and torch.equal(got[0], ref[0])
    t_plan = gpu_us(lambda: triton_tree.topk_triton(x, k))
    rows.append({"rows": R, "vocab": V, "k": k, "default_plan_us": t_plan, "sort_plan_us": t_sort,
                 "torch_int64_topk_us": t_ref})
    print(f"R={R:3d} V={V} k={k:3d}: torch int64 {t_ref:6.1f} us; sort plan {t_sort:6.1f}; default {t_plan:6.1f}"
          + (f"; best tl.topk {best[0]:6.1f} (chunk {best[1]}, warps {best[2]}/{best[3]})" if best else ""),
          flush=True)
json.dump(rows, open(args.out, "w"), indent=1)
