//! UniFrac on a GPU, through CubeCL (CUDA, ROCm, wgpu): the same kernels on
//! every runtime, tested on Mesa's lavapipe in CI.
//!
//! **Dense pairs instead of sparse stripes.** The CPU path ([`crate::striped`])
//! saves work by skipping pairs where one sample has no reads below a chunk
//! of branches. A GPU is faster doing the dense sum for every pair and every
//! branch than following that sparsity: the samples' rows are laid out
//! branch-major (`rows[e·N + s]`), and one cube sums a 64×64 tile of pairs
//! over every branch, staging 16 branches of its 64 + 64 samples in shared
//! memory and keeping a 4×4 block of pairs per unit in registers (the
//! layout of a matrix product, with `|a − b|` in place of `a·b`). Only tiles
//! on or above the diagonal run, so each pair is summed once, as a stripe
//! holds it on the CPU.
//!
//! **One sum serves three methods.** With rows scaled by branch length,
//! `Σ |a − b|` is Σ L|u − v| for proportions u, v (weighted, the numerator
//! of both weighted methods, normalised by Σ L(u + v), which is a sum per
//! sample), and for presence (a = L where a sample has reads, else 0) it is
//! the length present in one sample only: unweighted UniFrac's numerator,
//! whose denominator is (A_k + A_l + that)/2, A the sample's total present
//! length. Generalized UniFrac needs the lengths apart and (u + v)^α, so it
//! has its own two accumulators.
//!
//! **Branches in batches, sent sparse.** The host walks the tree once and
//! sends a batch of branches (about 32 MiB of rows on the device) as its
//! nonzero values and their positions; on the device one kernel zeroes the
//! batch's rows and another scatters the values into them, and the sum runs
//! while the host builds the next batch. A branch holds the samples with
//! reads below it only (on oral2550, 6% of its 2,537 samples on the mean
//! branch), so this sends several times fewer bytes than the dense rows and
//! spares the host writing their zeros: at 20,000 samples the dense rows
//! were 1.8 GB, and sending them took longer than summing them. The accumulators stay on the
//! device. A last kernel turns them into the symmetric N×N matrix, read back
//! in pieces of 32 MiB (CubeCL stages transfers in pinned host memory, which
//! is reused at that size and costly to pin anew by the gigabyte).
//!
//! **Precision.** CUDA and ROCm compute in double precision (on an H200
//! within 6.5e-15 of `ssu`, every method); wgpu has no double precision in WGSL and computes in single
//! (within 1e-5 of `ssu`'s fp32 output). Memory on the device: the
//! accumulators and the matrix, 2·N² values (3·N² for generalized and
//! variance adjusted), plus one batch of rows.
//!
//! **Variance adjusted** (Chang et al. 2011): each pair's term on a branch is
//! divided by √(m·(M − m)), m the pair's reads below it and M its reads in
//! all, which no per-sample scaling can fold in: the rows hold the raw
//! counts, each unit keeps its samples' depths in registers, and the kernel
//! forms the proportions, the weight and both sums (numerator and
//! denominator, as [`crate::striped`] does) per pair and branch.

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::error::{Error, Result};
use crate::on_tree::OnTree;
use crate::{Gpu, Method};

/// Samples per side of a cube's tile of pairs.
const TILE: usize = 64;
/// Units per side of a cube (each sums `TILE / SIDE` squared pairs).
const SIDE: usize = 16;
/// Pairs per unit and side.
const PER: usize = TILE / SIDE;
/// Branches staged in shared memory at a time.
const STEP: usize = 16;
/// Bytes of rows per batch of branches on the device, and of the matrix per
/// read: CubeCL stages each transfer in pinned host memory, and pinning
/// gigabytes at once costs more than the copy.
const BATCH_BYTES: usize = 32 << 20;
/// Units per cube of the element-wise kernels.
const UNITS: u32 = 256;

/// Zeroes `rows` (a batch's dense rows, before [`scatter`]).
///
/// Launch: one unit per value, `len` values.
#[cube(launch_unchecked)]
fn zero<F: Float>(rows: &mut Array<F>, len: usize) {
    let at = ABSOLUTE_POS;
    if at < len {
        rows[at] = F::new(0.0);
    }
}

/// Writes a batch's nonzero values into its zeroed rows:
/// `rows[positions[k]] = values[k]` (position `e·n_pad + s` for branch `e`
/// of the batch and sample `s`).
///
/// Launch: one unit per value, `len` values.
#[cube(launch_unchecked)]
fn scatter<F: Float>(positions: &Array<u32>, values: &Array<F>, rows: &mut Array<F>, len: usize) {
    let at = ABSOLUTE_POS;
    if at < len {
        let position = positions[at] as usize;
        rows[position] = values[at];
    }
}

/// The sum of one batch of branches into the pair accumulators `num` (and
/// `tot`), tiles on or above the diagonal (see the module doc).
///
/// Launch: cube (x, y) = tile column and row, `SIDE × SIDE` units; `rows` is
/// `branches × n_pad`, `branches` a multiple of `STEP` (padding rows zero),
/// `n_pad` a multiple of `TILE`. With `vaw` (variance adjusted) the rows
/// are counts, `depths` the samples' reads (`n_pad`, padding zero), and
/// `presence` picks unweighted UniFrac's terms.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn pair_sums<F: Float>(
    rows: &Array<F>,
    lengths: &Array<F>,
    depths: &Array<F>,
    num: &mut Array<F>,
    tot: &mut Array<F>,
    branches: usize,
    n_pad: usize,
    alpha: &Array<F>,
    #[comptime] generalized: bool,
    #[comptime] vaw: bool,
    #[comptime] presence: bool,
    #[comptime] first: bool,
) {
    // Two accumulators and the lengths apart: generalized or variance adjusted.
    let two = comptime!(generalized || vaw);
    let bj = CUBE_POS_X as usize;
    let bi = CUBE_POS_Y as usize;
    if bi > bj {
        terminate!();
    }
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let unit = ty * SIDE + tx;
    let i0 = bi * TILE;
    let j0 = bj * TILE;
    let mut sa = SharedMemory::<F>::new(STEP * TILE);
    let mut sb = SharedMemory::<F>::new(STEP * TILE);
    let mut sl = SharedMemory::<F>::new(STEP);
    let mut acc = Array::<F>::new(PER * PER);
    let mut acc2 = Array::<F>::new(PER * PER);
    #[unroll]
    for p in 0..PER * PER {
        acc[p] = F::new(0.0);
        acc2[p] = F::new(0.0);
    }
    let mut a = Array::<F>::new(PER);
    let mut b = Array::<F>::new(PER);
    // Variance adjusted: the samples' depths, and this branch's proportions.
    let mut da = Array::<F>::new(PER);
    let mut db = Array::<F>::new(PER);
    let mut pa = Array::<F>::new(PER);
    let mut pb = Array::<F>::new(PER);
    if vaw {
        #[unroll]
        for r in 0..PER {
            da[r] = depths[i0 + ty + r * SIDE];
            db[r] = depths[j0 + tx + r * SIDE];
        }
    }
    let zero = F::new(0.0);
    let mut e0 = 0usize;
    while e0 < branches {
        #[unroll]
        for q in 0..STEP * TILE / (SIDE * SIDE) {
            let at = unit + q * SIDE * SIDE;
            let e = at / TILE;
            let s = at % TILE;
            let row = (e0 + e) * n_pad;
            sa[at] = rows[row + i0 + s];
            sb[at] = rows[row + j0 + s];
        }
        if two && unit < STEP {
            sl[unit] = lengths[e0 + unit];
        }
        sync_cube();
        // Unrolled for the sums of differences; not with 16 inlined powers
        // (or square roots) a branch, whose code would not fit the
        // instruction cache.
        #[unroll(!two)]
        for e in 0..STEP {
            #[unroll]
            for r in 0..PER {
                a[r] = sa[e * TILE + ty + r * SIDE];
                b[r] = sb[e * TILE + tx + r * SIDE];
            }
            if vaw {
                // As `striped::Vaw::pair`, term by term; the proportions
                // once per sample, not per pair.
                let length = sl[e];
                if !presence {
                    #[unroll]
                    for r in 0..PER {
                        pa[r] = a[r] / da[r];
                        pb[r] = b[r] / db[r];
                    }
                }
                #[unroll]
                for r in 0..PER {
                    #[unroll]
                    for c in 0..PER {
                        let reads = a[r] + b[c];
                        let weight = F::sqrt(reads * (da[r] + db[c] - reads));
                        if weight > zero {
                            if presence {
                                let lv = length / weight;
                                if (a[r] > zero && b[c] <= zero) || (a[r] <= zero && b[c] > zero) {
                                    acc[r * PER + c] += lv;
                                }
                                acc2[r * PER + c] += lv;
                            } else {
                                let u = pa[r];
                                let v = pb[c];
                                if generalized {
                                    let sum = (u + v) / weight;
                                    let sub = F::abs(u - v) / weight;
                                    let p = F::powf(sum, alpha[0]) * length;
                                    acc[r * PER + c] += p * (sub / sum);
                                    acc2[r * PER + c] += p;
                                } else {
                                    acc[r * PER + c] += (F::abs(u - v) * length) / weight;
                                    acc2[r * PER + c] += ((u + v) * length) / weight;
                                }
                            }
                        }
                    }
                }
            } else if generalized {
                let length = sl[e];
                let alpha = alpha[0];
                #[unroll]
                for r in 0..PER {
                    #[unroll]
                    for c in 0..PER {
                        let sum = a[r] + b[c];
                        if sum > F::new(0.0) {
                            let weight = F::powf(sum, alpha) * length;
                            acc[r * PER + c] += weight * (F::abs(a[r] - b[c]) / sum);
                            acc2[r * PER + c] += weight;
                        }
                    }
                }
            } else {
                #[unroll]
                for r in 0..PER {
                    #[unroll]
                    for c in 0..PER {
                        acc[r * PER + c] += F::abs(a[r] - b[c]);
                    }
                }
            }
        }
        sync_cube();
        e0 += STEP;
    }
    #[unroll]
    for r in 0..PER {
        #[unroll]
        for c in 0..PER {
            let at = (i0 + ty + r * SIDE) * n_pad + j0 + tx + c * SIDE;
            if first {
                num[at] = acc[r * PER + c];
                if two {
                    tot[at] = acc2[r * PER + c];
                }
            } else {
                num[at] += acc[r * PER + c];
                if two {
                    tot[at] += acc2[r * PER + c];
                }
            }
        }
    }
}

/// The N×N matrix from the accumulators (pair (i, j), i < j, at `i·n_pad + j`)
/// and the per-sample sums `own` (see the module doc). `method`: 0
/// unweighted, 1 weighted normalized, 2 weighted unnormalized (and any
/// variance-adjusted method not normalised), 3 `num / tot` (generalized,
/// and every normalised variance-adjusted method).
///
/// Launch: one unit per output value, `matrix` of `n × n`.
#[cube(launch_unchecked)]
fn finish<F: Float>(
    num: &Array<F>,
    tot: &Array<F>,
    own: &Array<F>,
    matrix: &mut Array<F>,
    n: usize,
    n_pad: usize,
    #[comptime] method: u32,
) {
    let at = ABSOLUTE_POS;
    if at >= n * n {
        terminate!();
    }
    let i = at / n;
    let j = at % n;
    let mut d = F::new(0.0);
    if i != j {
        let pair = select(i < j, i * n_pad + j, j * n_pad + i);
        let x = num[pair];
        if comptime!(method == 0) {
            d = x / ((own[i] + own[j] + x) * F::new(0.5));
        } else if comptime!(method == 1) {
            d = x / (own[i] + own[j]);
        } else if comptime!(method == 2) {
            d = x;
        } else {
            d = x / tot[pair];
        }
    }
    matrix[at] = d;
}

/// The N×N matrix (row-major) of `method` over the table on the tree, on
/// `gpu`. CubeCL panics where a runtime finds no device or runs out of
/// memory; that becomes an error here, with its message.
pub(crate) fn distances(
    on: &OnTree,
    method: Method,
    vaw: bool,
    gpu: Gpu,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<f64>> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        on_runtime(on, method, vaw, gpu, progress)
    }))
    .unwrap_or_else(|panic| {
        let message = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("no message");
        Err(Error::Gpu(format!("{gpu:?} failed: {message}")))
    })
}

fn on_runtime(
    on: &OnTree,
    method: Method,
    vaw: bool,
    gpu: Gpu,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<f64>> {
    match gpu {
        #[cfg(feature = "wgpu")]
        Gpu::Wgpu => run::<cubecl::wgpu::WgpuRuntime, f32>(
            on,
            method,
            vaw,
            &cubecl::wgpu::WgpuDevice::DefaultDevice,
            BATCH_BYTES,
            progress,
        ),
        #[cfg(feature = "cuda")]
        Gpu::Cuda => run::<cubecl::cuda::CudaRuntime, f64>(
            on,
            method,
            vaw,
            &cubecl::cuda::CudaDevice::new(0),
            BATCH_BYTES,
            progress,
        ),
        #[cfg(feature = "rocm")]
        Gpu::Rocm => run::<cubecl::hip::HipRuntime, f64>(
            on,
            method,
            vaw,
            &cubecl::hip::AmdDevice::new(0),
            BATCH_BYTES,
            progress,
        ),
    }
}

/// What a row of the batch holds for a sample with `count` reads of
/// `total` below a branch of `length` (variance adjusted: the count).
fn value(method: Method, vaw: bool, count: f64, total: f64, length: f64) -> f64 {
    if vaw {
        return count;
    }
    match method {
        Method::Unweighted => length,
        Method::WeightedNormalized | Method::WeightedUnnormalized => count / total * length,
        Method::Generalized { .. } => count / total,
    }
}

fn run<R: Runtime, F: Float + CubeElement + num_traits::Float>(
    on: &OnTree,
    method: Method,
    vaw: bool,
    device: &R::Device,
    batch_bytes: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<f64>> {
    let n = on.n_samples();
    let n_pad = n.div_ceil(TILE).max(1) * TILE;
    let size = std::mem::size_of::<F>();
    let generalized = matches!(method, Method::Generalized { .. });
    let two = generalized || vaw;
    let alpha = match method {
        Method::Generalized { alpha } => alpha,
        _ => 1.0,
    };
    let cast = |x: f64| <F as num_traits::NumCast>::from(x).expect("a finite value");
    let client = R::client(device);
    let limit = client.properties().memory.max_page_size as usize;
    let buffer = n_pad * n_pad * size;
    if buffer > limit {
        return Err(Error::Gpu(format!(
            "{n} samples need buffers of {:.1} GiB on the GPU, over its limit of {:.1} GiB \
             per buffer: use the CPU (without --gpu)",
            buffer as f64 / (1u64 << 30) as f64,
            limit as f64 / (1u64 << 30) as f64
        )));
    }
    let batch = (batch_bytes / (n_pad * size))
        .min(limit / (n_pad * size))
        .max(STEP)
        / STEP
        * STEP;
    // Written by the first batch (every pair on or above the diagonal's
    // tiles, the only ones read), added to by the next.
    let num = client.empty(n_pad * n_pad * size);
    let tot_len = if two { n_pad * n_pad } else { 1 };
    let tot = client.empty(tot_len * size);
    let mut first = true;
    let alpha_h = client.create_from_slice(F::as_bytes(&[cast(alpha)]));
    let depths: Vec<F> = (0..n_pad)
        .map(|s| cast(if vaw && s < n { on.totals[s] } else { 0.0 }))
        .collect();
    let depths_h = client.create_from_slice(F::as_bytes(&depths));
    let tiles = (n_pad / TILE) as u32;
    let total_branches = on.n_nodes().saturating_sub(1);
    let mut own = vec![0.0f64; n];
    // A batch's nonzero values and their positions in its rows.
    let mut values: Vec<F> = Vec::new();
    let mut positions: Vec<u32> = Vec::new();
    let mut lengths: Vec<F> = Vec::new();
    // The batch's dense rows on the device, rewritten by every batch (the
    // kernels run in order on one stream).
    let rows_len = batch * n_pad;
    let rows_h = client.empty(rows_len * size);
    let (zero_x, zero_y) = split(
        rows_len.div_ceil(UNITS as usize),
        R::max_cube_count().0 as usize,
    );
    let mut done = 0usize;
    let mut sent = 0usize;
    let start = std::time::Instant::now();
    let mut sending = std::time::Duration::ZERO;
    let mut launch = |values: &mut Vec<F>, positions: &mut Vec<u32>, lengths: &mut Vec<F>| {
        let begin = std::time::Instant::now();
        // The first launch runs even without branches: it writes the zeros.
        if lengths.is_empty() && !first {
            return;
        }
        let branches = lengths.len().div_ceil(STEP).max(1) * STEP;
        lengths.resize(branches, cast(0.0));
        let lengths_h = client.create_from_slice(F::as_bytes(lengths));
        // SAFETY: every length is that of its buffer; positions lie within
        // the rows (branch < batch, sample < n_pad).
        unsafe {
            zero::launch_unchecked::<F, R>(
                &client,
                CubeCount::Static(zero_x, zero_y, 1),
                CubeDim::new_1d(UNITS),
                ArrayArg::from_raw_parts(rows_h.clone(), rows_len),
                rows_len,
            );
            if !values.is_empty() {
                let nonzero = values.len();
                let (x, y) = split(
                    nonzero.div_ceil(UNITS as usize),
                    R::max_cube_count().0 as usize,
                );
                let values_h = client.create_from_slice(F::as_bytes(values));
                let positions_h = client.create_from_slice(u32::as_bytes(positions));
                scatter::launch_unchecked::<F, R>(
                    &client,
                    CubeCount::Static(x, y, 1),
                    CubeDim::new_1d(UNITS),
                    ArrayArg::from_raw_parts(positions_h, nonzero),
                    ArrayArg::from_raw_parts(values_h, nonzero),
                    ArrayArg::from_raw_parts(rows_h.clone(), rows_len),
                    nonzero,
                );
            }
            pair_sums::launch_unchecked::<F, R>(
                &client,
                CubeCount::Static(tiles, tiles, 1),
                CubeDim::new_2d(SIDE as u32, SIDE as u32),
                ArrayArg::from_raw_parts(rows_h.clone(), branches * n_pad),
                ArrayArg::from_raw_parts(lengths_h, branches),
                ArrayArg::from_raw_parts(depths_h.clone(), n_pad),
                ArrayArg::from_raw_parts(num.clone(), n_pad * n_pad),
                ArrayArg::from_raw_parts(tot.clone(), tot_len),
                branches,
                n_pad,
                ArrayArg::from_raw_parts(alpha_h.clone(), 1),
                generalized,
                vaw,
                method == Method::Unweighted,
                first,
            )
        };
        first = false;
        sent += values.len();
        values.clear();
        positions.clear();
        lengths.clear();
        sending += begin.elapsed();
    };
    on.for_each_branch(|length, entries| {
        done += 1;
        let row = lengths.len() * n_pad;
        for &(s, count) in entries {
            let v = value(method, vaw, count, on.totals[s as usize], length);
            values.push(cast(v));
            positions.push((row + s as usize) as u32);
            own[s as usize] += v;
        }
        lengths.push(cast(length));
        if lengths.len() == batch {
            launch(&mut values, &mut positions, &mut lengths);
            progress(done, total_branches);
        }
    });
    launch(&mut values, &mut positions, &mut lengths);
    progress(total_branches, total_branches);
    let launched = start.elapsed();
    cubecl::future::block_on(client.sync())
        .map_err(|e| Error::Gpu(format!("summing the pairs: {e:?}")))?;
    let summed = start.elapsed();
    let code = match method {
        Method::WeightedUnnormalized => 2,
        _ if vaw => 3,
        Method::Unweighted => 0,
        Method::WeightedNormalized => 1,
        Method::Generalized { .. } => 3,
    };
    let own: Vec<F> = own.into_iter().map(cast).collect();
    let own_h = client.create_from_slice(F::as_bytes(&own));
    let matrix = client.empty(n * n * size);
    let cubes = (n * n).div_ceil(UNITS as usize);
    let (x, y) = split(cubes, R::max_cube_count().0 as usize);
    // SAFETY: every length is that of its buffer.
    unsafe {
        finish::launch_unchecked::<F, R>(
            &client,
            CubeCount::Static(x, y, 1),
            CubeDim::new_1d(UNITS),
            ArrayArg::from_raw_parts(num, n_pad * n_pad),
            ArrayArg::from_raw_parts(tot, tot_len),
            ArrayArg::from_raw_parts(own_h, n),
            ArrayArg::from_raw_parts(matrix.clone(), n * n),
            n,
            n_pad,
            code,
        )
    };
    let values = read::<R, F>(&client, matrix, n * n, batch_bytes)?;
    tracing::debug!(
        "GPU UniFrac, {n} samples: batches built and sent after {launched:.2?} ({sending:.2?} \
         of it sending; {sent} nonzero values of {} in the rows, {:.1}%), sums done after \
         {summed:.2?}, matrix read back after {:.2?}",
        total_branches * n,
        100.0 * sent as f64 / (total_branches * n).max(1) as f64,
        start.elapsed()
    );
    Ok(values)
}

/// Cubes `count` as x × y with x ≤ `max_x` (the units' positions stay
/// `ABSOLUTE_POS` in row-major order of the cubes).
fn split(count: usize, max_x: usize) -> (u32, u32) {
    let x = count.min(max_x.max(1));
    (x as u32, count.div_ceil(x) as u32)
}

/// The matrix (`len` values) read back in pieces of at most `piece_bytes`.
fn read<R: Runtime, F: Float + CubeElement + num_traits::Float>(
    client: &ComputeClient<R>,
    handle: Handle,
    len: usize,
    piece_bytes: usize,
) -> Result<Vec<f64>> {
    use rayon::prelude::*;
    let size = std::mem::size_of::<F>();
    let per_read = (piece_bytes / size).max(1);
    let mut out = vec![0.0f64; len];
    for (k, piece) in out.chunks_mut(per_read).enumerate() {
        let start = (k * per_read * size) as u64;
        let end = start + (piece.len() * size) as u64;
        let part = handle
            .clone()
            .offset_start(start)
            .offset_end((len * size) as u64 - end);
        let bytes = client
            .read_one(part)
            .map_err(|e| Error::Gpu(format!("reading the matrix back: {e:?}")))?;
        let values = F::from_bytes(&bytes);
        piece
            .par_chunks_mut(1 << 16)
            .zip(values.par_chunks(1 << 16))
            .for_each(|(o, v)| {
                for (o, &v) in o.iter_mut().zip(v) {
                    *o = <f64 as num_traits::NumCast>::from(v).unwrap_or(f64::NAN);
                }
            });
    }
    Ok(out)
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;

    /// Batches of one stage of branches each (dozens of launches) give the
    /// CPU path's distances, for the methods of each kernel variant (plain
    /// and variance adjusted); the
    /// matrix is read back in several pieces.
    #[test]
    fn many_small_batches_give_the_cpu_distances() {
        let demo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/demo");
        let table = aam_data::BiomTable::read(demo.join("demo.biom")).unwrap();
        let tree = crate::Tree::read(demo.join("tree.nwk")).unwrap();
        let (on, _) = OnTree::new(&table, &tree, false, false).unwrap();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let n_pad = on.n_samples().div_ceil(TILE) * TILE;
        for (method, vaw) in [
            (Method::Unweighted, false),
            (Method::WeightedNormalized, false),
            (Method::Generalized { alpha: 0.5 }, false),
            (Method::Unweighted, true),
            (Method::WeightedNormalized, true),
            (Method::Generalized { alpha: 0.5 }, true),
        ] {
            let cpu = crate::striped::distances(&on, method, vaw, &pool, &mut |_, _| {});
            let mut batches = 0;
            let gpu = run::<cubecl::wgpu::WgpuRuntime, f32>(
                &on,
                method,
                vaw,
                &Default::default(),
                STEP * n_pad * 4,
                &mut |_, _| batches += 1,
            )
            .unwrap();
            assert!(batches > 10, "{batches} batches");
            // NaN where the CPU has a value (or the reverse) is the worst.
            let diff = cpu
                .iter()
                .zip(&gpu)
                .map(|(a, b)| match (a.is_nan(), b.is_nan()) {
                    (true, true) => 0.0,
                    (false, false) => (a - b).abs(),
                    _ => f64::INFINITY,
                })
                .fold(0.0, f64::max);
            assert!(
                diff <= 1e-5,
                "{method:?} vaw={vaw}: max |gpu - cpu| = {diff:e}"
            );
        }
    }
}
