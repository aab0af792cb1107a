//! What a backend's runtime offers besides ops ([`RuntimeOps`]): whether
//! chains of element-wise ops fuse, the memory pool's figures, sums across
//! devices and across processes (NCCL on CUDA, `collective.rs`); and the on-disk cache of
//! compiled kernels.

use burn::prelude::*;
use burn::tensor::ops::FloatTensor;
#[cfg(feature = "cuda")]
mod collective;

mod autodiff;
#[cfg(feature = "cubecl")]
mod cube;
#[cfg(feature = "fusion")]
mod fusion;

/// What a backend's runtime offers besides ops: fusion of element-wise ops,
/// the memory pool's figures, collectives across devices.
pub trait RuntimeOps: Backend {
    /// Whether chains of element-wise ops become one kernel here (Burn's
    /// fusion backend). Code that could batch small tensors into one large
    /// one for fewer launches (the optimiser) need not there: the chain on
    /// each small tensor is already one kernel, and the concatenation itself
    /// would cost a copy per tensor.
    fn fuses_elementwise() -> bool {
        false
    }

    /// Bytes the backend's memory pool holds on `device`, where it reports
    /// them (the CubeCL backends); `None` elsewhere. Diagnostics read it before
    /// and after an operation to see how much the pool had to grow for it.
    fn memory_reserved(device: &Self::Device) -> Option<u64> {
        let _ = device;
        None
    }

    /// Bytes of live tensors in the memory pool on `device`, where the backend
    /// reports them (the CubeCL backends); `None` elsewhere.
    fn memory_in_use(device: &Self::Device) -> Option<u64> {
        let _ = device;
        None
    }

    /// Whether [`RuntimeOps::collective_sum`] sums on the devices here
    /// (CUDA's CubeCL runtime).
    fn has_collectives() -> bool {
        false
    }

    /// Sums each of `tensors` over `devices` with the runtime's collective
    /// library (NCCL on CUDA): every device's thread calls it with tensors of
    /// the same shapes, in the same order, and gets the sums on its own
    /// device, ready to use. `None` where the runtime has no collectives or
    /// the devices repeat; the caller then sums through the host.
    fn collective_sum(
        tensors: Vec<FloatTensor<Self>>,
        devices: &[Self::Device],
    ) -> Option<Vec<FloatTensor<Self>>> {
        let _ = (tensors, devices);
        None
    }

    /// A new id for a process group (NCCL's unique id, 128 bytes), where the
    /// runtime has collectives across processes (CUDA): rank 0 of a
    /// multi-process run makes it and hands it to the other ranks.
    fn process_group_id() -> Option<Result<[u8; 128], String>> {
        None
    }

    /// Makes the replica on `device` rank `rank` of the `ranks` replicas of
    /// process group `id` (ranks in other processes, on other nodes).
    /// Returns `false` where the runtime has no such collectives. The
    /// communicator forms at the group's first sum, which waits until every
    /// rank has come. One replica per device in each process.
    fn join_process_group(device: &Self::Device, id: [u8; 128], rank: usize, ranks: usize) -> bool {
        let _ = (device, id, rank, ranks);
        false
    }

    /// Sums each of `tensors` (on `device`) over the ranks of the process
    /// group that `device`'s replica joined ([`RuntimeOps::join_process_group`]),
    /// like [`RuntimeOps::collective_sum`]: every rank calls with tensors of
    /// the same shapes, in the same order. `None` where there is no group.
    fn process_group_sum(
        tensors: Vec<FloatTensor<Self>>,
        device: &Self::Device,
    ) -> Option<Vec<FloatTensor<Self>>> {
        let _ = (tensors, device);
        None
    }
}

/// Keeps compiled CUDA/HIP kernels on disk between runs.
///
/// CubeCL JIT-compiles every kernel of a training step the first time it
/// runs; on CUDA that took ~6 minutes for the default model's step on an
/// H100, every run. CubeCL can keep the compiled code, but only when its
/// configuration asks for it; this asks, with the autotune results, in a
/// folder of this build's own, [`KERNELS_BUILD`], below CubeCL's cache
/// root (`target/` of the enclosing Cargo workspace, else the user cache
/// directory's `cubecl/`): CubeCL finds a kernel on disk by its type name
/// and compile-time arguments, not its code, so builds whose kernels differ
/// must not share one. A `cubecl.toml` that sets `[compilation] cache`
/// wins (and then the folder is the user's to keep apart). Call it once,
/// before the first device is used; later calls, or calls after CubeCL read
/// its configuration, change nothing.
#[cfg(feature = "cubecl")]
pub fn persist_compiled_kernels() {
    use cubecl::config::cache::CacheConfig;
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
        if config.compilation.cache.is_none() {
            let folder = format!("aam-kernels-{KERNELS_BUILD}");
            let build = CacheConfig::File(config.autotune.cache.root().join(folder));
            config.compilation.cache = Some(build.clone());
            config.autotune.cache = build;
        }
        // Once CubeCL has loaded its configuration it cannot change (`set`
        // would panic); the run then goes on without the cache.
        let loaded = CubeClRuntimeConfig::storage().lock().is_some();
        if !loaded {
            CubeClRuntimeConfig::set(config);
        }
    });
}

/// This build's kernels' name: a hash of the source of the workspace's
/// kernel-defining crates, of the patched CubeCL CUDA runtime, of this
/// crate's manifest and version, and (where the workspace's lock file was
/// at hand) of the CubeCL, CubeK and Burn versions (`build.rs`).
pub const KERNELS_BUILD: &str = env!("AAM_KERNELS_BUILD");

/// Where CubeCL keeps compiled kernels and autotune results for this
/// process (after [`persist_compiled_kernels`]): the root that holds
/// `cuda/`, `hip/` and `autotune/`.
#[cfg(feature = "cubecl")]
pub fn kernel_cache_root() -> std::path::PathBuf {
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
    let config = CubeClRuntimeConfig::get();
    config
        .compilation
        .cache
        .as_ref()
        .unwrap_or(&config.autotune.cache)
        .root()
}
