#!/usr/bin/env bash
# Session 59 (written for the next session; not run yet): are case (c) and the model's prompt in
# agreement after all? Run 409 summed the 64 x 256 tile's launches, o (4096 x 4096, K 4096) and down
# (4096 x 11008) together (-15% with two rings), while case (c) timed 4096 x 4096 alone (+9%). Here,
# for the bundle (bin: two rings, 7aa3645 on) and the one-ring build (one: fused_linear_prefill.cu
# of 64cf2d5, in .device/new.tar.xz): ncu's per-kernel sums of a variant's 512-token 7B prompt split
# by projection (the prompt's fused GEMMs run qkv, o, gate/up, down in each layer, in that order),
# two rounds; then case (c) at o's, down's, qkv's and gate/up's shapes. On an H200, run392.sh first
# (the issue's table for the committed code).
#   run(command="bash bench/cuda/runs/run412.sh", carry=[".device/bundle.tar.xz", ".device/new.tar.xz"])
# new.tar.xz: git show 64cf2d5:src/backend/cuda/fused_linear_prefill.cu over the file, build
# bench_cuda_fused_linear test_cuda_fused_linear bench_gpu_e2e, strip them into /tmp/newbin/one, then
# tar -C /tmp/newbin -cf - . | xz -T2 -6 > .device/new.tar.xz, and check the file out again.
set -uo pipefail
root=$(pwd)
t0=$(date +%s)
export PATH=/usr/local/cuda/bin:$PATH
card=$(nvidia-smi --query-gpu=name --format=csv,noheader)
(cd .device && tar -xJf bundle.tar.xz && mkdir -p new && tar -xJf new.tar.xz -C new) || exit 1
if grep -q H200 <<< "$card"; then timeout 330 bash bench/cuda/runs/run392.sh > /dev/null 2>&1; fi
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run412.log
{
date -u; echo "$card"
[ -d /tmp/l7b/base ] || .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 \
  --heads 32 --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -3 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for b in bin new/one bin new/one; do
  timeout 60 ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
    --print-kernel-base demangled \
    .device/$b/bench_gpu_e2e /tmp/l7b --decode 4 --profile-case "batch 1, one variant" --profile-what prompt \
    > /tmp/k.csv 2> /tmp/k.err
  echo "== $b: ncu rc $?: $(python3 - /tmp/k.csv <<'PY'
import csv, sys, re, collections
rows = list(csv.DictReader([l for l in open(sys.argv[1]) if l.startswith('"')]))
agg = collections.defaultdict(lambda: [0, 0.0])
names = ['qkv', 'o', 'gate/up', 'down']
i = 0
for r in rows:
    if r.get('Metric Name') != 'gpu__time_duration.sum': continue
    v = float(r['Metric Value'].replace(',', '')); u = r.get('Metric Unit', '')
    us = v * 1e-3 if u in ('ns', 'nsecond') else v * 1e3 if u in ('ms', 'msecond') else v
    m = re.search(r'FusedTile<(\d+), (\d+)>', r['Kernel Name'])
    key = f'{names[i % 4]} {m.group(1)}x{m.group(2)}' if m else 'other'
    i += 1 if m else 0
    agg[key][0] += 1; agg[key][1] += us
    agg['all'][0] += 1; agg['all'][1] += us
print('  '.join(f'{k}: {n} x {us / n:.2f} us = {us:.0f}' for k, (n, us) in sorted(agg.items())))
PY
)"
done
echo "-- $(( $(date +%s) - t0 )) s"
for b in bin new/one; do
  [ $(( $(date +%s) - t0 )) -gt 480 ] && { echo "left out: (c) of $b"; continue; }
  timeout 100 .device/$b/bench_cuda_fused_linear --prefill 4096 4096 4096 11008 12288 4096 22016 4096 \
    > $OUT/bench_c_${b//\//_}.log 2>&1
  echo "== $b: bench (c) rc $?"
  grep -E "cuBLAS GemmEx [0-9]|the engine's choice" $OUT/bench_c_${b//\//_}.log | grep "c: 512" | cut -c1-150
done
echo "-- $(( $(date +%s) - t0 )) s"; date -u
} > $L 2>&1
[ -f $OUT/run392.log ] && cat $OUT/run361main.log $OUT/run392.log
cat $L
