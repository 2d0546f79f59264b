#!/usr/bin/env bash
# auto of this tree against auto of an older commit, side by side on one warm machine (after the
# three staging calls of stage_and_run.md; carry .stage/gguf.r06, .stage/gguf.r07,
# .stage/eval_prompts.json and .stage/old_overlay.tar): this tree's `ar,auto`, then the old
# commit's `auto` (this tree's ddtree with the old versions of the files that differ), same
# prompts, cells and protocol, every repeat's rounds kept. The machine's git copy lacks old
# commits, so the overlay is made here first:
#   git archive -o .stage/old_overlay.tar OLD $(git diff --name-only OLD HEAD -- ddtree)
#   bash scripts/device/ab_auto.sh        # CONCURRENCY=4,16,64 TEMPS=0,1 REPEATS=3 DATASETS=...
# 2026-12-04 (docs/measurements.md, "`auto`: tau per sequence, explorations every 8 steps"), old = 3af9754:
#   CONCURRENCY=16,64 REPEATS=4 NEW_SECONDS=170 OLD_SECONDS=110 bash scripts/device/ab_auto.sh
#   DATASETS=mtbench TEMPS=1 CONCURRENCY=16,64 REPEATS=4 NEW_SECONDS=58 OLD_SECONDS=45 bash ...
# On a machine's first run the start-up profile takes ~100 s (7.5 s warm): leave NEW_SECONDS room.
set -euo pipefail
export PYTHONPATH=/tmp/site:$PWD DDTREE_CACHE_DIR=/tmp/ddcache PYTHONUNBUFFERED=1
G=/tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f $G ]; then cp .stage/gguf.r06 .stage/gguf.r07 /tmp/stage/ && cat /tmp/stage/gguf.r0* > $G; fi
md5sum $G
ARGS="--target $G --prompts-json $PWD/.stage/eval_prompts.json --concurrency ${CONCURRENCY:-4,16,64}
  --temperatures ${TEMPS:-0,1} --datasets ${DATASETS:-humaneval,mtbench} --repeats ${REPEATS:-3} --max-tokens 128
  --kv-cache-gb 8 --auto-trace"
timeout ${NEW_SECONDS:-200} python3 -m ddtree.cli bench $ARGS --methods ar,auto --out $OUT/ab_new.json \
  > $OUT/ab_new.log 2>&1 || echo "new: exit $?"
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r ddtree /tmp/old/ && tar -x -C /tmp/old -f .stage/old_overlay.tar
tar -tf .stage/old_overlay.tar
(cd /tmp/old && PYTHONPATH=/tmp/site:/tmp/old timeout ${OLD_SECONDS:-120} python3 -m ddtree.cli bench $ARGS \
  --methods auto --out $OUT/ab_old.json > $OUT/ab_old.log 2>&1) || echo "old: exit $?"
python3 - <<'PY'
import json, os, statistics
out = os.environ["OUT"]
def rows(name):
    try:
        return json.load(open(f"{out}/ab_{name}.json"))["results"]
    except FileNotFoundError:
        return []
key = lambda r: (r["dataset"], r["temperature"], r["concurrency"])
new = {(key(r), r["method"]): r["tokens_per_s_runs"] for r in rows("new")}
old = {key(r): r["tokens_per_s_runs"] for r in rows("old")}
for (k, m), runs in new.items():
    if m != "ar" and k in old:
        ar = statistics.median(new[(k, "ar")])
        print(f"{k[0]:9} T={k[1]:.0f} c={k[2]:3}  AR {ar:8.0f}  auto new {statistics.median(runs) / ar:.3f} "
              f"{[round(x / ar, 3) for x in runs]}  old {statistics.median(old[k]) / ar:.3f} {[round(x / ar, 3) for x in old[k]]}")
PY
for f in $OUT/ab_new.json $OUT/ab_old.json; do [ -f $f ] && gzip $f; done
