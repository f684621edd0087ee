#!/usr/bin/env python3
"""Run 373's log as tables: per setting, the median over rounds of each (b) row (µs and × roofline)
and of the 7B steps (ms). Usage: run373_summary.py run373.log"""
import re
import statistics
import sys
from collections import defaultdict

b_rows = defaultdict(list)  # (setting, shape, row) -> [(us, ratio)]
steps = defaultdict(list)   # (setting, case) -> [ms]
setting = None
for line in open(sys.argv[1], encoding="utf-8"):
    m = re.match(r"-- \d+ s: \(b\) round \d+, (.*)$", line)
    if m:
        setting = m.group(1).strip()
        continue
    if line.startswith("-- "):
        setting = None
        continue
    m = re.match(r"(\d+x\d+)\s+b: 16 rows 16 variants (.*?)\s{2,}([\d.]+)\s+[\d.]+\s+\d+\s+[\d.]+\s+([\d.]+) x roofline",
                 line)
    if m and setting:
        b_rows[(setting, m.group(1), m.group(2))].append((float(m.group(3)), float(m.group(4))))
        continue
    m = re.match(r"round \d+,? (.*?): (.*)$", line)
    if m:
        for case, ms in re.findall(r"(batch \d+, [^\d]*?[\w ]*?)\s{2,}([\d.]+) ms", m.group(2)):
            steps[(m.group(1), case.strip())].append(float(ms))

print("(b), medians over rounds: µs, x roofline")
for key in sorted(b_rows):
    v = b_rows[key]
    print(f"  {key[1]:<11} {key[0]:<40} {key[2]:<55} {statistics.median(u for u, _ in v):7.2f}"
          f" {statistics.median(r for _, r in v):6.3f}  (n={len(v)})")
print("7B steps, medians over rounds: ms")
for key in sorted(steps):
    v = steps[key]
    print(f"  {key[0]:<45} {key[1]:<30} {statistics.median(v):7.2f}  {v}")
