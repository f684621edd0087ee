#!/usr/bin/env python3
"""Side-by-side table of bench_cuda_fused_linear runs in one log, for A/B comparisons on the device.

A device script runs several binaries (or one binary under several settings) in turn, each run after a
marker line `#### TAG repeat I`, e.g.

    for i in 1 2; do
      echo "#### new repeat $i"; .device/bin/bench_cuda_fused_linear --one-row
      echo "#### old repeat $i"; .device/old/bench_cuda_fused_linear --one-row
    done > ab.log

This prints, per (shape, case, version) row of the benchmark's table, each tag's times in µs and, where
the row has one, its ratio (× cuBLAS or × roofline) in brackets, in the order the repetitions ran.
Usage: tools/ab_table.py LOG [SUBSTRING ...]  (only rows whose case or version contains a substring)
"""
import re
import sys
from collections import OrderedDict, defaultdict

MARK = re.compile(r"^#### (\S+) repeat (\S+)")
# A table row: shape, case and version (fixed-width text), then time_us, MB, GB/s, roof/t, ratio.
ROW = re.compile(r"\s(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)")


def parse(path):
    rows = OrderedDict()  # (shape, case, version) -> {tag: [(time, ratio)]}
    tags = []
    tag = "-"
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = MARK.match(line)
            if m:
                tag = m.group(1)
                if tag not in tags:
                    tags.append(tag)
                continue
            if not re.match(r"\d+x\d+ ", line):
                continue
            m = ROW.search(line)
            if not m:
                continue
            head = line[: m.start()]
            key = (head[:13].strip(), head[13:36].strip(), head[36:].strip())
            rows.setdefault(key, defaultdict(list))[tag].append((float(m.group(1)), float(m.group(5))))
    if "-" not in tags and any("-" in v for v in rows.values()):
        tags.insert(0, "-")
    return rows, tags


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    rows, tags = parse(sys.argv[1])
    wanted = sys.argv[2:]
    for (shape, case, version), by_tag in rows.items():
        if wanted and not any(w in case or w in version for w in wanted):
            continue
        cells = []
        for t in tags:
            vals = by_tag.get(t)
            if vals:
                cells.append(t + " " + " ".join(f"{us:.2f}" + (f" ({r:.3f})" if r else "") for us, r in vals))
        print(f"{shape:11s} {(case + ' | ' + version)[:60]:60s} " + "   ".join(cells))


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:  # (piped into head)
        sys.exit(0)
