#!/usr/bin/env bash
# Session 59: what a variant's 512-token 7B prompt spends per kernel, for run 407's three builds (new/n2:
# two rings of one rule; new: x ring of 4; bin: the bundle's one ring): ncu's gpu__time_duration of
# every kernel in the prompt's step, summed by kernel and grid. Run 407: TTFT new 17.1-17.2 ms,
# n2 17.6-17.8, bin 17.7-17.8, while case (c) ranked them the other way at 4096 x 4096.
# Its printout says us where the values are ns (ncu's unit is "ns", which the script does not match;
# run409.sh reads it right): 121477.50 us is 121.48 us.
#   run(command="bash bench/cuda/runs/run408.sh", carry=[".device/bundle.tar.xz", ".device/new.tar.xz"])
set -uo pipefail
root=$(pwd)
export PATH=/usr/local/cuda/bin:$PATH
(cd .device && tar -xJf bundle.tar.xz && mkdir -p new && tar -xJf new.tar.xz -C new) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run408.log
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d /tmp/l7b/base ] || .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 \
  --heads 32 --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -3 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for b in new/n2 new bin new/n2 new bin; do
  t=$(date +%s)
  timeout 150 ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv --print-kernel-base demangled \
    .device/$b/bench_gpu_e2e /tmp/l7b --decode 4 --profile-case "batch 1, one variant" --profile-what prompt \
    > /tmp/k.csv 2> /tmp/k.err
  echo "== $b: ncu rc $? in $(( $(date +%s) - t )) s"
  python3 - /tmp/k.csv <<'PY'
import csv, sys, re, collections
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
rows = list(csv.DictReader(lines))
agg = collections.defaultdict(lambda: [0, 0.0])
total = 0.0
for r in rows:
    if r.get('Metric Name') != 'gpu__time_duration.sum': continue
    v = float(r['Metric Value'].replace(',', '')); unit = r.get('Metric Unit', '')
    us = v / 1e3 if unit == 'nsecond' else v * 1e3 if unit == 'msecond' else v
    full = r['Kernel Name'].replace('(anonymous namespace)::', '').replace('bitdelta::cuda::', '')
    name = re.sub(r'\(.*', '', full).replace('void ', '')[:80] + ' ' + r.get('Grid Size', '')
    agg[name][0] += 1; agg[name][1] += us; total += us
print(f"kernels {sum(a[0] for a in agg.values())}, total {total:.0f} us")
for k, (n, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:14]:
    print(f"  {us:9.1f} us  {n:4d} x {us / n:7.2f}  {k}")
PY
done
date -u
} > $L 2>&1
cat $L
