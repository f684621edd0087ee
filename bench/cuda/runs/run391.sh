#!/usr/bin/env bash
# Session 57. On an H200: run387.sh (the table on the committed code). On any other card: why a
# variant's 512-token prompt costs 2.8 ms more than the base's on H100s (TTFT p50 15.1 against
# 17.9-18.0 ms, run 387) when ncu at its locked clock times its kernels only 1.27 ms longer (run 390):
# the first prompt of "batch 1, base" and of "batch 1, one variant" under nsys (the GPU timeline at the
# card's own clocks: span, busy time, gaps; runs/run391_trace.py) and under ncu with the clocks not
# locked (each kernel's time alone; tools/ncu_sum.py).
#   run(command="bash bench/cuda/runs/run391.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then exec bash bench/cuda/runs/run387.sh; fi
root=$(pwd)
export PATH=/usr/local/cuda/bin:$PATH
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run391.log
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader; which nsys ncu
[ -d /tmp/l7b/base ] || .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 \
  --heads 32 --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -3 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for c in base "one variant"; do
  n=${c// /_}
  timeout 120 nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop --trace=cuda --force-overwrite true \
    -o /tmp/p_$n .device/bin/bench_gpu_e2e /tmp/l7b --decode 4 --profile-case "batch 1, $c" --profile-what prompt \
    > /tmp/nsys_$n.log 2>&1
  echo "== nsys, batch 1, $c: rc $?"; tail -2 /tmp/nsys_$n.log
  nsys stats --report cuda_gpu_trace --format csv --output /tmp/t_$n /tmp/p_$n.nsys-rep > /dev/null 2>&1
  ls /tmp/t_${n}* | head -3; python3 bench/cuda/runs/run391_trace.py /tmp/t_${n}_cuda_gpu_trace.csv
done
for c in base "one variant"; do
  f=/tmp/ncu_${c// /_}.csv
  timeout 150 ncu --clock-control none --profile-from-start off --csv --page raw --metrics gpu__time_duration.sum \
    .device/bin/bench_gpu_e2e /tmp/l7b --decode 4 --profile-case "batch 1, $c" --profile-what prompt > $f 2> /tmp/ncu.err
  echo "== ncu, clocks not locked, batch 1, $c: rc $?"; tail -1 /tmp/ncu.err
  python3 tools/ncu_sum.py $f | head -8; python3 tools/ncu_sum.py $f | tail -1
done
date -u
} > $L 2>&1
cat $L
