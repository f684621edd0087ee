#!/usr/bin/env python3
"""Sums an `ncu --csv --page raw --metrics gpu__time_duration.sum[,dram__bytes_read.sum]` capture per
kernel name: launches, total and mean time (µs), sorted by total; with the DRAM bytes read too, the
MB read and the GB/s they make. Usage: tools/ncu_sum.py CAPTURE.csv"""
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


def number(s):
    return s is not None and re.match(r"^[0-9.,]+$", s) is not None


TIME, BYTES = "gpu__time_duration.sum", "dram__bytes_read.sum"
time_scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}
byte_scale = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}
t_unit, b_unit = 1e-3, 1.0  # ns -> µs, bytes, unless the units row says otherwise
rows = []
with open(sys.argv[1], newline="") as f:
    lines = [l for l in f if l.startswith('"')]  # drop the profiler's own lines
for rec in csv.DictReader(lines):
    name, t, b = rec.get("Kernel Name"), rec.get(TIME), rec.get(BYTES)
    if t in time_scale:  # the units row
        t_unit = time_scale[t]
        b_unit = byte_scale.get(b, 1.0)
        continue
    if not name or not number(t):
        continue
    rows.append((short(name), float(t.replace(",", "")) * t_unit,
                 float(b.replace(",", "")) * b_unit if number(b) else None))
have_bytes = bool(rows) and all(b is not None for _, _, b in rows)
by = defaultdict(list)
for n, t, b in rows:
    by[n].append((t, b))
extra = f" {'MB read':>9s} {'GB/s':>7s}" if have_bytes else ""
print(f"{'kernel':60s} {'launches':>8s} {'total us':>10s} {'mean us':>9s}{extra}")


def line(label, v):
    t = sum(x for x, _ in v)
    s = f"{label[:60]:60s} {len(v):8d} {t:10.1f} {t / len(v):9.2f}"
    if have_bytes:
        b = sum(y for _, y in v)
        s += f" {b / 1e6:9.1f} {b / 1e3 / t if t else 0:7.0f}"
    print(s)


for n, v in sorted(by.items(), key=lambda kv: -sum(x for x, _ in kv[1])):
    line(n, v)
line("sum", [(t, b) for _, t, b in rows])
