"""How the expected numbers in real_data.rs were computed (biom-format 2.1.18, h5py, numpy, pandas).

Run from ../shared/data:  python <this file>
"""
import biom, numpy as np
files = ["oral2550/oral_2550.biom","halfvarson-ibd1629/table.biom","multiomics10333-16S/16S-table.biom","moving-pictures/table.biom","moving-pictures/table.v100-json.biom",
"fixtures/biom-format/min_sparse_otu_table.biom","fixtures/biom-format/min_sparse_otu_table_hdf5.biom","fixtures/biom-format/rich_sparse_otu_table.biom","fixtures/biom-format/rich_sparse_otu_table_hdf5.biom","fixtures/biom-format/rich_sparse_otu_table_hdf5_group_metadata.biom","fixtures/biom-format/test_data__edgecase_issue_952.biom","fixtures/biom-format/test_data__empty.biom","fixtures/biom-format/test_data__test_grp_metadata.biom","fixtures/crawford/crawford.biom","fixtures/qiime-191-tt/otu-table.biom","fixtures/unifrac-tests/e1.biom","fixtures/unifrac-tests/e2.biom"]
for f in files:
    try:
        t = biom.load_table(f)
    except Exception as e:
        print(f, "ERROR", repr(e)); continue
    s = t.ids(); o = t.ids('observation')
    n_s, n_o = len(s), len(o)
    if n_s == 0:
        print(f, "empty", t.shape); continue
    ss = t.sum('sample'); os_ = t.sum('observation')
    m = t.matrix_data
    print(f"{f}: samples={n_s} obs={n_o} nnz={m.nnz} total={t.sum()!r} first_s={s[0]!r} last_s={s[-1]!r} first_o={o[0]!r} last_o={o[-1]!r}")
    print(f"   sample_sums[0:3]={[float(x) for x in ss[:3]]} sample_sums[-1]={float(ss[-1])!r} obs_sum[0]={float(os_[0])!r} min_depth={ss.min()!r} max_depth={ss.max()!r} median={np.median(ss)!r}")
    nz = (m > 0).sum(axis=0).A1
    print(f"   asvs_per_sample[0:3]={list(nz[:3])} max_len={max(len(x) for x in o)} min_len={min(len(x) for x in o)} nonint={int((m.data != np.round(m.data)).sum())}")
    for d in [1000, 5000, 10000]:
        print(f"   below {d}: {int((ss < d).sum())}", end="")
    print()

import h5py, pandas as pd
def h5m(p):
    f=h5py.File(p,'r'); m=f['matrix'][:]; o=[x.decode() if isinstance(x,bytes) else x for x in f['order'][:]]; return m,o
m,o = h5m('oral2550/unifrac.unweighted.h5')
print('oral uw', m.dtype, m.shape, o[:2], o[-1], repr(float(m[0,1])), repr(float(m[5,100])), repr(float(m[2536,17])), float(m.sum()))
w = np.load('oral2550/unifrac.weighted_normalized.npy'); ids=[l.strip() for l in open('oral2550/unifrac.sample_ids.txt')]
print('oral w', w.dtype, w.shape, ids[:2], repr(float(w[0,1])), repr(float(w[5,100])), ids[5], ids[100])
t = biom.load_table('oral2550/oral_2550.biom')
print('table order == h5 order', list(t.ids())==o, 'npy ids == h5 order', ids==o)
for p in ['moving-pictures/unifrac.unweighted.h5','moving-pictures/unifrac.weighted_normalized.h5']:
    m,o = h5m(p); n=np.load(p.replace('.h5','.npy')); print(p, m.dtype, np.abs(m-n).max(), o[:3], repr(float(m[0,1])))
tt = biom.load_table('moving-pictures/table.biom'); print('mp table order == h5', list(tt.ids())==o)
m,o = h5m('fixtures/qiime-191-tt/unifrac.unweighted.h5'); print('qiime order', o)
d = pd.read_csv('fixtures/qiime-191-tt/unweighted_unifrac_dm.txt', sep='\t', index_col=0)
dd = d.loc[o,o].values; print('qiime uw max diff', np.abs(dd-m).max())
m2,o2 = h5m('fixtures/qiime-191-tt/unifrac.weighted_normalized.h5')
d2 = pd.read_csv('fixtures/qiime-191-tt/weighted_normalized_unifrac_dm.txt', sep='\t', index_col=0)
print('qiime wn max diff', np.abs(d2.loc[o2,o2].values-m2).max(), list(d2.index))
m,o = h5m('fixtures/crawford/unifrac.unweighted.h5'); print('crawford', o, repr(float(m[0,8])))
for p in ['oral2550/oral_2550_map.txt','halfvarson-ibd1629/sample-metadata.tsv','multiomics10333-16S/metadata.tsv','moving-pictures/sample-metadata.tsv']:
    df = pd.read_csv(p, sep='\t', dtype=str, keep_default_na=False)
    print(p, 'rows', len(df), 'cols', len(df.columns), 'first col', repr(df.columns[0]), 'first id', df.iloc[0,0], 'last id', df.iloc[-1,0])
mp = pd.read_csv('oral2550/oral_2550_map.txt', sep='\t')
print('oral age', mp['age'].isna().sum(), mp['age'].min(), mp['age'].max(), repr(mp['age'].mean()), mp.iloc[0].to_dict())
print('oral table samples in map', len(set(t.ids()) & set(mp['#SampleID'])))
hv = pd.read_csv('halfvarson-ibd1629/sample-metadata.tsv', sep='\t')
th = biom.load_table('halfvarson-ibd1629/table.biom')
print('halfvarson table samples in meta', len(set(th.ids()) & set(hv['#SampleID'])), len(hv))
print(hv.columns[:40].tolist())

# metadata details used in real_data.rs
hv = pd.read_csv("halfvarson-ibd1629/sample-metadata.tsv", sep="\t", dtype=str, keep_default_na=False)
def isnum(s):
    try:
        float(s); return True
    except ValueError:
        return False
for c in ["calprotectin", "bmi"]:
    ok = hv[hv[c].map(isnum)]
    print(c, "numeric", len(ok), "sum", ok[c].astype(float).sum(), "non-numeric", hv[~hv[c].map(isnum)][c].value_counts().to_dict())
mo = pd.read_csv("multiomics10333-16S/metadata.tsv", sep="\t", dtype=str, keep_default_na=False)
bad = mo[~mo.temp.map(isnum) & (mo.temp != "")]
print("multiomics temp non-numeric:", [(i + 2, r.sample_name, r.temp) for i, r in bad.iterrows()])
print("elevation sum", mo.elevation.astype(float).sum())
mp = pd.read_csv("moving-pictures/sample-metadata.tsv", sep="\t", skiprows=[1])
print("moving pictures rows", len(mp), "days sum", mp.DaysSinceExperimentStart.sum(), sorted(mp.BodySite.unique()))
