#!/usr/bin/env python3
"""Compares two aam-rs runs' output folders: every number of metrics.csv, and every tensor of
checkpoints/last.safetensors (weights and optimiser moments), as the largest relative difference
(|a - b| / max(|a|, |b|, 1e-6) for metrics; |a - b| / max(max|a|, FLOOR) per tensor, reported
for the weights (model.*) and the optimiser state (optim.*) apart). Tensors whose values all stay
below FLOOR count at FLOOR's scale: the zero-initialised biases whose exact gradient is zero (the
LayerNorm bias before the pooling scores) hold only rounding noise, which differs between runs
that add the same numbers in another order (as crates/train/tests/data_parallel.rs does).

    python3 benches/compare_runs.py RUN_A RUN_B [--tolerance 1e-3] [--floor 1e-3]

Exits 1 when a difference passes the tolerance or the files do not have the same names. Python's
standard library only (safetensors is read by hand: an 8-byte header length, a JSON header, raw
little-endian data)."""
import argparse
import array
import csv
import json
import math
import struct
import sys

# safetensors dtype -> array typecode (little-endian machines, as every GPU host is).
TYPECODES = {"F32": "f", "F64": "d", "I64": "q", "I32": "i"}


def safetensors(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = data[start:end]
        if info["dtype"] == "BF16":
            halves = array.array("H", raw)
            out[name] = array.array("f", struct.pack(f"<{len(halves)}I", *(h << 16 for h in halves)))
        elif info["dtype"] == "F16":
            out[name] = [v for (v,) in struct.iter_unpack("<e", raw)]
        else:
            out[name] = array.array(TYPECODES[info["dtype"]], raw)
    return out


def metrics(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--tolerance", type=float, default=1e-3)
    p.add_argument("--floor", type=float, default=1e-3)
    args = p.parse_args()
    worst_metric, where_metric = 0.0, ""
    rows_a, rows_b = metrics(f"{args.a}/metrics.csv"), metrics(f"{args.b}/metrics.csv")
    if len(rows_a) != len(rows_b):
        sys.exit(f"metrics.csv: {len(rows_a)} rows against {len(rows_b)}")
    for i, (ra, rb) in enumerate(zip(rows_a, rows_b)):
        for key in ra:
            if "samples_per_sec" in key or "seconds" in key:
                continue
            try:
                x, y = float(ra[key]), float(rb[key])
            except (TypeError, ValueError):
                continue
            if math.isnan(x) and math.isnan(y):
                continue
            d = abs(x - y) / max(abs(x), abs(y), 1e-6)
            if d > worst_metric:
                worst_metric, where_metric = d, f"row {i} {key}: {x} vs {y}"
    ta = safetensors(f"{args.a}/checkpoints/last.safetensors")
    tb = safetensors(f"{args.b}/checkpoints/last.safetensors")
    if ta.keys() != tb.keys():
        sys.exit(f"checkpoints hold different tensors: {sorted(ta.keys() ^ tb.keys())[:5]}")
    worst = {"model": (0.0, ""), "optim": (0.0, "")}
    for name in ta:
        a, b = ta[name], tb[name]
        scale = max(max((abs(x) for x in a), default=0.0), args.floor)
        d = max((abs(x - y) for x, y in zip(a, b)), default=0.0) / scale
        group = "optim" if name.startswith("optim.") else "model"
        if d > worst[group][0]:
            worst[group] = (d, name)
    print(f"metrics.csv: {len(rows_a)} epochs, largest relative difference {worst_metric:.2e} ({where_metric})")
    for group, (d, name) in worst.items():
        print(f"last.safetensors {group}.*: largest difference over max(the tensor's largest value, "
              f"{args.floor:g}) {d:.2e} ({name})")
    ok = worst_metric <= args.tolerance and all(d <= args.tolerance for d, _ in worst.values())
    print(f"within {args.tolerance:g}: {'yes' if ok else 'NO'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
