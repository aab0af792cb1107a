#!/usr/bin/env python3
"""Summarises CubeCL's kernel profile (CUBECL_DEBUG_OPTION=profile).

CubeCL prints a table of kernel names, total durations and launch counts each
time its profile summary is flushed (at a device sync, so about once a step in
`aam-dev step`). This prints one line per table (total GPU time and
launches) and the heaviest kernels of the last large table, grouped by kernel
(the name's first field, plus the fusion kind for fused kernels).

Usage: kernel_summary.py PROFILE_LOG[.gz] [--top N] [--min-launches N]
"""
import argparse
import gzip
import re

UNITS = {"ns": 1e-6, "µs": 1e-3, "us": 1e-3, "ms": 1.0, "s": 1e3}


def duration_ms(text):
    m = re.fullmatch(r"([0-9.]+)\s*(ns|µs|us|ms|s)", text.strip())
    if not m:
        raise ValueError(text)
    return float(m.group(1)) * UNITS[m.group(2)]


def tables(lines):
    """Yields each summary table as a list of (name, ms, launches)."""
    rows, inside = [], False
    for line in lines:
        cells = [c.strip() for c in line.rstrip("\n").split("|")]
        if len(cells) >= 6 and cells[1] == "Name" and cells[2] == "Duration":
            rows, inside = [], True
            continue
        if not inside or len(cells) < 6:
            continue
        name, dur, count = cells[1], cells[-4], cells[-3]
        if name == "Total":
            yield rows
            inside = False
            continue
        try:
            rows.append((name, duration_ms(dur), int(count)))
        except ValueError:
            continue


def group(name):
    fields = [f.strip() for f in name.split("|")]
    key = fields[0]
    if key == "MatmulEntry":
        key += " " + next((f for f in fields if f.endswith("MatmulFamily")), "")
    elif len(fields) > 2:
        key += " " + fields[1]
    return key


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--min-launches", type=int, default=100)
    args = ap.parse_args()
    opener = gzip.open if args.log.endswith(".gz") else open
    with opener(args.log, "rt", errors="replace") as f:
        found = list(tables(f))
    if not found:
        print("no profile tables found")
        return
    print("table  gpu_ms  launches")
    for i, rows in enumerate(found):
        print(f"{i:5d} {sum(r[1] for r in rows):7.1f} {sum(r[2] for r in rows):9d}")
    large = [rows for rows in found if sum(r[2] for r in rows) >= args.min_launches]
    last = (large or found)[-1]
    total = sum(r[1] for r in last)
    grouped = {}
    for name, ms, n in last:
        g = grouped.setdefault(group(name), [0.0, 0])
        g[0] += ms
        g[1] += n
    print(f"\nlast large table: {total:.1f} ms of kernels, {sum(r[2] for r in last)} launches")
    print(f"{'kernel':60} {'ms':>8} {'share':>6} {'launches':>9} {'us/launch':>10}")
    for key, (ms, n) in sorted(grouped.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{key[:60]:60} {ms:8.2f} {100 * ms / total:5.1f}% {n:9d} {1e3 * ms / n:10.1f}")


if __name__ == "__main__":
    main()
