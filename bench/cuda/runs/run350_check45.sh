#!/usr/bin/env bash
# Session 45, second device call: the fixed fork test and the GPU tests; the kernel checks (the
# terms' zeroing back at the fork, the terms-beside checks kept); the BPE fixture (added-token ids
# as tokenizers gives them) against the tokenizers package; the cold load A/B again, five
# alternations of copy-behind-read and copy-after-read, each process measuring its disk floor.
set -uo pipefail
root=$(pwd)
export PATH=/usr/local/cuda/bin:$PATH
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/check45.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
{
date -u
stamp "gpu tests"
BITDELTA_CLI_PATH=$root/.device/bin/bitdelta .device/bin/bitdelta_gpu_tests > $OUT/gpu_tests.log 2>&1; echo "rc $?"
grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|forked" $OUT/gpu_tests.log | head -20
stamp "bpe check"
python3 tools/bpe_fixture/make_fixture.py tests/fixtures/bpe --check 2>&1 | tail -8
stamp "kernel tests"
.device/bin/test_cuda_fused_linear > $OUT/kt.log 2>&1; echo "rc $?"
grep -E "^FAIL" $OUT/kt.log | head -20; grep -c "terms beside" $OUT/kt.log; tail -1 $OUT/kt.log
stamp "7B"
.device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 --kv-heads 32 \
  --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || { tail -5 /tmp/ms.log; }
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json /tmp/l7b/base/
for round in 1 2 3 4 5; do
  for cold in behind serial; do
    if [ $cold = serial ]; then export BITDELTA_AB_COLD_SERIAL=1; else unset BITDELTA_AB_COLD_SERIAL; fi
    echo "round $round cold=$cold: $(.device/bin/bench_gpu_e2e /tmp/l7b --decode 4 --batch 8 --profile-case mixed 2>&1 |
      grep -E '^cold load|floor: disk|^disk read' | tr '\n' ' ')"
  done
done
unset BITDELTA_AB_COLD_SERIAL
stamp done
} > $L 2>&1
tail -c 11000 $L
