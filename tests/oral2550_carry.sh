# Sourced by the device scripts that run the carried binary on oral2550 (tests/gradients_device.sh,
# tests/pretrain_norms_device.sh, benches/pretrain_device.sh): unpacks .carry/gpu/$BIN.xz
# (BIN default aam-rs) to /tmp/bin/aam-rs and the xz'd
# table, matrix and (when carried) tree and Faith's PD (`faithpd` on the table and tree) in .carry/oral2550, restores CubeCL's kernel cache and saves it to $OUT on exit
# (benches/kernel_cache.sh), and tunes kernels minimally unless CUBECL_AUTOTUNE_LEVEL says otherwise.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/bin
xz -dc ".carry/gpu/${BIN:-aam-rs}.xz" > /tmp/bin/aam-rs && chmod +x /tmp/bin/aam-rs
for f in oral_2550.biom unifrac.unweighted.h5 tree.fasttree-midpoint.nwk faith_pd.tsv; do
  [ -f ".carry/oral2550/$f" ] || [ ! -f ".carry/oral2550/$f.xz" ] || xz -dc ".carry/oral2550/$f.xz" > ".carry/oral2550/$f"
done
source benches/kernel_cache.sh; restore_kernel_cache; trap save_kernel_cache EXIT
export CUBECL_AUTOTUNE_LEVEL=${CUBECL_AUTOTUNE_LEVEL:-minimal}
