#!/usr/bin/env bash
# Session 60, the last call: on an H200, run392.sh (the issue's table for the committed code) and
# nothing else. On an H100: (1) which barrier down's warps wait on (run 416: one `@!P0 BRA`, a
# try-wait's retry, holds 14% of down's samples and 16% of o's): ncu's warp-state samples per SASS
# instruction on layer 0's down GEMM of a variant's 512-token 7B prompt, for the bundle (bin, two
# rings) and one ring (O: 64cf2d5's fused_linear_prefill.cu), the 6 busiest instructions each with
# the 10 instructions before it (the try-wait names its barrier's address); (2) E (W's ring capped at
# x's 4 stages in the 128 x 256 tile) against T2 (HEAD's kernel), both with this bench: case (c) with x
# just written at qkv's and gate/up's shapes, two rounds. .device/new.tar.xz: T2/, E2/ (bench only),
# O/ (bench_gpu_e2e only).
#   run(command="bash bench/cuda/runs/run417.sh", carry=[".device/bundle.tar.xz", ".device/new.tar.xz"])
set -uo pipefail
root=$(pwd)
t0=$(date +%s)
export PATH=/usr/local/cuda/bin:$PATH
card=$(nvidia-smi --query-gpu=name --format=csv,noheader)
(cd .device && tar -xJf bundle.tar.xz && mkdir -p new && tar -xJf new.tar.xz -C new) || exit 1
if grep -q H200 <<< "$card"; then
  timeout 500 bash bench/cuda/runs/run392.sh > /dev/null 2>&1
  cat $OUT/run361main.log $OUT/run392.log; exit 0
fi
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run417.log
stalls() {  # build, launch of the prompt's fused GEMMs to skip to, name
  timeout 150 ncu --clock-control none --cache-control none --profile-from-start off -k regex:fused_gemm \
    --launch-skip $2 --launch-count 1 --section SourceCounters --section WarpStateStats --import-source no \
    -o /tmp/st -f .device/$1/bench_gpu_e2e /tmp/l7b --decode 4 --profile-case "batch 1, one variant" \
    --profile-what prompt > /tmp/ncu_st.log 2>&1
  echo "== $3: ncu rc $?"; grep -E "ERROR" /tmp/ncu_st.log | head -3
  ncu -i /tmp/st.ncu-rep --page source --print-source sass --csv > /tmp/st.csv 2> /dev/null
  python3 - /tmp/st.csv <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head = next(i for i, r in enumerate(rows) if any('Source' == c for c in r))
h, body = rows[head], rows[head + 1:]
key = next((i for i, c in enumerate(h) if c.startswith('Warp Stall Sampling (All')), None)
src = h.index('Source')
if key is None: sys.exit("no sampling column")
def num(s):
    try: return float(s.replace(',', ''))
    except ValueError: return 0.0
total = sum(num(r[key]) for r in body if len(r) > key)
print(f"samples: {total:.0f}")
top = sorted(range(len(body)), key=lambda i: -num(body[i][key]) if len(body[i]) > key else 0)[:6]
for i in top:
    print(f"-- {100 * num(body[i][key]) / max(total, 1):5.1f}% at row {i}:")
    for j in range(max(0, i - 10), i + 2):
        if j < len(body) and len(body[j]) > key:
            print(f"   {'>' if j == i else ' '} {num(body[j][key]):6.0f}  {body[j][src][:110]}")
PY
}
{
date -u; echo "$card"
[ -d /tmp/l7b/base ] || .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 \
  --heads 32 --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -3 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
stalls bin 3 "layer 0's down (4096 x 11008), bin (two rings)"
stalls new/O 3 "layer 0's down (4096 x 11008), O (one ring)"
echo "-- $(( $(date +%s) - t0 )) s"
for round in 1 2; do
  for b in T2 E2; do
    timeout 100 .device/new/$b/bench_cuda_fused_linear --prefill-fresh-x 12288 4096 22016 4096 > /tmp/c.log 2>&1
    echo "== $b round $round: (c) fresh x rc $?"
    grep -E "cuBLAS GemmEx [0-9]|engine's choice" /tmp/c.log | grep "c: 512" | cut -c1-150
  done
done
echo "-- $(( $(date +%s) - t0 )) s"; date -u
} > $L 2>&1
cat $L
