# Helpers for the run scripts (source it after setting t0=$(date +%s)); runs up to 425 wrote their own.
# left S WHAT: true (and says what is left out) once more than S seconds passed since t0.
left() { [ $(( $(date +%s) - t0 )) -gt $1 ] && { echo "left out: $2"; return 0; }; return 1; }
# sums: ncu's csv on stdin (--metrics gpu__time_duration.sum --print-kernel-base demangled) to the fused
# GEMM launches by projection, taken as qkv, o, gate/up, down in launch order: count x µs = total each.
sums() {
  python3 -c '
import csv, sys, re, collections
rows = list(csv.DictReader([l for l in sys.stdin if l.startswith("\"")]))
agg = collections.defaultdict(lambda: [0, 0.0])
names = ["qkv", "o", "gate/up", "down"]
i = 0
for r in rows:
    if r.get("Metric Name") != "gpu__time_duration.sum": continue
    v = float(r["Metric Value"].replace(",", "")); u = r.get("Metric Unit", "")
    us = v * 1e-3 if u in ("ns", "nsecond") else v * 1e3 if u in ("ms", "msecond") else v
    m = re.search(r"FusedTile<(\d+), (\d+)>", r["Kernel Name"])
    key = f"{names[i % 4]} {m.group(1)}x{m.group(2)}" if m else "other"
    i += 1 if m else 0
    agg[key][0] += 1; agg[key][1] += us; agg["all"][0] += 1; agg["all"][1] += us
print("  ".join(f"{k}: {n} x {us / n:.2f} us = {us:.0f}" for k, (n, us) in sorted(agg.items())))'
}
