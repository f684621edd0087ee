#!/usr/bin/env python3
"""Sums an `ncu --csv --page raw --metrics gpu__time_duration.sum` capture per kernel name:
launches, total and mean time (µs), sorted by total. Usage: tools/ncu_sum.py CAPTURE.csv"""
import csv
import re
import sys
from collections import defaultdict



def short(name):
    """The kernel's name with its template arguments, without `void`, namespaces or parameters."""
    name = name.replace("(anonymous namespace)::", "").replace("<unnamed>::", "").replace("(int)", "")
    depth = 0
    for i, ch in enumerate(name):
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "(" and depth == 0:
            name = name[:i]
            break
    head, bracket, args = re.sub(r"^void ", "", name.strip()).partition("<")
    return head.split("::")[-1] + bracket + args


rows = []
unit = 1e-3  # ns -> µs unless the units row says otherwise
scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}
with open(sys.argv[1], newline="") as f:
    lines = [l for l in f if l.startswith('"')]  # drop the profiler's own lines
for rec in csv.DictReader(lines):
    name, t = rec.get("Kernel Name"), rec.get("gpu__time_duration.sum")
    if t in scale:
        unit = scale[t]  # the units row
        continue
    if not name or not t or not re.match(r"^[0-9.,]+$", t):
        continue
    rows.append((short(name), float(t.replace(",", ""))))
by = defaultdict(list)
for n, t in rows:
    by[n].append(t * unit)
total = sum(sum(v) for v in by.values())
print(f"{'kernel':60s} {'launches':>8s} {'total us':>10s} {'mean us':>9s}")
for n, v in sorted(by.items(), key=lambda kv: -sum(kv[1])):
    print(f"{n[:60]:60s} {len(v):8d} {sum(v):10.1f} {sum(v) / len(v):9.2f}")
print(f"{'sum':60s} {len(rows):8d} {total:10.1f}")
