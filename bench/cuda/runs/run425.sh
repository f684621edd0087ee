#!/usr/bin/env bash
# Session 61, prepared; run in session 62 as `B=540 bash bench/cuda/runs/run425.sh` (H100, run425.log).
# The bundle (bin) was rebuilt from a49942a (the signs' box as 32-byte rows, part 61). (1) Its GPU tests and
# kernel checks (R32's kernel checks passed in run 423, its GPU tests never ran). (2) On an H200, run392.sh
# (the issue's table). (3) Q (runs/run425_q128.patch): the 128 x 128 tile where the engine picks 64 x 256 (N =
# 4096 at 512 rows: the 7B's o and down; the same number of tiles), against bin: Q's GPU tests; case (c) with
# x just written at 4096^2, 4096 x 11008 and 12288 x 4096 (unchanged, a control), three rounds alternated;
# ncu's per-projection sums of a variant's 512-token 7B prompt (caches kept), two rounds; TTFT at 512 tokens,
# three rounds.
# .device/new.tar.xz: Q/ (bench_cuda_fused_linear, bench_gpu_e2e, bitdelta_gpu_tests): git apply the
# patch, build those targets, strip them into /tmp/newbin/Q, git checkout the file;
# tar -C /tmp/newbin -cf - . | xz -T2 -9 > .device/new.tar.xz.
#   run(command="bash bench/cuda/runs/run425.sh", carry=[".device/bundle.tar.xz", ".device/new.tar.xz"])
set -uo pipefail
root=$(pwd)
t0=$(date +%s)
B=${B:-500}  # seconds this run may take in all: the (c), ncu and TTFT loops stop at 60, 72 and 85% of it
export PATH=/usr/local/cuda/bin:$PATH
card=$(nvidia-smi --query-gpu=name --format=csv,noheader)
(cd .device && tar -xJf bundle.tar.xz && mkdir -p new && tar -xJf new.tar.xz -C new) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
export BITDELTA_CLI_PATH=$root/.device/bin/bitdelta
L=$OUT/run425.log
source bench/cuda/runs/common.sh  # left, sums
{
date -u; echo "$card"
for b in bin new/Q; do
  timeout 60 .device/$b/bitdelta_gpu_tests > /tmp/gt.log 2>&1; echo "$b GPU tests rc $?: $(tail -2 /tmp/gt.log | tr '\n' ' ')"
done
if ! grep -q H200 <<< "$card"; then  # on an H200, run392.sh's run361.sh main runs them
  timeout 100 .device/bin/test_cuda_fused_linear > /tmp/kt.log 2>&1
  echo "bin kernel checks rc $?: $(tail -1 /tmp/kt.log)"; grep -m3 FAIL /tmp/kt.log
fi
} > $L 2>&1
if grep -q H200 <<< "$card"; then timeout $(( B - 40 < 330 ? B - 40 : 330 )) bash bench/cuda/runs/run392.sh > /dev/null 2>&1; fi
{
for round in 1 2 3; do
  for b in bin new/Q; do
    left $((B * 60 / 100)) "(c) of $b round $round" && continue
    timeout 60 .device/$b/bench_cuda_fused_linear --prefill-fresh-x 4096 4096 4096 11008 12288 4096 > /tmp/c.log 2>&1
    echo "== $b round $round: (c) fresh x rc $?"; { echo "== $b round $round"; cat /tmp/c.log; } >> $OUT/c_all.log
    grep -E "cuBLAS GemmEx [0-9]|128x128 tile/block|64x256 persistent|stream-K|engine's choice" /tmp/c.log | grep "c: 512" |
      cut -c1-150
  done
done
echo "-- $(( $(date +%s) - t0 )) s"
[ -d /tmp/l7b/base ] || .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 \
  --heads 32 --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -3 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for b in bin new/Q bin new/Q; do
  left $((B * 72 / 100)) "ncu of $b" && continue
  echo "== $b, prompt, caches kept: $(timeout 60 ncu --clock-control none --cache-control none --profile-from-start off \
    --metrics gpu__time_duration.sum --csv --print-kernel-base demangled \
    .device/$b/bench_gpu_e2e /tmp/l7b --decode 4 --profile-case "batch 1, one variant" --profile-what prompt \
    2> /tmp/k.err | sums)"
done
for round in 1 2 3; do
  for b in bin new/Q; do
    left $((B * 85 / 100)) "TTFT of $b round $round" && continue
    echo "== $b TTFT 512 round $round: $(timeout 40 .device/$b/bench_gpu_e2e /tmp/l7b --prompt 512 --decode 4 --batch 32 \
      --requests 8 2>&1 | grep -A15 'TTFT of' | awk 'NR > 1 {print $1, $2}' | tr '\n' ' ')"
  done
done
echo "-- $(( $(date +%s) - t0 )) s"; date -u
} >> $L 2>&1
[ -f $OUT/run392.log ] && cat $OUT/run361main.log $OUT/run392.log
cat $L
