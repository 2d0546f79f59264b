"""``ddtree train-drafter <stage>``: prompts -> generate -> train -> export, each resumable (pack /
unpack keep a responses file small enough to carry between device calls)."""
from __future__ import annotations

import json


def add_parser(sub) -> None:
    p = sub.add_parser("train-drafter", help="build a DFlash drafter for a target, in stages")
    stages = p.add_subparsers(dest="stage", required=True)

    stages.add_parser("prompts", help="build training prompts (ShareGPT, GSM8K train, code); see prompts -h")

    s = stages.add_parser("generate", help="regenerate responses with the target (resumable)")
    s.add_argument("--prompts", required=True)
    s.add_argument("--out", required=True, help="responses file (.pt), appended to on resume")
    s.add_argument("--target", default=None)
    s.add_argument("--device", default=None)
    s.add_argument("--dtype", default=None)
    s.add_argument("--max-new-tokens", type=int, default=256)
    s.add_argument("--max-prompts", type=int, default=None)
    s.add_argument("--chunk", type=int, default=1024)
    s.add_argument("--max-num-seqs", type=int, default=512)
    s.add_argument("--kv-cache-gb", type=float, default=16.0)
    s.add_argument("--max-minutes", type=float, default=None)
    s.add_argument("--temperatures", default="0,1",
                   help="comma list, taken in turn across prompts (a second pass with '1' and another "
                        "--seed gives other responses to the same prompts)")
    s.add_argument("--seed", type=int, default=None,
                   help="seed of the engine's sampling (LLM(seed=...); a resumed pass adds the prompts done)")
    s.add_argument("--past-eos", type=float, default=0.0,
                   help="fraction of prompts whose responses ignore EOS and run to --max-new-tokens "
                        "(the text after the answer, which ignore_eos requests ask the drafter to follow)")
    s.set_defaults(func=_generate)

    s = stages.add_parser("pack", help="a responses file without its prompts, compressed (to train on it again)")
    s.add_argument("--data", required=True, help="responses file (.pt) from generate")
    s.add_argument("--out", required=True, help="packed file (lzma, uint16 token ids)")
    s.set_defaults(func=_pack)

    s = stages.add_parser("unpack", help="a packed responses file back to .pt, its prompts templated again")
    s.add_argument("--packed", required=True)
    s.add_argument("--prompts", required=True, help="the prompts file the responses were generated from")
    s.add_argument("--out", required=True, help="responses file (.pt) for train")
    s.add_argument("--target", default=None)
    s.set_defaults(func=_unpack)

    s = stages.add_parser("train", help="train (or resume) the drafter")
    s.add_argument("--data", required=True, nargs="+", help="responses file(s), concatenated")
    s.add_argument("--run-dir", required=True)
    s.add_argument("--target", default=None)
    s.add_argument("--device", default=None)
    s.add_argument("--layers", type=int, default=4)
    s.add_argument("--taps", type=int, default=5)
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--steps", type=int, default=2000)
    s.add_argument("--batch-size", type=int, default=16)
    s.add_argument("--anchors", type=int, default=64)
    s.add_argument("--max-len", type=int, default=640)
    s.add_argument("--lr", type=float, default=6e-4)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--distill", type=float, default=0.0,
                   help="weight of the target's next-token distribution as the label (1 - this on the "
                        "sampled token)")
    s.add_argument("--init", default=None, help="continue from this exported drafter folder (fresh optimizer)")
    s.add_argument("--max-minutes", type=float, default=None, help="stop and checkpoint after this long")
    s.add_argument("--minutes", type=float, default=None,
                   help="run the cosine over this many training minutes, summed over resumes, and end "
                        "there (instead of over --steps, which then only caps the run)")
    s.set_defaults(func=_train)

    s = stages.add_parser("export", help="write the z-lab checkpoint folder")
    s.add_argument("--run-dir", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    s.set_defaults(func=_export)


def _generate(args) -> int:
    from ddtree.train.generate import generate_responses
    if not 0.0 <= args.past_eos <= 1.0:  # before the target loads
        raise SystemExit(f"--past-eos {args.past_eos}: must be a fraction within [0, 1]")
    stats = generate_responses(args.prompts, args.out, target=args.target, max_new_tokens=args.max_new_tokens,
                               chunk=args.chunk, max_prompts=args.max_prompts, device=args.device,
                               dtype=args.dtype, max_num_seqs=args.max_num_seqs, kv_cache_gb=args.kv_cache_gb,
                               max_seconds=args.max_minutes * 60 if args.max_minutes else None,
                               temperatures=_temperatures(args.temperatures), seed=args.seed,
                               past_eos=args.past_eos)
    print(json.dumps(stats))
    return 0


def _pack(args) -> int:
    from ddtree.train.generate import pack_responses
    try:
        print(json.dumps(pack_responses(args.data, args.out)))
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    return 0


def _unpack(args) -> int:
    from ddtree.train.generate import unpack_responses
    try:
        print(json.dumps(unpack_responses(args.packed, args.prompts, args.out, target=args.target)))
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    return 0


def _temperatures(text: str) -> tuple[float, ...]:
    try:
        temps = tuple(float(t) for t in text.split(","))
    except ValueError:
        raise SystemExit(f"--temperatures {text!r}: expected a comma list of numbers, e.g. 0,1") from None
    if not temps or any(t < 0 for t in temps):
        raise SystemExit(f"--temperatures {text!r}: temperatures must be >= 0")
    return temps


def _train(args) -> int:
    import torch

    from ddtree.engine.llm import default_device
    from ddtree.models.loader import load_target, resolve_target
    from ddtree.train.trainer import TrainConfig, train_drafter
    if args.minutes is not None and args.minutes <= 0:  # before the target loads
        raise SystemExit(f"--minutes {args.minutes}: must be > 0 (training minutes, summed over resumes)")
    device = torch.device(args.device) if args.device else default_device()
    target = load_target(resolve_target(args.target), device=device,
                         dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    cfg = TrainConfig(num_layers=args.layers, num_taps=args.taps, block_size=args.block_size, steps=args.steps,
                      batch_size=args.batch_size, anchors=args.anchors, max_len=args.max_len, lr=args.lr,
                      seed=args.seed, init=args.init, distill=args.distill, minutes=args.minutes)
    print(json.dumps(train_drafter(target, args.data, args.run_dir, cfg, max_minutes=args.max_minutes)))
    return 0


def _export(args) -> int:
    import torch

    from ddtree.train.trainer import export_drafter
    print(export_drafter(args.run_dir, args.out, dtype=getattr(torch, args.dtype)))
    return 0
