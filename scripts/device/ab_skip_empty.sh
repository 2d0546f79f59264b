# A/B of tree attention's empty-split skipping (SKIP_EMPTY_SPLITS in ddtree/kernels/triton_attention.py),
# flipped in the device's copy of the tree between runs of one call, off/on/on/off (ABBA, so warm-up
# and drift fall on both sides); prints the ratios of the means.
#
#   bash scripts/device/ab_skip_empty.sh profile  # ~5 min, no GGUF (random weights, no staging):
#       the kernel sweep, profile_step's round GPU times four times, then the CUDA kernel tests
#       with skipping on
#   bash scripts/device/ab_skip_empty.sh          # ~4-5 min: the bench at concurrency 1 four times
#       on the shipped drafter; needs the staged GGUF in /tmp/stage and the drafter weights as
#       /tmp/stage/model.safetensors (stage_and_run.md)
set -u
export OUT
K=ddtree/kernels/triton_attention.py
flip() { sed -i "s/^SKIP_EMPTY_SPLITS = .*/SKIP_EMPTY_SPLITS = $1/" $K; }

if [ "${1:-}" = profile ]; then
  export PYTHONPATH=$PWD
  nvidia-smi --query-gpu=name --format=csv,noheader
  python3 scripts/device/sweep_attention.py --max-keys 2112 --contexts 300,1000 --batches 1,4,16 \
    --cases "decode,chain,tree 32,tree 63" --variants "default,skip,s32 skip,s8" --out $OUT/attention_skip.json \
    > $OUT/attention_skip.log 2>&1 || echo "sweep: exit $?"
  i=0
  for v in False True True False; do
    i=$((i + 1)); flip $v
    python3 scripts/device/profile_step.py --no-kernels --out $OUT/profile_skip_${i}_$v.json \
      > /tmp/profile_skip_${i}_$v.log 2>&1 || echo "profile $i ($v): exit $?"
  done
  flip True
  timeout ${TEST_SECONDS:-200} python3 -m pytest -q -x tests/test_kernels.py > $OUT/cuda_kernel_tests_skip.log 2>&1
  echo "kernel tests (skipping on): exit $?; $(tail -1 $OUT/cuda_kernel_tests_skip.log)"
  MODE=profile
else
  export PYTHONPATH=/tmp/site:$PWD DDTREE_CACHE_DIR=/tmp/ddcache
  cp /tmp/stage/model.safetensors ddtree/drafters/SmolLM2-135M-Instruct-DFlash/model.safetensors
  i=0
  for v in False True True False; do
    i=$((i + 1)); flip $v
    python3 -m ddtree.cli bench --target /tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf \
      --prompts-json /tmp/stage/eval_prompts.json --methods ${METHODS:-ar,dflash,ddtree:63} --concurrency 1 \
      --temperatures 0,1 --datasets humaneval,mtbench --repeats ${REPEATS:-2} --max-tokens 128 --kv-cache-gb 8 \
      --out $OUT/ab_skip_${i}_$v.json > $OUT/ab_skip_${i}_$v.log 2>&1 || echo "run $i ($v): exit $?"
  done
  MODE=bench
fi

MODE=$MODE python3 - <<'PY'
import glob, json, os, statistics
out, mode = os.environ["OUT"], os.environ["MODE"]
pattern, rows, value = (("profile_skip_*.json", "steps", "graph_gpu_ms") if mode == "profile"
                        else ("ab_skip_*.json", "results", "tokens_per_s"))
runs = {}
for path in sorted(glob.glob(f"{out}/{pattern}")):
    on = path.endswith("_True.json")
    for r in json.load(open(path))[rows]:
        cell = f"n={r['n']}" if mode == "profile" else f"{r['dataset']} T={r['temperature']:g}"
        runs.setdefault((cell, r["method"], r["budget"]), {False: [], True: []})[on].append(r[value])
unit = "ms/round (graph GPU)" if mode == "profile" else "tok/s"
print(f"| cell | method | off {unit} | on | on / off |\n|---|---|---|---|---|")
for (cell, m, b), v in runs.items():
    if v[False] and v[True]:
        off, on = statistics.mean(v[False]), statistics.mean(v[True])
        print(f"| {cell} | {m}{':' + str(b) if b else ''} | {off:,.4g} | {on:,.4g} | {on / off:.3f} |")
if mode == "bench":
    print("| cell | tree / chain off | tree / chain on |\n|---|---|---|")
    for (cell, m, b), v in runs.items():
        chain = runs.get((cell, "dflash", 0))
        if m == "ddtree" and chain and all(v.values()) and all(chain.values()):
            off, on = (statistics.mean(v[k]) / statistics.mean(chain[k]) for k in (False, True))
            print(f"| {cell} B={b} | {off:.3f} | {on:.3f} |")
PY
[ "$MODE" = profile ] && tail -45 $OUT/attention_skip.log
true
