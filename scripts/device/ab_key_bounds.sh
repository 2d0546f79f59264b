# A/B of graphs captured per key bound (GRAPH_KEY_BOUNDS in ddtree/engine/runner.py; off = only
# the context limit, as before), flipped in the device's copy of the tree between runs of one call,
# off/on/on/off (ABBA, so warm-up and drift fall on both sides); prints the ratios of the means.
# BATCH=4 flips KEY_BOUND_BATCH instead (off = bounds for batch 1 only, on = up to batch 4), for a
# run at CONCURRENCY=4:  BATCH=4 CONCURRENCY=4 bash scripts/device/ab_key_bounds.sh  (~4 min)
# Needs the staged GGUF in /tmp/stage and the drafter weights as /tmp/stage/model.safetensors
# (stage_and_run.md). ~6 min on a fresh machine.
#
#   bash scripts/device/ab_key_bounds.sh
set -u
export OUT PYTHONPATH=/tmp/site:$PWD DDTREE_CACHE_DIR=/tmp/ddcache
R=ddtree/engine/runner.py
if [ -n "${BATCH:-}" ]; then
  flip() { sed -i "s/^KEY_BOUND_BATCH = .*/KEY_BOUND_BATCH = $([ "$1" = "()" ] && echo 1 || echo $BATCH)/" $R; }
else
  flip() { sed -i "s/^GRAPH_KEY_BOUNDS = .*/GRAPH_KEY_BOUNDS = $1/" $R; }
fi
nvidia-smi --query-gpu=name --format=csv,noheader
cp /tmp/stage/model.safetensors ddtree/drafters/SmolLM2-135M-Instruct-DFlash/model.safetensors
i=0
for v in off on on off; do
  i=$((i + 1))
  if [ $v = on ]; then flip "(512, 1024)"; else flip "()"; fi
  python3 -m ddtree.cli bench --target /tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf \
    --prompts-json /tmp/stage/eval_prompts.json --methods ${METHODS:-ar,dflash,ddtree:63} --concurrency ${CONCURRENCY:-1} \
    --temperatures ${TEMPS:-0} --datasets humaneval,mtbench --repeats ${REPEATS:-3} --max-tokens 128 \
    --kv-cache-gb 8 --out $OUT/ab_key_bounds_${i}_$v.json --png /tmp/ab_key_bounds_${i}.png \
    >> $OUT/ab_key_bounds.log 2>&1 || echo "run $i ($v): exit $?"
done
flip "(512, 1024)"
grep -n "^GRAPH_KEY_BOUNDS\|^KEY_BOUND_BATCH" $R
python3 - <<'PY'
import glob, json, os, statistics
out = os.environ["OUT"]
runs = {}
for path in sorted(glob.glob(f"{out}/ab_key_bounds_*.json")):
    on = path.endswith("_on.json")
    for r in json.load(open(path))["results"]:
        cell = f"{r['dataset']} T={r['temperature']:g}"
        runs.setdefault((cell, r["method"], r["budget"]), {False: [], True: []})[on].append(r["tokens_per_s"])
print("| cell | method | off tok/s | on tok/s | on / off |\n|---|---|---|---|---|")
for (cell, m, b), v in runs.items():
    if v[False] and v[True]:
        off, on = statistics.mean(v[False]), statistics.mean(v[True])
        print(f"| {cell} | {m}{':' + str(b) if b else ''} | {off:,.0f} | {on:,.0f} | {on / off:.3f} |")
print("| cell | tree / chain off | tree / chain on |\n|---|---|---|")
for (cell, m, b), v in runs.items():
    chain = runs.get((cell, "dflash", 0))
    if m == "ddtree" and chain and all(v.values()) and all(chain.values()):
        off, on = (statistics.mean(v[k]) / statistics.mean(chain[k]) for k in (False, True))
        print(f"| {cell} B={b} | {off:.3f} | {on:.3f} |")
PY
