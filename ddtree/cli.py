"""Command line: ``ddtree generate | serve | bench | train-drafter | eval-drafter``."""
from __future__ import annotations

import argparse
import sys
import time

from ddtree.engine.args import add_engine_args, llm_from_args


def cmd_generate(args) -> int:
    from ddtree import SamplingParams

    llm = llm_from_args(args)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    start = time.perf_counter()
    if args.raw:
        out = llm.generate(args.prompt, params)[0]
    else:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    elapsed = time.perf_counter() - start
    print(out.text)
    n = len(out.token_ids)
    print(f"\n[{args.method}{'' if args.method != 'ddtree' else f' budget={args.budget}'}] "
          f"{n} tokens in {elapsed:.2f}s ({n / elapsed:.1f} tok/s), "
          f"tau={out.metrics.mean_accepted_length:.2f} over {out.metrics.num_verify_steps} verify steps, "
          f"finish_reason={out.finish_reason}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Commands with their own argument parsers.
    if argv[:1] == ["bench"]:
        from ddtree.bench.speed import main as bench_main
        return bench_main(argv[1:])
    if argv[:1] == ["eval-drafter"]:
        from ddtree.bench.eval_drafter import main as eval_main
        return eval_main(argv[1:])
    if argv[:2] == ["train-drafter", "prompts"]:
        from ddtree.train.prompts import main as prompts_main
        return prompts_main(argv[2:]) or 0
    parser = argparse.ArgumentParser(prog="ddtree", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt and print it with tau")
    g.add_argument("prompt", nargs="?", default="Write a Python function that checks whether a number is prime.")
    add_engine_args(g)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.set_defaults(func=cmd_generate)

    from ddtree.server.cli import add_serve_parser
    add_serve_parser(sub)
    from ddtree.train.cli import add_parser as add_train_parser
    add_train_parser(sub)
    sub.add_parser("bench", help="AR / DFlash / DDTree speed side by side (see bench -h; --quick for CPU)")
    sub.add_parser("eval-drafter", help="tau vs budget on HumanEval and MT-Bench (see eval-drafter -h)")
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
