#!/usr/bin/env python3
"""aam-rs rf-baseline beside scikit-learn's RandomForestRegressor, as the
reference's `aam rf-baseline` runs it, on the same table, column and split.

Usage:
  python3 benches/rf_baseline_sklearn.py --aam-rs target/release/aam-rs \
      --table ../shared/data/oral2550/oral_2550.biom \
      --metadata ../shared/data/oral2550/oral_2550_map.txt --column age \
      --out /tmp/rf [--test-size 0.2] [--seed 42] [--n-estimators 500]

Writes <out>/train_samples.txt and val_samples.txt (a seeded split of the
samples with a value), runs both forests (500 trees, max_features sqrt,
seed 42, all cores), prints each one's R², MAE, RMSE and seconds, and exits 1
when aam-rs's MAE is more than 5% above scikit-learn's.
Needs: numpy, h5py, scikit-learn.
"""
import argparse
import os
import subprocess
import sys
import time

import h5py
import numpy as np
from sklearn.ensemble import RandomForestRegressor
from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score


def read_biom(path):
    """Samples x observations dense counts of a BIOM 2.x (HDF5) table."""
    with h5py.File(path, "r") as f:
        samples = [s.decode() for s in f["sample/ids"][:]]
        observations = [o.decode() for o in f["observation/ids"][:]]
        data = f["sample/matrix/data"][:]
        indices = f["sample/matrix/indices"][:]
        indptr = f["sample/matrix/indptr"][:]
    x = np.zeros((len(samples), len(observations)), dtype=np.float32)
    for i in range(len(samples)):
        x[i, indices[indptr[i]:indptr[i + 1]]] = data[indptr[i]:indptr[i + 1]]
    return samples, x


def read_column(path, column):
    with open(path) as f:
        header = f.readline().rstrip("\n").split("\t")
        c = header.index(column)
        values = {}
        for line in f:
            cells = line.rstrip("\n").split("\t")
            try:
                values[cells[0]] = float(cells[c])
            except (ValueError, IndexError):
                pass
    return values


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--aam-rs", required=True)
    p.add_argument("--table", required=True)
    p.add_argument("--metadata", required=True)
    p.add_argument("--column", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--test-size", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--n-estimators", type=int, default=500)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)

    samples, x = read_biom(a.table)
    y_of = read_column(a.metadata, a.column)
    ids = [s for s in samples if s in y_of]
    rng = np.random.default_rng(a.seed)
    order = rng.permutation(len(ids))
    n_val = int(np.ceil(a.test_size * len(ids)))
    val = [ids[i] for i in order[:n_val]]
    train = [ids[i] for i in order[n_val:]]
    for name, lst in (("train_samples.txt", train), ("val_samples.txt", val)):
        with open(os.path.join(a.out, name), "w") as f:
            f.write("\n".join(lst) + "\n")

    # The reference's baseline: raw counts, ASVs with reads in training kept.
    row = {s: i for i, s in enumerate(samples)}
    xt = x[[row[s] for s in train]]
    xv = x[[row[s] for s in val]]
    used = xt.sum(axis=0) > 0
    xt, xv = xt[:, used], xv[:, used]
    yt = np.array([y_of[s] for s in train])
    yv = np.array([y_of[s] for s in val])
    t0 = time.time()
    rf = RandomForestRegressor(n_estimators=a.n_estimators, max_features="sqrt",
                               random_state=a.seed, n_jobs=-1)
    rf.fit(xt, yt)
    pred = rf.predict(xv)
    sk_s = time.time() - t0
    sk = (r2_score(yv, pred), mean_absolute_error(yv, pred),
          np.sqrt(mean_squared_error(yv, pred)))

    t0 = time.time()
    out = subprocess.run(
        [a.aam_rs, "rf-baseline", "--table", a.table, "--metadata", a.metadata,
         "--metadata-column", a.column,
         "--train-samples", os.path.join(a.out, "train_samples.txt"),
         "--val-samples", os.path.join(a.out, "val_samples.txt"),
         "--output", os.path.join(a.out, "rf_predictions.tsv"),
         "--n-estimators", str(a.n_estimators), "--random-seed", str(a.seed)],
        capture_output=True, text=True)
    rs_s = time.time() - t0
    if out.returncode != 0:
        print(out.stderr, file=sys.stderr)
        sys.exit(2)
    got = {}
    with open(os.path.join(a.out, "rf_predictions.tsv")) as f:
        f.readline()
        for line in f:
            s, actual, predicted = line.rstrip("\n").split("\t")
            got[s] = float(predicted)
    pr = np.array([got[s] for s in val])
    rs = (r2_score(yv, pr), mean_absolute_error(yv, pr), np.sqrt(mean_squared_error(yv, pr)))

    print(f"{len(train)} training, {len(val)} validation samples, {xt.shape[1]} ASVs, "
          f"{a.n_estimators} trees, max_features sqrt, {os.cpu_count()} cores")
    print(f"{'':14}{'R2':>8}{'MAE':>8}{'RMSE':>8}{'seconds':>9}")
    print(f"{'scikit-learn':14}{sk[0]:8.3f}{sk[1]:8.3f}{sk[2]:8.3f}{sk_s:9.1f}")
    print(f"{'aam-rs':14}{rs[0]:8.3f}{rs[1]:8.3f}{rs[2]:8.3f}{rs_s:9.1f}")
    ratio = rs[1] / sk[1]
    print(f"MAE ratio aam-rs / scikit-learn: {ratio:.3f} (limit 1.05)")
    sys.exit(0 if ratio <= 1.05 else 1)


if __name__ == "__main__":
    main()
