//! The backends compiled into this binary, chosen at run time with `--backend`.
//!
//! Each backend is a cargo feature of this crate (`ndarray`, `candle`, `wgpu`,
//! `cuda`, `rocm`, `tch`); a variant of [`BackendKind`] exists only when its
//! feature is on, so `--backend` offers exactly what was compiled in.
//! [`with_backend!`](crate::with_backend) turns the choice into a type, and
//! [`list`] is `aam-rs backends`: what this binary has and which devices each
//! backend sees, without panicking where a driver or GPU is missing.

use anyhow::{bail, Context, Result};
use clap::ValueEnum;

#[cfg(not(feature = "ndarray"))]
compile_error!(
    "aam-cli needs its `ndarray` feature: `convert` runs on it (add GPU backends next to it)"
);

/// The GPU backends UniFrac runs on (`aam-rs unifrac --gpu`, `pretrain
/// --unifrac-gpu`), each where this binary was built with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum GpuArg {
    /// wgpu (Vulkan, Metal), single precision.
    Wgpu,
    /// CUDA device 0, double precision.
    Cuda,
    /// ROCm/HIP device 0, double precision.
    Rocm,
}

impl GpuArg {
    /// The runtime, once its device is seen; `flag` names the option in the
    /// errors (a backend not compiled in, or without a device here).
    pub fn runtime(self, flag: &str) -> Result<aam_unifrac::Gpu> {
        let value = self.to_possible_value().expect("no skipped variants");
        let name = value.get_name();
        let Ok(kind) = BackendKind::from_str(name, true) else {
            bail!(
                "{flag} {name}: this aam-rs was built without the `{name}` feature \
                 (`aam-rs backends` lists what it has); leave out {flag} for the CPU"
            );
        };
        kind.ensure_available()
            .with_context(|| format!("{flag} {name}"))?;
        match kind {
            #[cfg(feature = "wgpu")]
            BackendKind::Wgpu => Ok(aam_unifrac::Gpu::Wgpu),
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => Ok(aam_unifrac::Gpu::Cuda),
            #[cfg(feature = "rocm")]
            BackendKind::Rocm => Ok(aam_unifrac::Gpu::Rocm),
            #[allow(unreachable_patterns)]
            other => bail!("{flag} {name}: not a GPU backend ({})", other.name()),
        }
    }
}

/// A compute backend (all in float32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Default)]
pub enum BackendKind {
    /// ndarray on the CPU, the default.
    #[cfg(feature = "ndarray")]
    #[default]
    Ndarray,
    /// candle on the CPU (burn-candle is deprecated upstream after burn 0.21).
    #[cfg(feature = "candle")]
    Candle,
    /// wgpu (CubeCL, WGSL kernels): Vulkan on Linux/Windows, Metal on macOS.
    //  `CUBECL_WGPU_DEFAULT_DEVICE` picks another adapter (`DiscreteGpu(1)`, `Cpu`, ...).
    #[cfg(feature = "wgpu")]
    Wgpu,
    /// CUDA (CubeCL), device 0.
    #[cfg(feature = "cuda")]
    Cuda,
    /// ROCm/HIP (CubeCL), device 0.
    #[cfg(feature = "rocm")]
    Rocm,
    /// libtorch on the CPU.
    #[cfg(feature = "tch")]
    Tch,
    /// libtorch on GPU 0 (a CUDA or a ROCm build of libtorch).
    #[cfg(feature = "tch")]
    TchGpu,
}

impl BackendKind {
    /// Every backend compiled into this binary.
    pub fn compiled() -> Vec<BackendKind> {
        BackendKind::value_variants().to_vec()
    }

    /// The `--backend` spelling.
    pub fn name(self) -> String {
        self.to_possible_value()
            .expect("no skipped variants")
            .get_name()
            .to_string()
    }

    /// The cargo feature that builds it in.
    pub fn feature(self) -> &'static str {
        match self {
            #[cfg(feature = "ndarray")]
            BackendKind::Ndarray => "ndarray",
            #[cfg(feature = "candle")]
            BackendKind::Candle => "candle",
            #[cfg(feature = "wgpu")]
            BackendKind::Wgpu => "wgpu",
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => "cuda",
            #[cfg(feature = "rocm")]
            BackendKind::Rocm => "rocm",
            #[cfg(feature = "tch")]
            BackendKind::Tch | BackendKind::TchGpu => "tch",
        }
    }

    /// Whether the backend compiles kernels for each new shape at run time
    /// (CubeCL's: CUDA, ROCm, wgpu).
    pub fn compiles_kernels(self) -> bool {
        match self {
            #[cfg(feature = "wgpu")]
            BackendKind::Wgpu => true,
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => true,
            #[cfg(feature = "rocm")]
            BackendKind::Rocm => true,
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// A line for the log before the first step on a backend that compiles
    /// its kernels at run time (CUDA, ROCm): where the compiled kernels are
    /// kept, and whether this run has to compile them (the first run on a
    /// machine, or of a build with other kernels). `None` on the other backends.
    pub fn kernel_cache_note(self) -> Option<String> {
        let (root, empty) = self.kernel_cache()?;
        Some(if empty {
            format!(
                "compiling this GPU's kernels during the first steps, once; they are kept in {} \
                 (docs/backends.md: one cache for many jobs)",
                root.display()
            )
        } else {
            format!("compiled kernels: {} (reused)", root.display())
        })
    }

    /// Whether this backend compiles its kernels at run time into an on-disk
    /// cache (CUDA, ROCm) that holds none yet; `None` on the other backends.
    pub fn kernel_cache_is_empty(self) -> Option<bool> {
        self.kernel_cache().map(|(_, empty)| empty)
    }

    /// CUDA's and ROCm's kernel cache root, and whether it holds none of this
    /// backend's kernels yet.
    fn kernel_cache(self) -> Option<(std::path::PathBuf, bool)> {
        #[cfg(any(feature = "cuda", feature = "rocm"))]
        {
            let runtime = match self {
                #[cfg(feature = "cuda")]
                BackendKind::Cuda => "cuda",
                #[cfg(feature = "rocm")]
                BackendKind::Rocm => "hip",
                _ => return None,
            };
            let root = aam_kernels::kernel_cache_root();
            let empty = !std::fs::read_dir(root.join(runtime))
                .is_ok_and(|mut entries| entries.next().is_some());
            Some((root, empty))
        }
        #[cfg(not(any(feature = "cuda", feature = "rocm")))]
        {
            let _ = self;
            None
        }
    }

    /// The devices this backend can run on here, or why it cannot run.
    pub fn devices(self) -> Result<Vec<String>> {
        match self {
            #[cfg(feature = "ndarray")]
            BackendKind::Ndarray => Ok(vec![cpu_device()]),
            #[cfg(feature = "candle")]
            BackendKind::Candle => Ok(vec![cpu_device()]),
            #[cfg(feature = "wgpu")]
            BackendKind::Wgpu => wgpu_devices(),
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => cuda_devices(),
            #[cfg(feature = "rocm")]
            BackendKind::Rocm => rocm_devices(),
            #[cfg(feature = "tch")]
            BackendKind::Tch => Ok(vec![format!(
                "cpu (libtorch, {} threads)",
                tch::utils::get_num_threads()
            )]),
            #[cfg(feature = "tch")]
            BackendKind::TchGpu => tch_gpu_devices(),
        }
    }

    /// Bytes of memory of device `index`, where the backend's driver
    /// reports them (CUDA, ROCm); `None` for the CPU, wgpu and libtorch.
    pub fn total_memory(self, index: usize) -> Result<Option<u64>> {
        let _ = index;
        match self {
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => {
                let ctx = cudarc::driver::CudaContext::new(index)
                    .map_err(|e| anyhow::anyhow!("CUDA device {index}: {e:?}"))?;
                let bytes = ctx
                    .total_mem()
                    .map_err(|e| anyhow::anyhow!("CUDA device {index}: {e:?}"))?;
                Ok(Some(bytes as u64))
            }
            #[cfg(feature = "rocm")]
            BackendKind::Rocm => {
                use cubecl_hip_sys as hip;
                let mut bytes = 0usize;
                // SAFETY: the device count was checked before any device was
                // built (`ensure_available`); `bytes` is writable.
                let status = unsafe { hip::hipDeviceTotalMem(&mut bytes, index as i32) };
                if status != hip::hipError_t_hipSuccess {
                    bail!("hipDeviceTotalMem({index}) failed with HIP error {status}");
                }
                Ok(Some(bytes as u64))
            }
            _ => Ok(None),
        }
    }

    /// Fails, naming the cause, where the backend has no device to run on;
    /// [`with_backend!`](crate::with_backend) calls it before anything is
    /// built, so a missing driver is an error message, not a panic.
    pub fn ensure_available(self) -> Result<()> {
        let count = self
            .device_count()
            .with_context(|| format!("backend {} cannot run here", self.name()))?;
        if count == 0 {
            bail!(
                "backend {} sees no device (run `aam-rs backends`)",
                self.name()
            );
        }
        Ok(())
    }

    /// How many devices the backend sees, without opening any.
    fn device_count(self) -> Result<usize> {
        // Naming a CUDA device creates a context on it; counting does not.
        #[cfg(feature = "cuda")]
        if self == BackendKind::Cuda {
            return cuda_count();
        }
        self.devices().map(|d| d.len())
    }
}

/// Runs `$body` with the type alias `$B` bound to the chosen backend and
/// `$device` to its default device. `$body` is an `anyhow::Result`; a backend
/// without a usable device fails with an error before `$body` runs.
///
/// A backend's branch is compiled where the crate that expands the macro has
/// the backend's feature (`ndarray`, `candle`, `wgpu`, `cuda`, `rocm`, `tch`;
/// each must turn on this crate's feature of the same name, as `aam-dev`'s
/// do). So `aam-dev` built with its default features compiles the training
/// step for ndarray alone, even where a workspace build turns on more of this
/// crate's backends; a backend this crate has and the caller lacks is an
/// error naming the feature.
#[macro_export]
macro_rules! with_backend {
    ($kind:expr, |$B:ident, $device:ident| $body:expr) => {{
        let kind: $crate::backend::BackendKind = $kind;
        match kind.ensure_available() {
            Err(err) => Err(err),
            Ok(()) => 'dispatch: {
                #[cfg(feature = "ndarray")]
                if kind == $crate::backend::BackendKind::Ndarray {
                    type $B = $crate::__burn::backend::NdArray<f32>;
                    let $device = $crate::__burn::backend::ndarray::NdArrayDevice::Cpu;
                    break 'dispatch $body;
                }
                #[cfg(feature = "candle")]
                if kind == $crate::backend::BackendKind::Candle {
                    // burn-candle: deprecated upstream after 0.21, kept while it works.
                    #[allow(deprecated)] type $B = $crate::__burn::backend::Candle<f32, i64>;
                    #[allow(deprecated)] let $device = $crate::__burn::backend::candle::CandleDevice::Cpu;
                    break 'dispatch $body;
                }
                #[cfg(feature = "wgpu")]
                if kind == $crate::backend::BackendKind::Wgpu {
                    type $B = $crate::__burn::backend::Wgpu<f32, i32>;
                    let $device = $crate::__burn::backend::wgpu::WgpuDevice::DefaultDevice;
                    break 'dispatch $body;
                }
                #[cfg(feature = "cuda")]
                if kind == $crate::backend::BackendKind::Cuda {
                    type $B = $crate::__burn::backend::Cuda<f32, i32>;
                    let $device = $crate::__burn::backend::cuda::CudaDevice::new(0);
                    break 'dispatch $body;
                }
                #[cfg(feature = "rocm")]
                if kind == $crate::backend::BackendKind::Rocm {
                    type $B = $crate::__burn::backend::Rocm<f32, i32>;
                    let $device = $crate::__burn::backend::rocm::RocmDevice::new(0);
                    break 'dispatch $body;
                }
                #[cfg(feature = "tch")]
                if kind == $crate::backend::BackendKind::Tch {
                    type $B = $crate::__burn::backend::LibTorch<f32>;
                    let $device = $crate::__burn::backend::libtorch::LibTorchDevice::Cpu;
                    break 'dispatch $body;
                }
                #[cfg(feature = "tch")]
                if kind == $crate::backend::BackendKind::TchGpu {
                    type $B = $crate::__burn::backend::LibTorch<f32>;
                    let $device = $crate::__burn::backend::libtorch::LibTorchDevice::Cuda(0);
                    break 'dispatch $body;
                }
                Err($crate::__anyhow!(
                    "backend {} is not built into this program: build it with the cargo feature `{}`",
                    kind.name(),
                    kind.feature()
                ))
            }
        }
    }};
}

/// `aam-rs backends`: one block per compiled backend with the devices it sees.
pub fn list() -> Result<()> {
    for kind in BackendKind::compiled() {
        let help = kind
            .to_possible_value()
            .and_then(|v| v.get_help().map(ToString::to_string))
            .unwrap_or_default();
        println!("{:<9} {help}", kind.name());
        match kind.devices() {
            Ok(devices) if devices.is_empty() => println!("          no device found"),
            Ok(devices) => devices
                .iter()
                .enumerate()
                .for_each(|(i, d)| println!("          [{i}] {d}")),
            Err(err) => println!("          unavailable: {err:#}"),
        }
        if let Some((root, _)) = kind.kernel_cache() {
            println!("          compiled kernels: {}", root.display());
        }
    }
    Ok(())
}

fn cpu_device() -> String {
    let threads = std::thread::available_parallelism()
        .map(usize::from)
        .unwrap_or(1);
    format!("cpu ({threads} hardware threads)")
}

/// The adapters of the graphics API that `WgpuDevice::DefaultDevice` uses.
#[cfg(feature = "wgpu")]
fn wgpu_devices() -> Result<Vec<String>> {
    use burn::backend::wgpu::graphics::{AutoGraphicsApi, GraphicsApi};
    let backend = AutoGraphicsApi::backend();
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: backend.into(),
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let adapters = block_on(instance.enumerate_adapters(backend.into()));
    if adapters.is_empty() {
        bail!(
            "no {backend:?} adapter: install a GPU driver with {backend:?} support \
             (on Linux without a GPU, Mesa's lavapipe: `apt-get install mesa-vulkan-drivers libvulkan1`)"
        );
    }
    Ok(adapters
        .iter()
        .map(|a| {
            let info = a.get_info();
            format!(
                "{} ({:?}, {:?}, driver {} {})",
                info.name, info.backend, info.device_type, info.driver, info.driver_info
            )
        })
        .collect())
}

/// Polls a future that native wgpu resolves without waiting.
#[cfg(feature = "wgpu")]
fn block_on<F: std::future::Future>(future: F) -> F::Output {
    let mut future = std::pin::pin!(future);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    loop {
        if let std::task::Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::yield_now();
    }
}

#[cfg(feature = "cuda")]
fn cuda_count() -> Result<usize> {
    // SAFETY: only tries to dlopen libcuda; no CUDA call is made.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        bail!("no CUDA driver (libcuda.so not found): install the NVIDIA driver");
    }
    let count = cudarc::driver::CudaContext::device_count()
        .map_err(|e| anyhow::anyhow!("CUDA driver: {e:?}"))?;
    Ok(count as usize)
}

#[cfg(feature = "cuda")]
fn cuda_devices() -> Result<Vec<String>> {
    use cudarc::driver::CudaContext;
    (0..cuda_count()?)
        .map(|i| {
            let ctx = CudaContext::new(i).map_err(|e| anyhow::anyhow!("CUDA device {i}: {e:?}"))?;
            let name = ctx
                .name()
                .map_err(|e| anyhow::anyhow!("CUDA device {i}: {e:?}"))?;
            let (major, minor) = ctx
                .compute_capability()
                .map_err(|e| anyhow::anyhow!("CUDA device {i}: {e:?}"))?;
            let mem = ctx
                .total_mem()
                .map_err(|e| anyhow::anyhow!("CUDA device {i}: {e:?}"))?;
            Ok(format!(
                "{name} (sm_{major}{minor}, {:.0} GiB)",
                mem as f64 / (1u64 << 30) as f64
            ))
        })
        .collect()
}

#[cfg(feature = "rocm")]
fn rocm_devices() -> Result<Vec<String>> {
    use cubecl_hip_sys as hip;
    if !hip::is_available() {
        bail!("no HIP runtime (libamdhip64.so / libhiprtc.so not found): install ROCm or set ROCM_PATH");
    }
    let mut count = 0;
    // SAFETY: the HIP libraries are loaded (checked above); `count` is writable.
    let status = unsafe { hip::hipGetDeviceCount(&mut count) };
    if status != hip::hipError_t_hipSuccess {
        bail!("hipGetDeviceCount failed with HIP error {status}");
    }
    (0..count)
        .map(|i| {
            let mut name = [0 as std::os::raw::c_char; 256];
            // SAFETY: `name` holds 256 writable chars and HIP NUL-terminates within `len`.
            let status = unsafe { hip::hipDeviceGetName(name.as_mut_ptr(), name.len() as i32, i) };
            if status != hip::hipError_t_hipSuccess {
                bail!("hipDeviceGetName({i}) failed with HIP error {status}");
            }
            // SAFETY: NUL-terminated by HIP (above).
            Ok(unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
                .to_string_lossy()
                .into_owned())
        })
        .collect()
}

#[cfg(feature = "tch")]
fn tch_gpu_devices() -> Result<Vec<String>> {
    if !tch::Cuda::is_available() {
        bail!("this libtorch sees no GPU (a CPU build of libtorch, or no CUDA/ROCm driver)");
    }
    let flavour = if tch::utils::has_hip() {
        "ROCm"
    } else {
        "CUDA"
    };
    Ok((0..tch::Cuda::device_count())
        .map(|i| format!("cuda:{i} (libtorch {flavour})"))
        .collect())
}

/// A backend's device by its index (`--devices`).
pub trait IndexedDevice: Sized {
    /// Device `index` of backend `kind` (whose device count was checked).
    fn at(kind: BackendKind, index: usize) -> Self;
}

#[cfg(feature = "ndarray")]
impl IndexedDevice for burn::backend::ndarray::NdArrayDevice {
    fn at(_: BackendKind, _: usize) -> Self {
        Self::Cpu
    }
}

#[cfg(feature = "candle")]
#[allow(deprecated)]
impl IndexedDevice for burn::backend::candle::CandleDevice {
    fn at(_: BackendKind, _: usize) -> Self {
        Self::Cpu
    }
}

#[cfg(feature = "wgpu")]
impl IndexedDevice for burn::backend::wgpu::WgpuDevice {
    fn at(_: BackendKind, _: usize) -> Self {
        // One adapter: `--devices 0,0` (replicas on it) is what wgpu runs.
        Self::DefaultDevice
    }
}

#[cfg(feature = "cuda")]
impl IndexedDevice for burn::backend::cuda::CudaDevice {
    fn at(_: BackendKind, index: usize) -> Self {
        Self::new(index)
    }
}

#[cfg(feature = "rocm")]
impl IndexedDevice for burn::backend::rocm::RocmDevice {
    fn at(_: BackendKind, index: usize) -> Self {
        Self::new(index)
    }
}

#[cfg(feature = "tch")]
impl IndexedDevice for burn::backend::libtorch::LibTorchDevice {
    fn at(kind: BackendKind, index: usize) -> Self {
        match kind {
            BackendKind::TchGpu => Self::Cuda(index),
            _ => Self::Cpu,
        }
    }
}

impl BackendKind {
    /// How many devices `--devices` can index: the GPUs a GPU backend sees,
    /// one for the CPU backends and wgpu (which runs on one adapter).
    fn indexable_devices(self) -> Result<usize> {
        match self {
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => self.device_count(),
            #[cfg(feature = "rocm")]
            BackendKind::Rocm => self.device_count(),
            #[cfg(feature = "tch")]
            BackendKind::TchGpu => self.device_count(),
            _ => Ok(1),
        }
    }

    /// The devices of `--devices` (one per replica, in order, of the type
    /// of `_default`), each checked to exist.
    pub fn devices_like<D: IndexedDevice>(
        self,
        _default: &D,
        list: &crate::args::DeviceList,
    ) -> Result<Vec<D>> {
        let count = self.indexable_devices()?;
        let indices = match list {
            crate::args::DeviceList::All => (0..count).collect(),
            crate::args::DeviceList::Indices(i) => i.clone(),
        };
        if indices.is_empty() {
            bail!("--devices names no device");
        }
        for &i in &indices {
            if i >= count {
                let seen = if count == 1 {
                    format!(
                        "the {} backend has one device, 0 (list it several times for several replicas: --devices 0,0)",
                        self.name()
                    )
                } else {
                    format!(
                        "the {} backend sees {count} devices, 0 to {}",
                        self.name(),
                        count - 1
                    )
                };
                bail!("--devices {i}: {seen}");
            }
        }
        Ok(indices.into_iter().map(|i| D::at(self, i)).collect())
    }
}
