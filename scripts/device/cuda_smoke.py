"""CUDA smoke check on a tiny random model (runs in seconds): greedy DDTree/DFlash == AR in fp32
and bf16, seeded sampling reproducible, a few training steps run."""
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_train import tiny_target, write_sequences  # noqa: E402

from ddtree import LLM, SamplingParams  # noqa: E402
from ddtree.models.dflash import random_drafter  # noqa: E402
from ddtree.train.trainer import TrainConfig, train_drafter  # noqa: E402

assert torch.cuda.is_available()
print(torch.cuda.get_device_name(), torch.__version__)
for dtype in (torch.float32, torch.bfloat16):
    target = tiny_target()
    drafter = random_drafter(target.config, num_layers=1, block_size=6, num_taps=2)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11] * 20]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs = {}
    for method, budget in [("ar", 0), ("dflash", 0), ("ddtree", 12)]:
        llm = LLM(target=target, drafter=drafter if method != "ar" else None, method=method, budget=budget,
                  device="cuda", dtype=dtype, max_model_len=128, kv_cache_gb=0.05)
        outs[method] = [o.token_ids for o in llm.generate(prompts, greedy)]
        seeded = SamplingParams(temperature=1, top_p=0.9, max_tokens=20, seed=7)
        a = llm.generate(prompts[0], seeded)[0].token_ids
        assert a == llm.generate(prompts[0], seeded)[0].token_ids
    same = [outs["ddtree"][i] == outs["ar"][i] and outs["dflash"][i] == outs["ar"][i] for i in range(3)]
    print(dtype, "greedy equal:", same)
    if dtype == torch.float32:
        assert all(same)
with tempfile.TemporaryDirectory() as d:
    write_sequences(Path(d) / "r.pt")
    t = time.time()
    out = train_drafter(tiny_target().cuda(), Path(d) / "r.pt", Path(d) / "run",
                        TrainConfig(num_layers=1, num_taps=2, block_size=4, steps=20, batch_size=8, anchors=8,
                                    max_len=64, lr=1e-2), log_every=10)
    print("train ok", out["loss"], f"{time.time() - t:.1f}s")
print("CUDA SMOKE OK")
