"""Tree-attention kernel speed against the card's copy bandwidth (GPU only).

For each shape (query heads, KV heads, head dim), batch size, prefix length and number of new
tokens (1 = plain decode, causal; >1 = a DDTree verify with a random tree), the Triton kernel
reads every cached K/V byte of the batch once, so its achieved bandwidth is
(K/V bytes + Q/O bytes + mask bytes) / kernel time. The card's copy bandwidth is measured the
same way (a 1 GiB device-to-device copy counts read + write). Kernel times come from a CUDA graph
of back-to-back launches, so launch overhead is excluded. Also shown: the kernel with a single key
range (``splits=1``) and PyTorch SDPA over the same keys laid out contiguously (no paging, dense
mask) as a reference point.

python -m ddtree.bench.attention --out bench/results/attention_h200.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"smollm2-135m": (9, 3, 64), "qwen3-8b": (32, 8, 128)}
PAGE = 16


def graph_seconds(fn, reps: int = 20) -> float:
    """Seconds per call, measured as a CUDA graph of ``reps`` back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (5 * reps)


def copy_bandwidth(gib: float = 1.0) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    t = graph_seconds(lambda: dst.copy_(src), reps=5)
    return 2 * src.numel() * src.element_size() / t


def random_case(shape, batch: int, context: int, new: int, gen: torch.Generator, mask: str | None = None):
    """Random paged K/V, queries and context; ``mask`` defaults to causal for 1 new token and a
    random tree otherwise."""
    from ddtree.context import AttentionContext
    from ddtree.tree import ancestor_mask
    heads, kv_heads, dim = shape
    mask = mask or ("causal" if new == 1 else "tree")
    per_seq = -(-(context + new) // PAGE)
    tables = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq).cuda()
    slots = batch * per_seq * PAGE
    k = torch.randn(slots, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch * new, heads, dim, device="cuda", dtype=torch.bfloat16)
    cached = torch.full((batch,), context, device="cuda")
    tree = None
    if mask == "tree":
        parents = torch.tensor([[0] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, new)]
                                for _ in range(batch)])
        tree = ancestor_mask(parents, new - 1).cuda()
    return q, k, v, AttentionContext.uniform(tables, cached, new, PAGE, context + new, mask=mask, tree_mask=tree)


def sdpa_reference(q, k, v, ctx, batch: int, context: int, new: int):
    """The same attention with K/V already contiguous per sequence (what a non-paged engine reads)."""
    key_slots, allowed, _ = ctx.dense()
    heads = q.shape[1]
    kc = k[key_slots.reshape(-1)].view(batch, context + new, *k.shape[1:]).transpose(1, 2).contiguous()
    vc = v[key_slots.reshape(-1)].view(batch, context + new, *v.shape[1:]).transpose(1, 2).contiguous()
    qc = q.view(batch, new, heads, -1).transpose(1, 2).contiguous()
    mask = None if new == 1 else allowed[:, None, :new].contiguous()
    return lambda: F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, enable_gqa=True)


def main(argv=None) -> int:
    from ddtree.kernels.triton_attention import launch_plan, tree_attention
    p = argparse.ArgumentParser(prog="python -m ddtree.bench.attention", description=__doc__)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--contexts", default="512,4096,16384")
    p.add_argument("--new-tokens", default="1,33,65")
    p.add_argument("--sweep-splits", action="store_true", help="also time splits 1..32 for each case")
    p.add_argument("--out", default="bench/results/attention_h200.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the attention benchmark measures the GPU kernel: it needs CUDA")
    copy = copy_bandwidth()
    print(f"copy bandwidth: {copy / 1e9:.0f} GB/s ({torch.cuda.get_device_name()})", flush=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        for batch in map(int, args.batch_sizes.split(",")):
            for context in map(int, args.contexts.split(",")):
                for new in map(int, args.new_tokens.split(",")):
                    q, k, v, ctx = random_case(shape, batch, context, new, gen)
                    kv_bytes = 2 * batch * (context + new) * k.shape[1] * k.shape[2] * k.element_size()
                    other = 2 * q.numel() * q.element_size() + (ctx.tree_mask.numel() if new > 1 else 0)
                    t_auto = graph_seconds(lambda: tree_attention(q, k, v, ctx, 0.125))
                    t_one = graph_seconds(lambda: tree_attention(q, k, v, ctx, 0.125, splits=1))
                    t_sdpa = graph_seconds(sdpa_reference(q, k, v, ctx, batch, context, new))
                    splits = launch_plan(q, k, ctx)[3]
                    row = {"shape": name, "batch": batch, "context": context, "new_tokens": new,
                           "splits": splits, "kernel_s": t_auto, "kernel_one_split_s": t_one, "sdpa_contiguous_s": t_sdpa,
                           "bytes": kv_bytes + other, "bandwidth_GBps": (kv_bytes + other) / t_auto / 1e9,
                           "fraction_of_copy_bw": (kv_bytes + other) / t_auto / copy}
                    if args.sweep_splits:
                        row["sweep_us"] = {s: graph_seconds(lambda: tree_attention(q, k, v, ctx, 0.125, splits=s)) * 1e6
                                           for s in (1, 2, 4, 8, 16, 32)}
                        print("   sweep", {s: round(t, 1) for s, t in row["sweep_us"].items()}, flush=True)
                    rows.append(row)
                    print(f"{name:13s} n={batch:3d} ctx={context:6d} new={new:3d} splits={splits:2d} "
                          f"{t_auto * 1e6:8.1f} us (1 split {t_one * 1e6:8.1f}, sdpa {t_sdpa * 1e6:8.1f}) "
                          f"{row['bandwidth_GBps']:6.0f} GB/s = {row['fraction_of_copy_bw']:.2f} of copy", flush=True)
                    del q, k, v, ctx
    out = {"gpu": torch.cuda.get_device_name(), "dtype": "bfloat16", "page": PAGE,
           "copy_bandwidth_GBps": copy / 1e9, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    plot(out, Path(args.out).with_suffix(".png"))
    return 0


def plot(out: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = list(dict.fromkeys(r["shape"] for r in out["rows"]))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, name in zip(axes[0], shapes):
        rows = [r for r in out["rows"] if r["shape"] == name]
        for new in sorted({r["new_tokens"] for r in rows}):
            for context in sorted({r["context"] for r in rows}):
                pts = [r for r in rows if r["new_tokens"] == new and r["context"] == context]
                ax.plot([r["batch"] for r in pts], [r["fraction_of_copy_bw"] for r in pts], "o-",
                        label=f"{new} new, ctx {context}")
        ax.set(xscale="log", xlabel="batch size", ylabel="achieved / copy bandwidth", ylim=(0, 1.1),
               title=f"tree attention, {name}, {out['gpu']}\ncopy bw {out['copy_bandwidth_GBps']:.0f} GB/s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
