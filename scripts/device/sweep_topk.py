"""GPU time of the tree build's top-k per depth (graph-replayed, so launch overhead is out):
the Triton chunk-sort + merge at several chunk sizes and warp counts, against the int64-key
torch.topk it replaced. python scripts/device/sweep_topk.py --out $OUT/topk_sweep.json"""
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
for R, V, k in [(15, 49152, 32), (15, 49152, 64), (60, 49152, 32), (240, 49152, 32)]:
    x = torch.log_softmax(torch.randn(R, V, device="cuda") * 3, -1)
    ref = _topk_select(x, k)
    t_ref = gpu_us(lambda: _topk_select(x, k))
    best = None
    for chunk in (512, 1024, 2048, 4096):
        if chunk < k:
            continue
        for w1 in (2, 4, 8):
            for w2 in (4, 8):
                got = triton_tree.topk_triton(x, k, chunk, (w1, w2))
                assert torch.equal(got[1], ref[1]) and torch.equal(got[0], ref[0])
                us = gpu_us(lambda: triton_tree.topk_triton(x, k, chunk, (w1, w2)))
                rows.append({"rows": R, "vocab": V, "k": k, "chunk": chunk, "chunk_warps": w1, "merge_warps": w2,
                             "us": us, "torch_int64_topk_us": t_ref})
                if best is None or us < best[0]:
                    best = (us, chunk, w1, w2)
    print(f"R={R:3d} V={V} k={k:3d}: torch int64 topk {t_ref:6.1f} us; best triton {best[0]:6.1f} us "
          f"(chunk {best[1]}, warps {best[2]}/{best[3]})", flush=True)
json.dump(rows, open(args.out, "w"), indent=1)
