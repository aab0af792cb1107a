#!/usr/bin/env python3
"""Per-step training losses of aam-rs runs, drawn on one SVG (Python standard library only).

Reads logs written with AAM_LOG=info,aam_train=debug (benches/data_parallel_device.sh with
STOCHASTIC=1): a training step logs its losses on one line and `epoch E batch K: ...` on the
next; validation batches log losses without that second line and are skipped.

    python3 benches/loss_curves.py --out curves.svg --csv steps.csv one.log:"--devices 0" two.log:"--devices 0,0"

Each panel shows one loss term per step as a moving average (--window steps) of every run.
"""
import argparse
import csv
import re

STEP = re.compile(r"epoch (\d+) batch (\d+): lr")
VALUES = re.compile(r"aam_train::run: ((?:[a-z_]+ [-0-9.e+naif]+(?:, )?)+)$")
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]


def steps(path):
    """[{term: value}] of the training steps of a log, in order."""
    out, previous = [], None
    for line in open(path, encoding="utf-8", errors="replace"):
        line = line.rstrip("\n")
        if STEP.search(line):
            if previous is not None:
                out.append(previous)
            previous = None
            continue
        m = VALUES.search(line)
        previous = (
            {k: float(v) for k, v in (p.split(" ") for p in m.group(1).split(", "))} if m else None
        )
    return out


def smooth(values, window):
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def panel(x0, y0, w, h, term, runs, window):
    series = [(label, smooth([s[term] for s in data if term in s], window)) for label, data in runs]
    ys = [v for _, s in series for v in s]
    if not ys:
        return ""
    lo, hi = min(ys), max(ys)
    hi = hi if hi > lo else lo + 1.0
    n = max(len(s) for _, s in series)
    px = lambda i: x0 + w * i / max(n - 1, 1)
    py = lambda v: y0 + h - h * (v - lo) / (hi - lo)
    parts = [f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#888"/>',
             f'<text x="{x0}" y="{y0 - 6}" font-size="13">{term} (moving mean of {window} steps)</text>']
    for k in range(5):
        v = lo + (hi - lo) * k / 4
        parts.append(f'<text x="{x0 - 6}" y="{py(v) + 4:.1f}" font-size="10" text-anchor="end">{v:.3g}</text>')
    for k in range(5):
        i = round((n - 1) * k / 4)
        parts.append(f'<text x="{px(i):.1f}" y="{y0 + h + 14}" font-size="10" text-anchor="middle">{i}</text>')
    for c, (_, s) in enumerate(series):
        points = " ".join(f"{px(i):.1f},{py(v):.1f}" for i, v in enumerate(s))
        parts.append(f'<polyline fill="none" stroke="{COLOURS[c % 4]}" stroke-width="1.2" points="{points}"/>')
    return "\n".join(parts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="LOG:LABEL")
    ap.add_argument("--out", required=True)
    ap.add_argument("--csv", help="also write every step's values here")
    ap.add_argument("--window", type=int, default=25)
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    runs = [(r.split(":", 1)[1], steps(r.split(":", 1)[0])) for r in a.runs]
    terms = [t for t in ("total_loss", "unifrac_loss", "nuc_loss", "count_loss", "target_loss")
             if any(t in s for _, d in runs for s in d)]
    w, h, left, top, gap = 700, 180, 70, 60, 60
    height = top + len(terms) * (h + gap) + 20
    body = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + w + 30}" height="{height}" '
            f'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>',
            f'<text x="{left}" y="22" font-size="14">{a.title}</text>']
    for c, (label, data) in enumerate(runs):
        body.append(f'<text x="{left + 200 * c}" y="42" font-size="12" fill="{COLOURS[c % 4]}">'
                    f'— {label} ({len(data)} steps)</text>')
    for k, term in enumerate(terms):
        body.append(panel(left, top + k * (h + gap) + 10, w, h, term, runs, a.window))
    body.append(f'<text x="{left + w / 2}" y="{height - 4}" font-size="11" text-anchor="middle">optimiser step</text>')
    body.append("</svg>")
    open(a.out, "w").write("\n".join(body) + "\n")
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["run", "step"] + terms)
            for label, data in runs:
                for i, s in enumerate(data):
                    out.writerow([label, i] + [s.get(t, "") for t in terms])


if __name__ == "__main__":
    main()
