#!/usr/bin/env bash
# Session 60: (1) case (c) with x copied into place before each call (--prefill-fresh-x, new here),
# as the model's prompt finds it, two rings (T: the committed kernel) against one (O: 64cf2d5's
# fused_linear_prefill.cu), both with this bench; (2) the 128 x 256 tile (qkv, gate/up: 1.6-2.6%
# slower with two rings in the model, run 413): E caps W's ring at x's 4 stages (W 5 on HEAD), F
# lets x lead by 2 stages (3 slots) and W take the rest (7). ncu's per-kernel sums of a variant's
# 512-token 7B prompt with the caches kept (run 413's), two rounds of bin (the bundle: two rings),
# O, E, F; (c) fresh-x at 4096^2, 4096 x 11008, 12288 x 4096 for T and O, at 12288 x 4096 for E and
# F; the TTFT once each; E's and F's kernel checks if time is left. .device/new.tar.xz: T/ (bench
# only), O/, E/, F/.
#   run(command="bash bench/cuda/runs/run414.sh", carry=[".device/bundle.tar.xz", ".device/new.tar.xz"])
set -uo pipefail
root=$(pwd)
t0=$(date +%s)
export PATH=/usr/local/cuda/bin:$PATH
card=$(nvidia-smi --query-gpu=name --format=csv,noheader)
(cd .device && tar -xJf bundle.tar.xz && mkdir -p new && tar -xJf new.tar.xz -C new) || exit 1
if grep -q H200 <<< "$card"; then timeout 330 bash bench/cuda/runs/run392.sh > /dev/null 2>&1; fi
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run414.log
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
c_fresh() {  # build, shapes...
  local b=$1; shift
  timeout 100 .device/$b/bench_cuda_fused_linear --prefill-fresh-x "$@" > $OUT/c_fresh_${b//\//_}.log 2>&1
  echo "== $b: (c) fresh x rc $?"
  grep -E "cuBLAS GemmEx [0-9]|the engine's choice" $OUT/c_fresh_${b//\//_}.log | grep "c: 512" | cut -c1-150
}
{
date -u; echo "$card"
[ -d /tmp/l7b/base ] || .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 \
  --heads 32 --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -3 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for b in bin new/O new/E new/F bin new/O new/E new/F; do
  echo "== $b, prompt, caches kept: $(timeout 60 ncu --clock-control none --cache-control none --profile-from-start off \
    --metrics gpu__time_duration.sum --csv --print-kernel-base demangled \
    .device/$b/bench_gpu_e2e /tmp/l7b --decode 4 --profile-case "batch 1, one variant" --profile-what prompt \
    2> /tmp/k.err | sums)"
done
echo "-- $(( $(date +%s) - t0 )) s"
c_fresh new/T 4096 4096 4096 11008 12288 4096
c_fresh new/O 4096 4096 4096 11008 12288 4096
c_fresh new/E 12288 4096
c_fresh new/F 12288 4096
echo "-- $(( $(date +%s) - t0 )) s"
for b in bin new/E new/F new/O; do
  [ $(( $(date +%s) - t0 )) -gt 500 ] && { echo "left out: TTFT of $b"; continue; }
  echo "== $b TTFT: $(timeout 60 .device/$b/bench_gpu_e2e /tmp/l7b --decode 4 --batch 32 --requests 8 2>&1 |
    grep -A15 'TTFT of' | awk 'NR > 1 {print $1, $2}' | tr '\n' ' ')"
done
for b in E F; do
  [ $(( $(date +%s) - t0 )) -gt 480 ] && { echo "left out: kernel checks of $b"; continue; }
  timeout 100 .device/new/$b/test_cuda_fused_linear > $OUT/kernel_test_$b.log 2>&1
  echo "$b kernel checks rc $?: $(tail -1 $OUT/kernel_test_$b.log)"; grep -m3 FAIL $OUT/kernel_test_$b.log
done
echo "-- $(( $(date +%s) - t0 )) s"; date -u
} > $L 2>&1
[ -f $OUT/run392.log ] && cat $OUT/run361main.log $OUT/run392.log
cat $L
