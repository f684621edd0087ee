#!/usr/bin/env python3
"""Reads `nsys stats --report cuda_gpu_trace --format csv` of one captured prompt: the span from the
first GPU operation's start to the last one's end, the time some kernel or copy ran (the union of their
intervals), the idle rest and its longest gaps, and the kernels' time per name. Usage: run391_trace.py CSV"""
import csv
import sys
from collections import defaultdict

rows = list(csv.DictReader(l for l in open(sys.argv[1]) if "," in l))
ev = []
for r in rows:
    try:
        s, d = float(r["Start (ns)"]), float(r["Duration (ns)"])
    except (KeyError, ValueError):
        continue
    ev.append((s, s + d, r.get("Name", "?")))
ev.sort()
if not ev:
    sys.exit("no events")
span = max(e for _, e, _ in ev) - ev[0][0]
busy, end, gaps = 0.0, ev[0][0], []
for s, e, n in ev:
    if s > end:
        gaps.append((s - end, n))
    busy += max(0.0, e - max(s, end))
    end = max(end, e)
print(f"events {len(ev)}  span {span / 1e3:.1f} us  busy {busy / 1e3:.1f} us  idle {(span - busy) / 1e3:.1f} us")
gaps.sort(reverse=True)
print("longest gaps (us, before):", "; ".join(f"{g / 1e3:.1f} {n[:40]}" for g, n in gaps[:8]))
per = defaultdict(float)
for s, e, n in ev:
    per[n.split("(")[0][:70]] += e - s
for n, t in sorted(per.items(), key=lambda x: -x[1])[:14]:
    print(f"  {t / 1e3:9.1f} us  {n}")
