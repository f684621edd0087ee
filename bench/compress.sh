#!/usr/bin/env bash
# The compressor against the disk: `bitdelta compress` on a synthetic base/fine-tune pair, side by
# side with reading the same files (`cat > /dev/null`), cold (page cache dropped, when permitted)
# and warm; peak RSS from /usr/bin/time. Medians of REPS runs.
#   bench/compress.sh [DATA_DIR] [REPS]      (build first: scripts/build.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:-bench/data/synth}
reps=${2:-3}
bin=build/bitdelta
[ -d "$data/base" ] || build/bench/make_synthetic "$data"
files=("$data"/base/*.safetensors "$data"/finetuned/*.safetensors)
bytes=$(du -cb "${files[@]}" | tail -1 | cut -f1)
ckpt=$(du -cb "$data"/finetuned/*.safetensors | tail -1 | cut -f1)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

can_drop=0
sync && echo 3 >/proc/sys/vm/drop_caches 2>/dev/null && can_drop=1
drop() { [ $can_drop = 1 ] && sync && echo 3 >/proc/sys/vm/drop_caches; true; }
now() { date +%s.%N; }
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

run_mode() {  # $1 = cold|warm
  local cat_t=() cmp_t=() rss=()
  for _ in $(seq "$reps"); do
    [ "$1" = cold ] && drop || cat "${files[@]}" >/dev/null
    local t0=$(now); cat "${files[@]}" >/dev/null; local t1=$(now)
    cat_t+=("$(echo "$t1 - $t0" | bc -l)")
    [ "$1" = cold ] && drop || cat "${files[@]}" >/dev/null
    /usr/bin/time -f "%e %M" -o "$out/time" "$bin" compress "$data/base" "$data/finetuned" -o "$out/d.bitdelta" \
      --threads 2 >"$out/log"
    read -r secs kb <"$out/time"
    cmp_t+=("$secs"); rss+=("$kb")
  done
  local c=$(printf '%s\n' "${cat_t[@]}" | median) k=$(printf '%s\n' "${cmp_t[@]}" | median)
  local r=$(printf '%s\n' "${rss[@]}" | sort -g | tail -1)
  printf '%-5s | %6.2f GB | cat %6.2f s  %6.2f GB/s | compress %6.2f s  %6.2f GB/s | %5.1f%% of read | peak RSS %7.1f MB = %.3f of one checkpoint\n' \
    "$1" "$(echo "$bytes/1000000000" | bc -l)" "$c" "$(echo "$bytes/$c/1000000000" | bc -l)" "$k" "$(echo "$bytes/$k/1000000000" | bc -l)" \
    "$(echo "100*$c/$k" | bc -l)" "$(echo "$r/1000" | bc -l)" "$(echo "$r*1024/$ckpt" | bc -l)"
}

echo "input: $data (base + fine-tune, $bytes bytes); output to a temp dir on the same disk; $reps runs, medians"
[ $can_drop = 1 ] && run_mode cold || echo "cold: cannot drop the page cache here (not root); skipped"
run_mode warm
tail -12 "$out/log"
