#!/usr/bin/env bash
# Session 60: why case (c) and the model's prompt disagree on two rings. Run 412 (H100): in ncu's
# per-kernel sums of a variant's 512-token 7B prompt, down (4096 x 11008) takes 82 us a launch with
# two rings against 104-107 with one, while case (c) at that shape takes 82.1 against 76.2. ncu
# flushes the caches before each kernel by default (--cache-control all); (c) keeps x in L2 (W
# rotates). Here, for the bundle (bin: two rings) and the one-ring build (new/one, as in run412.sh):
# the prompt's sums with --cache-control none; case (c)'s profile mode under ncu at down's and o's
# shapes with the caches flushed and not; the 7B TTFT (512 tokens) alternated, two rounds.
#   run(command="bash bench/cuda/runs/run413.sh", carry=[".device/bundle.tar.xz", ".device/new.tar.xz"])
set -uo pipefail
root=$(pwd)
t0=$(date +%s)
export PATH=/usr/local/cuda/bin:$PATH
card=$(nvidia-smi --query-gpu=name --format=csv,noheader)
(cd .device && tar -xJf bundle.tar.xz && mkdir -p new && tar -xJf new.tar.xz -C new) || exit 1
if grep -q H200 <<< "$card"; then timeout 330 bash bench/cuda/runs/run392.sh > /dev/null 2>&1; fi
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run413.log
sums() {  # ncu csv on stdin: fused GEMM launches by projection (qkv, o, gate/up, down in turn), or by shape
  python3 -c '
import csv, sys, re, collections
rows = list(csv.DictReader([l for l in sys.stdin if l.startswith("\"")]))
agg = collections.defaultdict(lambda: [0, 0.0])
names = sys.argv[1].split(",")
i = 0
for r in rows:
    if r.get("Metric Name") != "gpu__time_duration.sum": continue
    v = float(r["Metric Value"].replace(",", "")); u = r.get("Metric Unit", "")
    us = v * 1e-3 if u in ("ns", "nsecond") else v * 1e3 if u in ("ms", "msecond") else v
    k = r["Kernel Name"]
    m = re.search(r"FusedTile<(\d+), (\d+)>", k)
    if m: key = f"{names[i % len(names)]} {m.group(1)}x{m.group(2)}"; i += 1
    elif "gemm" in k.lower() or "sm90" in k: key = "cuBLAS"
    else: key = "other"
    agg[key][0] += 1; agg[key][1] += us
print("  ".join(f"{k}: {n} x {us / n:.2f} us = {us:.0f}" for k, (n, us) in sorted(agg.items())))' "$1"
}
{
date -u; echo "$card"
[ -d /tmp/l7b/base ] || .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 \
  --heads 32 --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -3 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for b in bin new/one bin new/one; do
  echo "== $b, prompt, caches kept: $(timeout 60 ncu --clock-control none --cache-control none --profile-from-start off \
    --metrics gpu__time_duration.sum --csv --print-kernel-base demangled \
    .device/$b/bench_gpu_e2e /tmp/l7b --decode 4 --profile-case "batch 1, one variant" --profile-what prompt \
    2> /tmp/k.err | sums qkv,o,gate/up,down)"
done
echo "-- $(( $(date +%s) - t0 )) s"
for b in bin new/one; do
  for cc in all none; do
    for shape in "4096 11008" "4096 4096"; do
      echo "== $b, (c) $shape, --cache-control $cc: $(timeout 60 ncu --clock-control none --cache-control $cc \
        --metrics gpu__time_duration.sum --csv --print-kernel-base demangled \
        .device/$b/bench_cuda_fused_linear --profile-prefill $shape 2> /tmp/p.err | sums launch)"
    done
  done
done
echo "-- $(( $(date +%s) - t0 )) s"
for round in 1 2; do
  for b in bin new/one; do
    [ $(( $(date +%s) - t0 )) -gt 520 ] && { echo "left out: $b round $round"; continue; }
    echo "== $b TTFT round $round: $(timeout 60 .device/$b/bench_gpu_e2e /tmp/l7b --decode 4 --batch 32 --requests 8 2>&1 |
      grep -A15 'TTFT of' | awk 'NR > 1 {print $1, $2}' | tr '\n' ' ')"
  done
done
echo "-- $(( $(date +%s) - t0 )) s"; date -u
} > $L 2>&1
[ -f $OUT/run392.log ] && cat $OUT/run361main.log $OUT/run392.log
cat $L
