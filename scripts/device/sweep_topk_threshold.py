"""The tree build's top-k per depth, two Triton plans side by side, GPU time graph-replayed: the
chunk plan (every chunk keeps its k best, one merge per row; ``topk_triton``'s default before)
against the threshold plan (``topk_threshold_triton``: small-chunk maxima -> a threshold -> only
the entries above it are sorted), for rows = batch x 15 depths at the SmolLM2 vocabulary, over a
grid of its chunk sizes and candidate caps (the plan's first). Logits like the drafter's (fp32; normalised in the
top-k, as the round runs it): "spread" (randn * 3), "deep" (one token 12 logits ahead per row).
Each row also gives the candidates per row (mean, max) and checks both plans against the shared
top-k. python scripts/device/sweep_topk_threshold.py --out $OUT/topk_threshold_sweep_h200.json"""
import argparse
import json

import torch
import triton

from ddtree.bench.attention import graph_seconds
from ddtree.kernels import triton_tree
from ddtree.tree import topk_per_depth


def logits_like(kind: str, rows: int, vocab: int) -> torch.Tensor:
    x = torch.randn(rows, vocab, device="cuda") * (3 if kind == "spread" else 2)
    if kind == "deep":
        x.scatter_add_(1, torch.randint(0, vocab, (rows, 1), device="cuda"), torch.full((rows, 1), 12.0, device="cuda"))
    return x


def candidates(x: torch.Tensor, k: int, small: int) -> torch.Tensor:
    """Entries per row at or above the row's k-th largest small-chunk max (what the plan sorts)."""
    R, V = x.shape
    pad = torch.full((R, triton.cdiv(V, small) * small - V), float("-inf"), device=x.device)
    ns = triton.cdiv(V, small)  # the kernel's interleaved chunks: runs of 8 ids, ns * 8 apart
    maxes = torch.cat([x, pad], 1).view(R, small // 8, ns, 8).amax((1, 3))
    threshold = maxes.topk(k, -1).values[:, -1:]
    return (x >= threshold).sum(-1).float()


p = argparse.ArgumentParser()
p.add_argument("--out", default="topk_threshold_sweep.json")
p.add_argument("--vocab", type=int, default=49152)
p.add_argument("--kinds", default="spread,deep")
args = p.parse_args()
V, rows = args.vocab, []
for kind in args.kinds.split(","):
    for batch in (1, 4, 16, 64):
        R = batch * 15
        x = logits_like(kind, R, V)
        for k in (7, 15, 31, 63, 127):
            # ids: the logits' own top-k (log_softmax's rounding can tie entries the logits do not)
            want_ids = topk_per_depth(x, k)[1]
            want = (torch.log_softmax(x.double(), -1).gather(-1, want_ids).float(), want_ids)
            chunk = lambda: triton_tree.topk_triton(x, k, normalize=True, method="chunk")  # noqa: E731
            got = chunk()
            assert torch.equal(got[1], want[1]) and torch.allclose(got[0], want[0], atol=2e-5)
            row = {"kind": kind, "batch": batch, "rows": R, "vocab": V, "k": k,
                   "chunk_plan_us": graph_seconds(chunk) * 1e6, "threshold": []}
            plan_small = triton_tree.threshold_plan(V, k)
            plan_cap = max(64, 4 * triton.next_power_of_2(k))
            for small, big, cap in [(plan_small, 2048, plan_cap), (plan_small, 4096, plan_cap),
                                    (plan_small, 8192, plan_cap), (plan_small, 2048, 1024), (128, 2048, plan_cap)]:
                if triton.cdiv(V, small) < k:
                    continue
                run = lambda: triton_tree.topk_threshold_triton(x, k, small, big, cap, normalize=True)  # noqa: E731
                got = run()
                same = bool(torch.equal(got[1], want[1]) and torch.allclose(got[0], want[0], atol=2e-5))
                n = candidates(x, k, small)
                row["threshold"].append({"small": small, "big": big, "cap": cap, "us": graph_seconds(run) * 1e6,
                                         "candidates_mean": n.mean().item(), "candidates_max": n.max().item(),
                                         "same": same})
            best = min(row["threshold"], key=lambda t: t["us"])
            plan = graph_seconds(lambda: triton_tree.topk_triton(x, k, normalize=True)) * 1e6
            row["default_us"] = plan
            rows.append(row)
            print(f"{kind:6} batch {batch:2d} k={k:3d}: chunk plan {row['chunk_plan_us']:6.1f} us, threshold "
                  f"{row['threshold'][0]['us']:6.1f} (best {best['us']:6.1f} at small {best['small']} big "
                  f"{best['big']} cap {best['cap']}), default now {plan:6.1f}; candidates mean "
                  f"{row['threshold'][0]['candidates_mean']:.0f} max {row['threshold'][0]['candidates_max']:.0f}; "
                  f"all same: {all(t['same'] for t in row['threshold'])}", flush=True)
json.dump({"gpu": torch.cuda.get_device_name(), "command": "python scripts/device/sweep_topk_threshold.py",
           "rows": rows}, open(args.out, "w"), indent=1)
