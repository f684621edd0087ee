#!/usr/bin/env bash
# Session 58: where the fused prompt GEMM's warps wait, instruction by instruction: ncu's warp-state
# sampling per SASS instruction (source page) on layer 0's qkv GEMM of a variant's 512-token prompt
# (fused_gemm_kernel<true, FusedTile<2, 256>>, 12288 x 4096), the bundle's build; the 30 instructions
# with the most samples, with the stall reasons' columns. Runs 399-402: its long-scoreboard stalls are
# 4.69 cycles per instruction against cuBLAS's 2.57, and sharing x between blocks did not help.
#   run(command="bash bench/cuda/runs/run403.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
export PATH=/usr/local/cuda/bin:$PATH
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run403.log
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d /tmp/l7b/base ] || .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 \
  --heads 32 --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -3 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
timeout 200 ncu --clock-control none --profile-from-start off -k regex:fused_gemm --launch-count 1 \
  --section SourceCounters --section WarpStateStats --import-source no -o /tmp/fused -f \
  .device/bin/bench_gpu_e2e /tmp/l7b --decode 4 --profile-case "batch 1, one variant" --profile-what prompt \
  > /tmp/ncu_run.log 2>&1
echo "ncu rc $?"; grep -E "^==PROF==|ERROR" /tmp/ncu_run.log | head -5
ncu -i /tmp/fused.ncu-rep --page source --print-source sass --csv > $OUT/fused_sass.csv 2> /tmp/src_err.log
echo "source page rc $?: $(wc -l < $OUT/fused_sass.csv) lines"; head -3 /tmp/src_err.log
python3 - $OUT/fused_sass.csv <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head = next(i for i, r in enumerate(rows) if any('Source' == c for c in r))
h, body = rows[head], rows[head + 1:]
print("columns:", " | ".join(h)[:1500])
key = next((i for i, c in enumerate(h) if c.startswith('Warp Stall Sampling (All')), None)
if key is None:
    sys.exit("no sampling column")
def num(s):
    try: return float(s.replace(',', ''))
    except ValueError: return 0.0
total = sum(num(r[key]) for r in body if len(r) > key)
print(f"samples: {total:.0f}")
keep = [i for i, c in enumerate(h) if c in ('# Address', 'Address', 'Source') or c.startswith('Warp Stall Sampling') or c.startswith('stall_')]
for r in sorted(body, key=lambda r: -num(r[key]) if len(r) > key else 0)[:30]:
    print(f"{100 * num(r[key]) / max(total, 1):5.1f}%  " + "  ".join(r[i] for i in keep if i < len(r))[:200])
PY
date -u
} > $L 2>&1
gzip -k $OUT/fused_sass.csv 2>/dev/null && rm -f $OUT/fused_sass.csv
cat $L
