"""Make the aam-rs demo dataset: 64 samples of oral2550 (Huang et al. 2020, mSystems).

Run from the repository root, with ../shared/data present:

    pip install biom-format h5py numpy
    python crates/data/demo/make_demo.py

Writes, next to this script:
  demo.biom                        BIOM 2.1 (HDF5) table, 64 samples, only their ASVs
  demo_map.txt                     metadata (#SampleID, qiita_host_age, age)
  unifrac.unweighted.h5            ssu layout (/matrix fp32, /order), rows in SORTED id order
  unifrac.weighted_normalized.npy  fp32, rows in REVERSED table order
  unifrac.sample_ids.txt           the ids of the .npy rows

The matrices are sub-matrices of the ssu matrices in ../shared/data/oral2550, deliberately
stored in an order different from the table's, so that every use of the demo exercises
matching by sample ID.
"""

import os

import biom
import h5py
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "..", "..", "..", "shared", "data", "oral2550")
N_SAMPLES = 64
SEED = 2550


def main():
    table = biom.load_table(os.path.join(SRC, "oral_2550.biom"))
    all_ids = list(table.ids())
    rng = np.random.default_rng(SEED)
    picked = sorted(rng.choice(len(all_ids), size=N_SAMPLES, replace=False))
    ids = [all_ids[i] for i in picked]  # table order

    sub = table.filter(ids, axis="sample", inplace=False)
    sub = sub.filter(lambda v, i, m: v.sum() > 0, axis="observation", inplace=False)
    sub = sub.sort_order(ids, axis="sample")
    sub.del_metadata(axis="observation")
    with h5py.File(os.path.join(HERE, "demo.biom"), "w") as f:
        sub.to_hdf5(f, "aam-rs crates/data/demo/make_demo.py", compress=True)

    with open(os.path.join(SRC, "oral_2550_map.txt")) as f:
        header = f.readline()
        rows = {line.split("\t", 1)[0]: line for line in f}
    with open(os.path.join(HERE, "demo_map.txt"), "w") as f:
        f.write(header)
        for sid in ids:
            f.write(rows[sid])

    with h5py.File(os.path.join(SRC, "unifrac.unweighted.h5"), "r") as f:
        full = f["matrix"][:]
        order = [o.decode() if isinstance(o, bytes) else o for o in f["order"][:]]
    pos = {sid: i for i, sid in enumerate(order)}
    sorted_ids = sorted(ids)
    idx = [pos[s] for s in sorted_ids]
    with h5py.File(os.path.join(HERE, "unifrac.unweighted.h5"), "w") as f:
        f.create_dataset("matrix", data=full[np.ix_(idx, idx)].astype(np.float32))
        f.create_dataset("order", data=sorted_ids, dtype=h5py.string_dtype())

    weighted = np.load(os.path.join(SRC, "unifrac.weighted_normalized.npy"))
    with open(os.path.join(SRC, "unifrac.sample_ids.txt")) as f:
        w_order = [line.strip() for line in f if line.strip()]
    w_pos = {sid: i for i, sid in enumerate(w_order)}
    reversed_ids = ids[::-1]
    idx = [w_pos[s] for s in reversed_ids]
    np.save(os.path.join(HERE, "unifrac.weighted_normalized.npy"), weighted[np.ix_(idx, idx)].astype(np.float32))
    with open(os.path.join(HERE, "unifrac.sample_ids.txt"), "w") as f:
        f.write("\n".join(reversed_ids) + "\n")

    print(f"{len(ids)} samples, {sub.shape[0]} ASVs, {int(sub.sum())} reads")


if __name__ == "__main__":
    main()
