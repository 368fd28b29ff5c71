#!/usr/bin/env python3
"""Per-kernel time table from an Nsight Compute CSV (`ncu --csv --metrics gpu__time_duration.sum`).

Usage: ncu-kernel-table.py CSV [--calls N] [--top K]

Sums each kernel's durations over the profiled launches, divides by N (how many equal calls the
profiled program made, e.g. 3 for `gpu_train_bench --step-only`), and prints the kernels by total
time: microseconds per call, share of the total, launches per call, name. Lines of the program's
own output in the CSV are skipped.
"""
import argparse
import collections
import csv
import sys

UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--calls", type=int, default=1)
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    if a.calls < 1:
        sys.exit("--calls must be at least 1")
    header, per = None, collections.defaultdict(lambda: [0, 0.0])
    with open(a.csv, newline="") as f:
        for row in csv.reader(f):
            if "Kernel Name" in row and "Metric Value" in row:
                header = row
                continue
            if header is None or len(row) != len(header):
                continue
            r = dict(zip(header, row))
            if r.get("Metric Name") != "gpu__time_duration.sum":
                continue
            unit = r.get("Metric Unit", "nsecond")
            if unit not in UNITS:
                sys.exit(f"unknown duration unit {unit!r}")
            us = float(r["Metric Value"].replace(",", "")) * UNITS[unit]
            k = per[r["Kernel Name"][:100]]
            k[0] += 1
            k[1] += us
    if not per:
        sys.exit(f"{a.csv}: no gpu__time_duration.sum rows (run ncu with --csv --metrics gpu__time_duration.sum)")
    total = sum(t for _, t in per.values())
    launches = sum(n for n, _ in per.values())
    print(f"{total / a.calls:.1f} us of kernel time a call ({launches / a.calls:.0f} launches), {a.calls} calls profiled")
    print(f"{'us/call':>10} {'share':>6} {'n/call':>7}  kernel")
    for name, (n, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[: a.top]:
        print(f"{t / a.calls:10.1f} {100 * t / total:5.1f}% {n / a.calls:7.1f}  {name}")


if __name__ == "__main__":
    main()
