# Sourced by the device scripts: CubeCL's on-disk caches (compiled kernels and autotune
# results, under target/) carried between runs on a GPU machine. A run's compiled kernels can
# pass 16 MiB, the most one returned file may hold, so the cache travels xz-compressed in 15 MiB
# parts: $OUT/cache.txz.00, .01, ... Put them in .carry/gpu/cache/ and carry that folder.
# COLD=1 starts from an empty cache and keeps nothing (a first run on a fresh node).
# Each build of the kernels has its own folder (target/aam-kernels-<build>/), and all of target/
# travels: delete the folders of builds no longer compared from .carry/gpu/cache's archive (or
# start COLD) before it grows past what a call may carry.
restore_kernel_cache() {
  [ "${COLD:-0}" = 1 ] && { rm -rf target/aam-kernels-* target/autotune target/cuda target/hip; return 0; }
  if compgen -G ".carry/gpu/cache/cache.txz.*" >/dev/null; then
    cat .carry/gpu/cache/cache.txz.* | xz -dc | tar xf -
  elif [ -f .carry/gpu/cache.tgz ]; then
    tar xzf .carry/gpu/cache.tgz
  fi
}
save_kernel_cache() {
  [ "${COLD:-0}" = 1 ] && return 0
  [ -d target ] || return 0
  tar cf - target | xz -T0 -6 | split -d -b 15M - "$OUT/cache.txz."
}
