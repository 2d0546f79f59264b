"""Record every node of every verified tree with what the target said about it, for tree-scoring
studies offline (`scripts/study_tree_scoring.py`).

Runs the engine eagerly with DDTree at budget B (default 128) over a prompt set at T=0 and T=1 and,
for each sequence-step, keeps per non-root node: its parent (tree index), depth, the drafter's
log-probability of its token at that depth and the token's rank there, the target's log-probability
of the token given the node's tree path (temperature 1) and whether it is the target's argmax there.
The first b nodes of a B-node tree are the b-node tree, and any tree built over these nodes can be
scored exactly: at T=0 its accepted length follows the argmax flags, at T=1 its expected accepted
length is 1 + sum over nodes of the product of the target probabilities along the node's path.

python scripts/device/record_trees.py --target X.gguf --prompts .stage/eval_prompts.json \
    --prompts .stage/calib_prompts.json --out $OUT
"""
import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from ddtree import LLM, SamplingParams

p = argparse.ArgumentParser()
p.add_argument("--target", required=True)
p.add_argument("--prompts", action="append", required=True, help="JSON {dataset: [conversation, ...]}")
p.add_argument("--out", required=True)
p.add_argument("--budget", type=int, default=128)
p.add_argument("--max-tokens", type=int, default=96)
p.add_argument("--temperatures", default="0,1")
p.add_argument("--dtype", default="bfloat16")
p.add_argument("--device", default="cuda")
p.add_argument("--limit", type=int, default=None, help="prompts per dataset")
args = p.parse_args()

llm = LLM(target=args.target, method="ddtree", budget=args.budget, max_budget=args.budget, device=args.device,
          dtype=args.dtype, max_num_seqs=64, kv_cache_gb=8, cuda_graphs=False)
runner = llm.engine.runner
records: list[dict] = []
stash = {}
original_build, original_accept = runner.build, runner.accept


def build(kind, roots, logprobs):
    stash["logprobs"] = logprobs
    return original_build(kind, roots, logprobs)


@torch.inference_mode()
def accept(kind, inp, tree, logits, generators):
    if kind.method == "ddtree":
        lq = stash["logprobs"].float()                      # [N, D, V]
        tokens, parents, depths = tree.tokens[:, 1:], tree.parents[:, 1:], tree.depths[:, 1:]
        d = (depths - 1).clamp(min=0)
        at_depth = lq.gather(1, d[:, :, None].expand(-1, -1, lq.shape[2]))   # [N, T-1, V]
        logq = at_depth.gather(2, tokens[:, :, None])[..., 0]
        rank = (at_depth > logq[..., None]).sum(-1)
        parent_logits = logits.float().gather(1, parents[:, :, None].expand(-1, -1, logits.shape[2]))
        logp = torch.log_softmax(parent_logits, -1).gather(2, tokens[:, :, None])[..., 0]
        is_argmax = parent_logits.argmax(-1) == tokens
        records.append({"parent": parents.short().cpu(), "depth": depths.to(torch.int8).cpu(),
                        "logq": logq.cpu(), "rank": rank.int().cpu(), "logp": logp.cpu(),
                        "is_argmax": is_argmax.cpu()})
    return original_accept(kind, inp, tree, logits, generators)


runner.build, runner.accept = build, accept
summary = {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "budget": args.budget, "max_tokens": args.max_tokens,
           "dtype": args.dtype, "sets": {}}
for path in args.prompts:
    for name, convs in json.loads(Path(path).read_text()).items():
        ids = [llm.apply_chat_template(c) for c in convs[:args.limit]]
        for t in (float(x) for x in args.temperatures.split(",")):
            records.clear()
            t0 = time.perf_counter()
            seqs = [llm.engine.add_request(x, SamplingParams(temperature=t, max_tokens=args.max_tokens, seed=i))
                    for i, x in enumerate(ids)]
            while llm.engine.has_unfinished():
                llm.engine.step()
            cat = {k: torch.cat([r[k] for r in records]).numpy() for k in records[0]}
            steps = [n for s in seqs for n in s.metrics.accepted_lengths[:-1]]
            key = f"{name}_t{t:.0f}"
            np.savez_compressed(Path(args.out) / f"trees_{key}.npz", parent=cat["parent"], depth=cat["depth"],
                                logq=cat["logq"].astype(np.float16), rank=cat["rank"].astype(np.uint16),
                                logp=cat["logp"].astype(np.float16), is_argmax=cat["is_argmax"])
            summary["sets"][key] = {"prompts": len(ids), "seq_steps": int(cat["parent"].shape[0]),
                                    "tau_run": sum(steps) / max(1, len(steps)), "seconds": time.perf_counter() - t0}
            print(key, summary["sets"][key], flush=True)
            (Path(args.out) / "record_trees.json").write_text(json.dumps(summary, indent=1))  # after every set
