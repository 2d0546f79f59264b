# A/B of tree attention's empty-split skipping (SKIP_EMPTY_SPLITS in ddtree/kernels/triton_attention.py)
# at concurrency 1 on the shipped drafter: the same bench four times in one call, off/on/on/off (ABBA,
# so warm-up and drift fall on both sides), then the per-cell ratios of the means. Needs the staged
# GGUF in /tmp/stage and the drafter weights as /tmp/stage/model.safetensors (stage_and_run.md).
#   bash scripts/device/ab_skip_empty.sh          # ~4-5 min on an H100
set -u
export OUT
export PYTHONPATH=/tmp/site:$PWD DDTREE_CACHE_DIR=/tmp/ddcache
cp /tmp/stage/model.safetensors ddtree/drafters/SmolLM2-135M-Instruct-DFlash/model.safetensors
G=/tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf
K=ddtree/kernels/triton_attention.py
i=0
for v in False True True False; do
  i=$((i + 1))
  sed -i "s/^SKIP_EMPTY_SPLITS = .*/SKIP_EMPTY_SPLITS = $v/" $K
  python3 -m ddtree.cli bench --target $G --prompts-json /tmp/stage/eval_prompts.json \
    --methods ${METHODS:-ar,dflash,ddtree:63} --concurrency 1 --temperatures 0,1 --datasets humaneval,mtbench \
    --repeats ${REPEATS:-2} --max-tokens 128 --kv-cache-gb 8 --out $OUT/ab_skip_${i}_$v.json > $OUT/ab_skip_${i}_$v.log 2>&1 \
    || echo "run $i ($v): exit $?"
done
python3 - <<'EOF'
import glob, json, os, statistics
out = os.environ["OUT"]
runs = {}
for path in sorted(glob.glob(f"{out}/ab_skip_*.json")):
    on = path.endswith("_True.json")
    for r in json.load(open(path))["results"]:
        key = (r["dataset"], r["temperature"], r["method"], r["budget"])
        runs.setdefault(key, {False: [], True: []})[on].append(r["tokens_per_s"])
print("| cell | method | off tok/s | on tok/s | on / off |")
print("|---|---|---|---|---|")
for (ds, t, m, b), v in runs.items():
    if v[False] and v[True]:
        off, on = statistics.mean(v[False]), statistics.mean(v[True])
        print(f"| {ds} T={t:g} | {m}{':' + str(b) if b else ''} | {off:,.0f} | {on:,.0f} | {on / off:.3f} |")
print("| cell | tree / chain off | tree / chain on |")
print("|---|---|---|")
for (ds, t, m, b), v in runs.items():
    chain = runs.get((ds, t, "dflash", 0))
    if m == "ddtree" and chain and all(v.values()) and all(chain.values()):
        off, on = (statistics.mean(v[k]) / statistics.mean(chain[k]) for k in (False, True))
        print(f"| {ds} T={t:g} B={b} | {off:.3f} | {on:.3f} |")
EOF
