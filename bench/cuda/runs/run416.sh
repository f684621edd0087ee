#!/usr/bin/env bash
# Session 60: (1) G: the 64 x 256 tile (o, down) with x leading by 2 stages (3 slots, 96 KB) and W's
# ring taking the rest (14 stages; 10 on HEAD, x leading by 3), against the bundle (bin, two rings):
# ncu's per-kernel sums of a variant's 512-token 7B prompt with the caches kept, two rounds; case (c)
# with x just written (--prefill-fresh-x) at 4096^2 and 4096 x 11008, T2 (the committed kernel with
# this bench) and G, two rounds; the TTFT once each; G's kernel checks. (2) Where down's (4096 x
# 11008) and o's warps wait in the bundle's build: ncu's warp-state samples per SASS instruction on
# layer 0's down and o GEMMs of the same prompt (run403.sh's method), the 25 busiest instructions.
# .device/new.tar.xz: G/, T2/ (bench only).
#   run(command="bash bench/cuda/runs/run416.sh", carry=[".device/bundle.tar.xz", ".device/new.tar.xz"])
set -uo pipefail
root=$(pwd)
t0=$(date +%s)
export PATH=/usr/local/cuda/bin:$PATH
card=$(nvidia-smi --query-gpu=name --format=csv,noheader)
(cd .device && tar -xJf bundle.tar.xz && mkdir -p new && tar -xJf new.tar.xz -C new) || exit 1
if grep -q H200 <<< "$card"; then timeout 330 bash bench/cuda/runs/run392.sh > /dev/null 2>&1; fi
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run416.log
sums() {  # ncu csv on stdin: fused GEMM launches by projection (qkv, o, gate/up, down in turn)
  python3 -c '
import csv, sys, re, collections
rows = list(csv.DictReader([l for l in sys.stdin if l.startswith("\"")]))
agg = collections.defaultdict(lambda: [0, 0.0])
names = ["qkv", "o", "gate/up", "down"]
i = 0
for r in rows:
    if r.get("Metric Name") != "gpu__time_duration.sum": continue
    v = float(r["Metric Value"].replace(",", "")); u = r.get("Metric Unit", "")
    us = v * 1e-3 if u in ("ns", "nsecond") else v * 1e3 if u in ("ms", "msecond") else v
    m = re.search(r"FusedTile<(\d+), (\d+)>", r["Kernel Name"])
    key = f"{names[i % 4]} {m.group(1)}x{m.group(2)}" if m else "other"
    i += 1 if m else 0
    agg[key][0] += 1; agg[key][1] += us; agg["all"][0] += 1; agg["all"][1] += us
print("  ".join(f"{k}: {n} x {us / n:.2f} us = {us:.0f}" for k, (n, us) in sorted(agg.items())))'
}
stalls() {  # which launch of the prompt's fused GEMMs to skip to, its name
  timeout 150 ncu --clock-control none --cache-control none --profile-from-start off -k regex:fused_gemm \
    --launch-skip $1 --launch-count 1 --section SourceCounters --section WarpStateStats --import-source no \
    -o /tmp/st$1 -f .device/bin/bench_gpu_e2e /tmp/l7b --decode 4 --profile-case "batch 1, one variant" \
    --profile-what prompt > /tmp/ncu_st.log 2>&1
  echo "== $2: ncu rc $?"; grep -E "ERROR" /tmp/ncu_st.log | head -3
  ncu -i /tmp/st$1.ncu-rep --page source --print-source sass --csv > /tmp/st$1.csv 2> /dev/null
  python3 - /tmp/st$1.csv <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head = next(i for i, r in enumerate(rows) if any('Source' == c for c in r))
h, body = rows[head], rows[head + 1:]
key = next((i for i, c in enumerate(h) if c.startswith('Warp Stall Sampling (All')), None)
if key is None: sys.exit("no sampling column")
def num(s):
    try: return float(s.replace(',', ''))
    except ValueError: return 0.0
total = sum(num(r[key]) for r in body if len(r) > key)
print(f"samples: {total:.0f}")
keep = [i for i, c in enumerate(h) if c in ('# Address', 'Address', 'Source') or c.startswith('Warp Stall Sampling')]
for r in sorted(body, key=lambda r: -num(r[key]) if len(r) > key else 0)[:25]:
    print(f"{100 * num(r[key]) / max(total, 1):5.1f}%  " + "  ".join(r[i] for i in keep if i < len(r))[:160])
PY
}
{
date -u; echo "$card"
[ -d /tmp/l7b/base ] || .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 \
  --heads 32 --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -3 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for b in bin new/G bin new/G; do
  echo "== $b, prompt, caches kept: $(timeout 60 ncu --clock-control none --cache-control none --profile-from-start off \
    --metrics gpu__time_duration.sum --csv --print-kernel-base demangled \
    .device/$b/bench_gpu_e2e /tmp/l7b --decode 4 --profile-case "batch 1, one variant" --profile-what prompt \
    2> /tmp/k.err | sums)"
done
echo "-- $(( $(date +%s) - t0 )) s"
for round in 1 2; do
  for b in T2 G; do
    timeout 100 .device/new/$b/bench_cuda_fused_linear --prefill-fresh-x 4096 4096 4096 11008 > $OUT/c_fresh_${b}_$round.log 2>&1
    echo "== $b round $round: (c) fresh x rc $?"
    grep -E "cuBLAS GemmEx [0-9]|engine's choice|64x256 persistent" $OUT/c_fresh_${b}_$round.log | grep "c: 512" | cut -c1-150
  done
done
echo "-- $(( $(date +%s) - t0 )) s"
for b in bin new/G; do
  echo "== $b TTFT: $(timeout 60 .device/$b/bench_gpu_e2e /tmp/l7b --decode 4 --batch 32 --requests 8 2>&1 |
    grep -A15 'TTFT of' | awk 'NR > 1 {print $1, $2}' | tr '\n' ' ')"
done
echo "-- $(( $(date +%s) - t0 )) s"
stalls 3 "layer 0's down (4096 x 11008), bin"
stalls 1 "layer 0's o (4096 x 4096), bin"
echo "-- $(( $(date +%s) - t0 )) s"
if [ $(( $(date +%s) - t0 )) -lt 480 ]; then
  timeout 100 .device/new/G/test_cuda_fused_linear > /tmp/kt.log 2>&1
  echo "G kernel checks rc $?: $(tail -1 /tmp/kt.log)"; grep -m3 FAIL /tmp/kt.log
else echo "left out: G's kernel checks"; fi
echo "-- $(( $(date +%s) - t0 )) s"; date -u
} > $L 2>&1
[ -f $OUT/run392.log ] && cat $OUT/run361main.log $OUT/run392.log
cat $L
