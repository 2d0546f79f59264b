"""Command-line flags shared by every command that builds an engine (generate, serve)."""
from __future__ import annotations

import argparse


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default=None, help="DFlash drafter folder, or 'random' (default: the shipped one)")
    p.add_argument("--method", default="ddtree", choices=["ar", "dflash", "ddtree"])
    p.add_argument("--budget", type=budget_arg, default="auto",
                   help="DDTree node budget, or 'auto' to pick plain/chain/tree per step (default: auto)")
    p.add_argument("--max-budget", type=int, default=128, help="largest tree 'auto' or a request may use")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly on CUDA")
    p.add_argument("--no-overlap-steps", action="store_true",
                   help="read each decode round before launching the next (default: overlap under CUDA graphs)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--max-model-len", type=int, default=2048, help="context length: prompt + output tokens")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests in the running batch at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="prefill tokens per step at most")
    p.add_argument("--join-wait-rounds", type=int, default=8,
                   help="under load, a request joining a running batch waits up to this many rounds for "
                        "others to join with it (ceil(running/16)); 0 joins at once (default: 8)")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache size in GiB (target + drafter)")


def budget_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"budget must be an integer or 'auto', got {text!r}") from None


def llm_from_args(args):
    from ddtree import LLM
    return LLM(target=args.target, drafter=args.drafter, method=args.method, budget=args.budget,
               device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               kv_cache_gb=args.kv_cache_gb, max_budget=args.max_budget, cuda_graphs=not args.no_cuda_graphs,
               overlap_steps=False if args.no_overlap_steps else None, join_wait_rounds=args.join_wait_rounds)
