#!/usr/bin/env python3
"""The data-pipeline steps of a reference `aam pretrain` run, in Python.

Load the BIOM table (biom-format), the `ssu` UniFrac matrix (h5py), rarefy
(`Table.subsample`, as the reference's BIOMLoader), tokenise every ASV (the
reference's SequenceTokenizer and sequence cache), then one training epoch of
batches as its ASVDataset + collate_fn build them: shuffled, last partial batch
dropped, tokens padded to [B, token_limit, max_bp + 1], counts [B, token_limit, 1],
and the [B, B] UniFrac block in batch order. numpy stands in for torch tensors.

Two variants of the per-sample step:
  reference  as ASVDataset.__getitem__ does it (list.index of the sample, a
             column of the CSR matrix densified, a Python loop over its ASVs);
  tuned      the same result from a CSC copy made once, with numpy gathers:
             the fairest fast Python baseline we could write.

Prints one JSON line per repetition and variant, with the same checksums as
benches/src/data_pipeline.rs (samples, ASVs, batches, filled ASV slots, counts).
Run by benches/data_pipeline.sh.
"""
import argparse
import json
import time

import biom
import h5py
import numpy as np

START, LUT = 5, {"A": 1, "C": 2, "G": 3, "T": 4}


def tokenize(seq):
    # SequenceTokenizer.tokenize: START, then A/C/G/T -> 1-4, anything else 0.
    return [START] + [LUT.get(c, 0) for c in seq.upper()]


def load_matrix(path, sample_ids):
    with h5py.File(path, "r") as f:
        m = f["matrix"][()]
        order = [o.decode() if isinstance(o, bytes) else str(o) for o in f["order"][()]]
    pos = {s: i for i, s in enumerate(order)}
    missing = [s for s in sample_ids if s not in pos]
    if missing:
        raise ValueError(f"{len(missing)} samples missing from the matrix: {missing[:5]}")
    idx = np.array([pos[s] for s in sample_ids])
    m = m[np.ix_(idx, idx)]
    # What scikit-bio's DistanceMatrix checks for the reference.
    if m.shape[0] != m.shape[1] or not np.isfinite(m).all():
        raise ValueError("matrix not square or not finite")
    if not np.allclose(m, m.T) or np.any(np.diag(m) != 0):
        raise ValueError("matrix not symmetric and hollow")
    return m


def run(a, variant, rep):
    t0 = time.perf_counter()
    t = time.perf_counter()
    table = biom.load_table(a.table)
    load_table = time.perf_counter() - t

    t = time.perf_counter()
    raw_ids = list(table.ids(axis="sample"))
    rarefied = table.subsample(a.depth, axis="sample", by_id=False, with_replacement=False, seed=a.seed)
    rarefy = time.perf_counter() - t
    sample_ids = list(rarefied.ids(axis="sample"))

    t = time.perf_counter()
    matrix = load_matrix(a.matrix, sample_ids)
    load_matrix_s = time.perf_counter() - t

    t = time.perf_counter()
    sequences = list(rarefied.ids(axis="observation"))
    length = a.max_bp + 1
    cache = np.zeros((len(sequences), length), dtype=np.int64)
    for i, seq in enumerate(sequences):
        tok = tokenize(seq)[:length]
        cache[i, : len(tok)] = tok
    tokenise = time.perf_counter() - t

    t = time.perf_counter()
    rng = np.random.default_rng(a.seed)
    order = rng.permutation(len(sample_ids))
    n_batches = len(order) // a.batch  # drop_last=True
    data = rarefied.matrix_data  # scipy sparse, observations x samples
    csc = data.tocsc() if variant == "tuned" else None
    batches = filled = 0
    count_sum = unifrac_sum = 0.0
    for b in range(n_batches):
        members = order[b * a.batch : (b + 1) * a.batch]
        tokens = np.zeros((a.batch, a.token_limit, length), dtype=np.int64)
        counts = np.zeros((a.batch, a.token_limit, 1), dtype=np.float32)
        for k, s in enumerate(members):
            if variant == "reference":
                sid = sample_ids[s]
                col = list(rarefied.ids(axis="sample")).index(sid)
                column = data[:, col].toarray().flatten()
                asv = np.where(column > 0)[0]
                rows = np.stack([cache[i] for i in asv])
                c = np.array([column[i] for i in asv], dtype=np.float32)
            else:
                lo, hi = csc.indptr[s], csc.indptr[s + 1]
                asv, c = csc.indices[lo:hi], csc.data[lo:hi].astype(np.float32)
                keep = c > 0
                asv, c = asv[keep], c[keep]
                order_in_table = np.argsort(asv, kind="stable")
                asv, c = asv[order_in_table], c[order_in_table]
                rows = cache[asv]
            n = min(len(asv), a.token_limit)  # asv_sampling "first"
            tokens[k, :n] = rows[:n]
            counts[k, :n, 0] = c[:n]
        block = matrix[np.ix_(members, members)].astype(np.float32)
        if not np.isfinite(block).all():
            raise ValueError("non-finite distances in a batch")
        batches += 1
        filled += int(np.count_nonzero(tokens[:, :, 0]))  # START opens every filled slot
        count_sum += float(counts.sum(dtype=np.float64))
        unifrac_sum += float(block.sum(dtype=np.float64))
    batch_epoch = time.perf_counter() - t
    print(json.dumps({
        "impl": f"python-{variant}", "rep": rep, "samples": len(sample_ids),
        "asvs": len(sequences), "dropped_by_rarefaction": len(raw_ids) - len(sample_ids),
        "batches": batches, "filled_slots": filled, "count_sum": count_sum,
        "unifrac_sum": unifrac_sum, "load_table_s": load_table, "load_matrix_s": load_matrix_s,
        "rarefy_s": rarefy, "tokenise_s": tokenise, "batch_epoch_s": batch_epoch,
        "total_s": time.perf_counter() - t0,
        "biom_format": biom.__version__, "numpy": np.__version__,
    }), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("table")
    p.add_argument("matrix")
    p.add_argument("--depth", type=int, default=1000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--token-limit", type=int, default=1024)
    p.add_argument("--max-bp", type=int, default=150)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--variants", default="reference,tuned")
    a = p.parse_args()
    for rep in range(a.reps):
        for variant in a.variants.split(","):
            run(a, variant, rep)


if __name__ == "__main__":
    main()
