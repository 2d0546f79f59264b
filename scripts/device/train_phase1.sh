#!/usr/bin/env bash
# Device call 2 of the drafter build (after call 1 staged gguf.part00 in /tmp/stage):
# assemble the GGUF, regenerate responses with the target, start training.
set -euo pipefail
export PYTHONPATH=/tmp/site:$PWD DDTREE_CACHE_DIR=/tmp/ddcache PYTHONUNBUFFERED=1 TQDM_MININTERVAL=20
cp .stage/gguf.part01 .stage/gguf.part02 /tmp/stage/
G=/tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stage/gguf.part00 /tmp/stage/gguf.part01 /tmp/stage/gguf.part02 > $G
md5sum $G
python3 -m ddtree.cli train-drafter generate --prompts .stage/train_prompts.jsonl --out /tmp/resp.pt --target $G \
  --max-new-tokens 256 --chunk 2048 --max-num-seqs 1024 --kv-cache-gb 24 --max-minutes ${GEN_MINUTES:-3.2} 2>&1 | tail -2
python3 -m ddtree.cli train-drafter train --data /tmp/resp.pt --run-dir /tmp/run --target $G --layers ${LAYERS:-4} \
  --taps 5 --steps ${STEPS:-6000} --batch-size 16 --anchors 64 --max-minutes ${TRAIN_MINUTES:-4} 2>&1 | tail -1
python3 -c "
import torch; d = torch.load('/tmp/resp.pt'); import json
print(json.dumps({k: d[k] for k in ('done', 'generated_tokens', 'seconds')}))" | tee $OUT/responses_stats.json
cp /tmp/run/train_log.jsonl $OUT/
