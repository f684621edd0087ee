#!/usr/bin/env bash
# Session 61: the K effect (runs 420-422). S (run 422: each row group's 512 bytes of signs per stage
# as a 5-D box of 16-byte rows) made the delta 1.5-2.7x costlier, which says the signs' copies cost
# more than their bytes. Two tensor maps of the same signs, against the bundle (bin, HEAD's box: per
# row group 8 g x 2 t' of 16-byte rows, 256 bytes):
#   R32 (runs/run423_signs_rows32.patch): the same bytes and shared-memory layout as HEAD, as 32-byte
#     rows (dim 0 = a t' pair's 8 words): half the box rows;
#   R512 (runs/run423_signs_rows512.patch): each row group's 512-byte block as one row (S's bytes and
#     layout, 1/32 of S's rows);
#   SR (runs/run423_sign_ring.patch, on top of R512's map): the signs in a ring of their own (3 slots
#     at 64-row tiles, 2 at 128), each slot a 256-column block (4 stages) copied once: a quarter of
#     R512's bytes and rows, half of HEAD's bytes; a third producer thread.
# Kernel checks of R32, R512 and SR, SR's GPU tests; case (c) with x just written at N = 4096, K = 4096, 8192, 11008, 14336
# and at 128 rows (o's, down's, qkv's, gate/up's shapes); the 7B TTFT at 128 and 512 tokens, two rounds.
# .device/new.tar.xz: R32/, R512/, SR/ (bench_cuda_fused_linear, test_cuda_fused_linear, bench_gpu_e2e; SR also
# bitdelta_gpu_tests):
# git apply the patch, build those targets, strip them into /tmp/newbin/<name>, git checkout the file;
# tar -C /tmp/newbin -cf - . | xz -T2 -9 > .device/new.tar.xz.
#   run(command="bash bench/cuda/runs/run423.sh", carry=[".device/bundle.tar.xz", ".device/new.tar.xz"])
set -uo pipefail
root=$(pwd)
t0=$(date +%s)
export PATH=/usr/local/cuda/bin:$PATH
card=$(nvidia-smi --query-gpu=name --format=csv,noheader)
(cd .device && tar -xJf bundle.tar.xz && mkdir -p new && tar -xJf new.tar.xz -C new) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
export BITDELTA_CLI_PATH=$root/.device/bin/bitdelta
L=$OUT/run423.log
left() { [ $(( $(date +%s) - t0 )) -gt $1 ] && { echo "left out: $2"; return 0; }; return 1; }
{
date -u; echo "$card"
for b in SR; do
  timeout 100 .device/new/$b/test_cuda_fused_linear > /tmp/kt.log 2>&1
  echo "$b kernel checks rc $?: $(tail -1 /tmp/kt.log)"; grep -m3 FAIL /tmp/kt.log
done
timeout 60 .device/new/SR/bitdelta_gpu_tests > /tmp/gt.log 2>&1; echo "SR GPU tests rc $?: $(tail -2 /tmp/gt.log | tr '\n' ' ')"
for b in bin new/SR new/R32 new/R512; do
  left 300 "(c) of $b" && continue
  timeout 60 .device/$b/bench_cuda_fused_linear --prefill-fresh-x 4096 4096 4096 8192 4096 11008 4096 14336 \
    > /tmp/c.log 2>&1
  echo "== $b: (c) fresh x rc $?"
  grep -E "cuBLAS GemmEx [0-9]|128x128 tile/block|64x256 persistent|engine's choice" /tmp/c.log | grep "c: 512" | cut -c1-150
  timeout 60 .device/$b/bench_cuda_fused_linear --prefill-rows 128 4096 4096 4096 11008 12288 4096 22016 4096 \
    > /tmp/r.log 2>&1
  echo "== $b: 128 rows rc $?"
  grep -E "cuBLAS GemmEx, x just|the engine's choice, x just" /tmp/r.log | grep "c: 128" | cut -c1-150
done
echo "-- $(( $(date +%s) - t0 )) s"
[ -d /tmp/l7b/base ] || .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 \
  --heads 32 --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -3 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for round in 1 2; do
  for bp in bin:512 new/SR:512 new/R512:512 bin:128 new/SR:128; do
    b=${bp%:*} p=${bp#*:}
    left 360 "TTFT $p of $b round $round" && continue
    echo "== $b TTFT $p round $round: $(timeout 40 .device/$b/bench_gpu_e2e /tmp/l7b --prompt $p --decode 4 --batch 32 \
      --requests 8 2>&1 | grep -A15 'TTFT of' | awk 'NR > 1 {print $1, $2}' | tr '\n' ' ')"
  done
done
for b in R32 R512; do
  left 450 "kernel checks of $b" && continue
  timeout 100 .device/new/$b/test_cuda_fused_linear > /tmp/kt.log 2>&1
  echo "$b kernel checks rc $?: $(tail -1 /tmp/kt.log)"; grep -m3 FAIL /tmp/kt.log
done
echo "-- $(( $(date +%s) - t0 )) s"; date -u
} > $L 2>&1
cat $L
