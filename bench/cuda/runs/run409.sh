#!/usr/bin/env bash
# Session 59: one arrival per consumer warp on the empty barriers (instead of one per thread), with
# one ring (H1: the committed kernel otherwise) and with two rings (T1: x's leads by 3 stages, W's
# takes the rest; T0: the same with one arrival per thread), against the bundle's build (bin):
# kernel checks of T1 and H1 (and T0 if time is left), ncu's per-kernel sums of a variant's 512-token
# 7B prompt (run408.sh's), and the 7B TTFT, the four builds alternated in two rounds.
# .device/new.tar.xz holds T1/, H1/, T0/.
#   run(command="bash bench/cuda/runs/run409.sh", carry=[".device/bundle.tar.xz", ".device/new.tar.xz"])
set -uo pipefail
root=$(pwd)
t0=$(date +%s)
export PATH=/usr/local/cuda/bin:$PATH
(cd .device && tar -xJf bundle.tar.xz && mkdir -p new && tar -xJf new.tar.xz -C new) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run409.log
checks() {
  timeout 100 .device/new/$1/test_cuda_fused_linear > $OUT/kernel_test_$1.log 2>&1
  echo "$1 kernel checks rc $?: $(tail -1 $OUT/kernel_test_$1.log)"; grep -m3 FAIL $OUT/kernel_test_$1.log
}
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
checks T1; checks H1
echo "-- $(( $(date +%s) - t0 )) s"
[ -d /tmp/l7b/base ] || .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 \
  --heads 32 --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -3 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for b in new/T1 new/H1 new/T0 bin new/T1 new/H1 new/T0 bin; do
  timeout 60 ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
    --print-kernel-base demangled \
    .device/$b/bench_gpu_e2e /tmp/l7b --decode 4 --profile-case "batch 1, one variant" --profile-what prompt \
    > /tmp/k.csv 2> /tmp/k.err
  echo "== $b: ncu rc $?: $(python3 - /tmp/k.csv <<'PY'
import csv, sys, re, collections
rows = list(csv.DictReader([l for l in open(sys.argv[1]) if l.startswith('"')]))
agg = collections.defaultdict(lambda: [0, 0.0])
for r in rows:
    if r.get('Metric Name') != 'gpu__time_duration.sum': continue
    v = float(r['Metric Value'].replace(',', '')); u = r.get('Metric Unit', '')
    us = v * 1e-3 if u in ('ns', 'nsecond') else v * 1e3 if u in ('ms', 'msecond') else v
    m = re.search(r'FusedTile<(\d+), (\d+)>', r['Kernel Name'])
    key = f'tile {m.group(1)}x{m.group(2)}' if m else 'other'
    agg[key][0] += 1; agg[key][1] += us
    agg['all'][0] += 1; agg['all'][1] += us
print('  '.join(f'{k}: {n} x {us / n:.2f} us = {us:.0f}' for k, (n, us) in sorted(agg.items())))
PY
)"
done
echo "-- $(( $(date +%s) - t0 )) s"
for round in 1 2; do
  for b in new/T1 new/H1 new/T0 bin; do
    [ $(( $(date +%s) - t0 )) -gt 520 ] && { echo "left out: $b round $round"; continue; }
    echo "== $b round $round: $(timeout 60 .device/$b/bench_gpu_e2e /tmp/l7b --decode 4 --batch 32 --requests 8 2>&1 |
      grep -A15 'TTFT of' | awk 'NR > 1 {print $1, $2}' | tr '\n' ' ')"
  done
done
[ $(( $(date +%s) - t0 )) -lt 480 ] && checks T0
echo "-- $(( $(date +%s) - t0 )) s"; date -u
} > $L 2>&1
cat $L
