//! A dense layer on rows, `y = x·wᵀ + b`, whose gradients sum over the rows in
//! parts.
//!
//! Why: a dense layer's weight and bias gradients, `dyᵀ·x` and `Σ dy`, reduce
//! over every row, and AAM's rows are many: the ASV level packs every token of
//! every non-empty ASV into one row axis (a real-sized batch of 417 ASVs × 151
//! tokens is 62,967 rows) against widths of 128-512. CubeCL's matmul gives each
//! output tile to one cube, which loops over all the rows, and a 128 × 512
//! output has a few dozen tiles for the H100's 132 SMs; its sum over the rows
//! likewise gives each output column to one unit. Measured on an H100
//! (`benches/matmul_device.sh`, `docs/performance.md`, 2026-11-24), at
//! 62,976 × 128 × 512: `dyᵀ·x` 1.07-1.14 ms and `Σ dy` 0.43-0.59 ms, against
//! PyTorch's 0.17 and 0.10 ms. Cutting the rows into parts of
//! [`ROWS_PER_PART`], one batched matmul (an output per part) and a sum over
//! the parts take 0.08-0.16 ms: the parts fill the GPU, and the sum over ~30
//! parts is a cheap parallel reduction.
//!
//! The split changes only the order of the additions, so results equal the
//! one-shot product within rounding (tested against Burn's `linear`).
//! `Autodiff<B>` records [`crate::DenseOps::dense`] as one node whose
//! backward computes `dx = dy·w` and these two split sums.

use burn::prelude::*;

use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorPrimitive;

pub(crate) mod ahead;
pub(crate) mod autodiff;
#[cfg(feature = "cubecl")]
pub(crate) mod cube;
#[cfg(feature = "fusion")]
mod fusion;
#[cfg(feature = "cubecl")]
mod kernel;

/// The dense layer on rows and the sums over rows behind its gradients.
pub trait DenseOps: Backend {
    /// A dense layer on rows, `y = x·wᵀ + b`, weight in torch layout.
    ///
    /// A backend extension for its gradient, not its value: `Autodiff<B>`
    /// overrides it with one node whose backward sums the weight and bias
    /// gradients over the rows in parts (see the module doc: 7-10x faster on an
    /// H100 at AAM's tens of thousands of rows).
    ///
    /// # Shapes
    /// - x: `[M, K]`, weight: `[N, K]`, bias: `[N]`
    /// - output: `[M, N]`
    fn dense(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        dense_forward::<Self>(
            Tensor::from_primitive(TensorPrimitive::Float(x)),
            Tensor::from_primitive(TensorPrimitive::Float(weight)),
            bias.map(|b| Tensor::from_primitive(TensorPrimitive::Float(b))),
        )
        .into_primitive()
        .tensor()
    }

    /// The gradients `(dx, dw, db)` of [`DenseOps::dense`] from its
    /// input, weight and output gradient, each only where `want` asks
    /// (the module doc: `dx = dy·w`, and `dw`, `db` summed over the rows in parts).
    ///
    /// The default is tensor ops on this backend; Burn's fusion backend runs
    /// them on its inner backend as one custom op (a dozen fewer ops for the
    /// host to record and fuse per layer: matmuls and reductions, which
    /// fusion would not merge anyway).
    ///
    /// # Shapes
    /// - x: `[M, K]`, weight: `[N, K]`, dy: `[M, N]`
    /// - dx: `[M, K]`, dw: `[N, K]`, db: `[N]`
    #[allow(clippy::type_complexity)]
    fn dense_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        want: [bool; 3],
    ) -> (
        Option<FloatTensor<Self>>,
        Option<FloatTensor<Self>>,
        Option<FloatTensor<Self>>,
    ) {
        let wrap = |t| Tensor::<Self, 2>::from_primitive(TensorPrimitive::Float(t));
        let (dx, dw, db) = dense_backward::<Self>(wrap(x), wrap(weight), wrap(dy), want);
        (
            dx.map(|t| t.into_primitive().tensor()),
            dw.map(|t| t.into_primitive().tensor()),
            db.map(|t| t.into_primitive().tensor()),
        )
    }

    /// `a·b` for the dense layers' backward products (rank 2, or rank 3
    /// batched over the leading axis; no unit inner dimensions: see
    /// [`matmul`]). The default is the backend's matmul. CubeCL backends
    /// autotune over kernels validated at AAM's shapes and layouts only, not
    /// over all of Burn's candidates, some of which are wrong for some row
    /// counts (`dense_matmul_candidates`).
    fn dense_matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_matmul(a, b)
    }

    /// The sum over the rows, in parts ([`sum_rows`]): one op where the
    /// backend has the kernel (instead of a split, reshapes and two sums).
    ///
    /// # Shapes
    /// - t: `[M, N]`
    /// - output: `[N]`
    fn column_sum(t: FloatTensor<Self>) -> FloatTensor<Self> {
        sum_rows::<Self>(Tensor::from_primitive(TensorPrimitive::Float(t)))
            .into_primitive()
            .tensor()
    }
}

/// A dense layer on rows, `y = x·wᵀ + b` with `weight` in torch layout
/// (`[d_output, d_input]`), through [`DenseOps::dense`]: the same
/// values as Burn's `linear`, and under autodiff a backward that sums the
/// weight and bias gradients over the rows in parts.
///
/// # Shapes
/// - x: `[M, K]`, weight: `[N, K]`, bias: `[N]`
/// - output: `[M, N]`
pub fn dense<B: DenseOps>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, 2> {
    Tensor::from_primitive(TensorPrimitive::Float(B::dense(
        x.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        bias.map(|b| b.into_primitive().tensor()),
    )))
}

/// `a·b` over the last two axes (batch axes broadcast as `Tensor::matmul`),
/// except that a product with a unit dimension (`m`, `k` or `n` = 1:
/// matrix-vector, vector-matrix, outer product) is a broadcast multiply and a
/// sum instead of a matmul.
///
/// Why: Burn 0.21's fusion backend autotunes such products, and their
/// backward (which has the unit dimension in another place), over
/// vector-matrix kernels that assume `m = 1` and a row-major right-hand side
/// without checking (tracel-ai/burn#5122, tracel-ai/cubek#262), and can keep
/// a wrong result as the fastest: the gradients of a one-output head or of
/// attention over one key came out 10-100% off on an H100. A multiply and a
/// sum is an element-wise op and a reduction for every backend, as fast for
/// these thin shapes, and its backward is again element-wise.
///
/// # Shapes
/// - a: `[..., m, k]`, b: `[..., k, n]` (batch axes equal or 1)
/// - output: `[..., m, n]`
pub fn matmul<B: Backend, const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> Tensor<B, D> {
    let [m, k] = [a.dims()[D - 2], a.dims()[D - 1]];
    let n = b.dims()[D - 1];
    if (m > 1 && k > 1 && n > 1) || D > 4 {
        return a.matmul(b);
    }
    // In rank 5, padded with leading unit axes: `[.., m, k, 1] · [.., 1, k, n]`
    // summed over k (axis 3) is `[.., m, 1, n]`. Written through rank 5
    // because Burn's ranks are const generics.
    let (a_dims, b_dims) = (a.dims(), b.dims());
    let a = a.reshape(rank5(&a_dims, [m, k, 1]));
    let b = b.reshape(rank5(&b_dims, [1, k, n]));
    let mut out = [0; D];
    for i in 0..D - 2 {
        out[i] = a_dims[i].max(b_dims[i]);
    }
    out[D - 2] = m;
    out[D - 1] = n;
    (a * b).sum_dim(3).reshape(out)
}

/// The batch axes of `dims` followed by `last`, padded with leading unit
/// axes to rank 5 (for [`matmul`]).
fn rank5<const D: usize>(dims: &[usize; D], last: [usize; 3]) -> [usize; 5] {
    let mut out = [1; 5];
    let batch = &dims[..D - 2];
    out[2 - batch.len()..2].copy_from_slice(batch);
    out[2..].copy_from_slice(&last);
    out
}

/// Rows per part of a split sum. Below two parts the sum runs in one piece.
pub const ROWS_PER_PART: usize = 2048;

/// [`matmul`] through [`crate::DenseOps::dense_matmul`] where no
/// inner dimension is 1 (the backend's kernel choice for the dense layers).
fn product<B: DenseOps, const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> Tensor<B, D> {
    let [m, k] = [a.dims()[D - 2], a.dims()[D - 1]];
    let n = b.dims()[D - 1];
    if m > 1 && k > 1 && n > 1 && D <= 3 {
        Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(B::dense_matmul(
            a.into_primitive().tensor(),
            b.into_primitive().tensor(),
        )))
    } else {
        matmul(a, b)
    }
}

/// `aᵀ·b`, summed over the shared row axis in parts of [`ROWS_PER_PART`].
///
/// # Shapes
/// - a: `[M, P]`, b: `[M, Q]`
/// - output: `[P, Q]`
pub fn row_product<B: DenseOps>(a: Tensor<B, 2>, b: Tensor<B, 2>) -> Tensor<B, 2> {
    let [m, p] = a.dims();
    let q = b.dims()[1];
    let rows = ROWS_PER_PART;
    let parts = m / rows;
    if parts < 2 {
        return product(a.transpose(), b);
    }
    let split = parts * rows;
    let (a_head, a_tail) = split_rows(a, split);
    let (b_head, b_tail) = split_rows(b, split);
    let head = product(
        a_head.reshape([parts, rows, p]).swap_dims(1, 2),
        b_head.reshape([parts, rows, q]),
    )
    .sum_dim(0)
    .reshape([p, q]);
    match (a_tail, b_tail) {
        (Some(a), Some(b)) => head + product(a.transpose(), b),
        _ => head,
    }
}

/// The sum over rows, in parts of [`ROWS_PER_PART`].
///
/// # Shapes
/// - t: `[M, N]`
/// - output: `[N]`
pub fn sum_rows<B: Backend>(t: Tensor<B, 2>) -> Tensor<B, 1> {
    let [m, n] = t.dims();
    let rows = ROWS_PER_PART;
    let parts = m / rows;
    if parts < 2 {
        return t.sum_dim(0).reshape([n]);
    }
    let (head, tail) = split_rows(t, parts * rows);
    let head = head
        .reshape([parts, rows, n])
        .sum_dim(1)
        .sum_dim(0)
        .reshape([n]);
    match tail {
        Some(tail) => head + tail.sum_dim(0).reshape([n]),
        None => head,
    }
}

/// The first `split` rows, and the rest if any.
fn split_rows<B: Backend>(t: Tensor<B, 2>, split: usize) -> (Tensor<B, 2>, Option<Tensor<B, 2>>) {
    let m = t.dims()[0];
    if split == m {
        return (t, None);
    }
    (
        t.clone().narrow(0, 0, split),
        Some(t.narrow(0, split, m - split)),
    )
}

/// The forward pass every backend runs: `x·wᵀ` on
/// [`crate::DenseOps::dense_matmul`] (on the CubeCL backends the
/// validated kernels, which take the transposed weight as a view) and a
/// broadcast add of the bias; for a product with a unit dimension (one row,
/// input or output feature), [`matmul`] and the add.
///
/// Not Burn's `linear`: Burn's autotuned matmul may pick CubeCL's
/// `double_unit` kernel, which is wrong with a transposed view as its right
/// operand (`[1000, 24]·[24, 16]`, 0.6 relative;
/// `dense_matmul_candidates`; `kernels/tests/ops/dense_validated_matmul.rs`).
///
/// # Shapes
/// - x: `[M, K]`, weight: `[N, K]`, bias: `[N]`
/// - output: `[M, N]`
pub(crate) fn dense_forward<B: DenseOps>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, 2> {
    crate::with_row_bias(product(x, weight.transpose()), bias)
}

/// `(dx, dw, db)` of [`dense_forward`] from its inputs and the output
/// gradient, each only where `want` asks for it.
///
/// # Shapes
/// - x: `[M, K]`, weight: `[N, K]`, dy: `[M, N]`
/// - dx: `[M, K]`, dw: `[N, K]`, db: `[N]`
pub(crate) fn dense_backward<B: DenseOps>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    dy: Tensor<B, 2>,
    want: [bool; 3],
) -> (
    Option<Tensor<B, 2>>,
    Option<Tensor<B, 2>>,
    Option<Tensor<B, 1>>,
) {
    let dx = want[0].then(|| product(dy.clone(), weight));
    let dw = want[1].then(|| row_product(dy.clone(), x));
    let db = want[2].then(|| {
        Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(B::column_sum(
            dy.into_primitive().tensor(),
        )))
    });
    (dx, dw, db)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dense;
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::{Distribution, Tolerance};

    // f64, so that the only difference the split makes (the order of the
    // additions) stays far below the tolerance, and any other shows.
    type Ad = Autodiff<NdArray<f64>>;

    /// `dense` against Burn's `linear`: value and the gradients of x, w and b,
    /// for row counts below one split, at whole parts, and with a tail, with
    /// one input or one output feature too.
    #[test]
    fn dense_equals_linear_with_and_without_split() {
        let device = Default::default();
        for (rows, bias) in [
            (5, true),
            (ROWS_PER_PART * 2, true),
            (ROWS_PER_PART * 3 + 17, true),
            (ROWS_PER_PART * 2 + 1, false),
        ] {
            for (k, n) in [(12, 9), (12, 1), (1, 9)] {
                let x = Tensor::<Ad, 2>::random([rows, k], Distribution::Normal(0.0, 1.0), &device);
                let w = Tensor::<Ad, 2>::random([n, k], Distribution::Normal(0.0, 1.0), &device);
                let b = Tensor::<Ad, 1>::random([n], Distribution::Normal(0.0, 1.0), &device);
                // A non-uniform output gradient.
                let dy =
                    Tensor::<Ad, 2>::random([rows, n], Distribution::Normal(0.0, 1.0), &device);
                let run = |ours: bool| {
                    let (x, w, b) = (
                        x.clone().require_grad(),
                        w.clone().require_grad(),
                        b.clone().require_grad(),
                    );
                    let bias = bias.then(|| b.clone());
                    let y = if ours {
                        dense(x.clone(), w.clone(), bias)
                    } else {
                        burn::tensor::module::linear(x.clone(), w.clone().transpose(), bias)
                    };
                    let grads = (y.clone() * dy.clone()).sum().backward();
                    (
                        y.into_data(),
                        x.grad(&grads).unwrap().into_data(),
                        w.grad(&grads).unwrap().into_data(),
                        b.grad(&grads).map(|g| g.into_data()),
                    )
                };
                let (want, got) = (run(false), run(true));
                let tol = Tolerance::<f64>::rel_abs(1e-9, 1e-9);
                want.0.assert_approx_eq::<f64>(&got.0, tol);
                want.1.assert_approx_eq::<f64>(&got.1, tol);
                want.2.assert_approx_eq::<f64>(&got.2, tol);
                assert_eq!(want.3.is_some(), bias, "rows {rows}");
                assert_eq!(got.3.is_some(), bias, "rows {rows}");
                if let (Some(want), Some(got)) = (want.3, got.3) {
                    want.assert_approx_eq::<f64>(&got, tol);
                }
            }
        }
    }

    /// The split sums against the one-shot ones on the inner backend.
    #[test]
    fn split_sums_equal_one_shot_sums() {
        let device = Default::default();
        let rows = ROWS_PER_PART * 4 + 3;
        let a = Tensor::<NdArray<f64>, 2>::random([rows, 6], Distribution::Default, &device);
        let b = Tensor::<NdArray<f64>, 2>::random([rows, 5], Distribution::Default, &device);
        let tol = Tolerance::<f64>::rel_abs(1e-9, 1e-9);
        row_product(a.clone(), b.clone())
            .into_data()
            .assert_approx_eq::<f64>(&a.clone().transpose().matmul(b).into_data(), tol);
        sum_rows(a.clone())
            .into_data()
            .assert_approx_eq::<f64>(&a.sum_dim(0).reshape([6]).into_data(), tol);
    }
}

#[cfg(test)]
mod matmul_tests {
    use super::*;
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::{Distribution, Tolerance};

    // f64 as every test of this crate: Burn 0.21 keeps one float type per
    // device, the first one a tensor is made with, and `NdArray<f32>` and
    // `NdArray<f64>` share the CPU device, so an f32 test running first in
    // this process would make the f64 tests' tensors f32.
    type Ad = Autodiff<NdArray<f64>>;

    /// `matmul` against `Tensor::matmul`, value and both gradients, for every
    /// unit-dimension shape (and a general one), ranks 2-4, broadcast batches.
    #[test]
    fn matmul_with_unit_dimensions_equals_matmul() {
        let device = Default::default();
        fn check<const D: usize>(
            a: [usize; D],
            b: [usize; D],
            device: &burn::backend::ndarray::NdArrayDevice,
        ) {
            let a = Tensor::<Ad, D>::random(a, Distribution::Normal(0.0, 1.0), device);
            let b = Tensor::<Ad, D>::random(b, Distribution::Normal(0.0, 1.0), device);
            let run = |thin: bool| {
                let (a, b) = (a.clone().require_grad(), b.clone().require_grad());
                let out = if thin {
                    matmul(a.clone(), b.clone())
                } else {
                    a.clone().matmul(b.clone())
                };
                // A non-uniform output gradient.
                let w = Tensor::<Ad, D>::ones(out.dims(), device).cumsum(D - 1);
                let grads = (out.clone() * w).sum().backward();
                let ga = a.grad(&grads).unwrap().into_data();
                let gb = b.grad(&grads).unwrap().into_data();
                (out.into_data(), ga, gb)
            };
            let (want, got) = (run(false), run(true));
            let tol = Tolerance::<f64>::rel_abs(1e-9, 1e-9);
            want.0.assert_approx_eq::<f64>(&got.0, tol);
            want.1.assert_approx_eq::<f64>(&got.1, tol);
            want.2.assert_approx_eq::<f64>(&got.2, tol);
        }
        check([5, 3], [3, 1], &device); // matrix-vector
        check([1, 3], [3, 4], &device); // vector-matrix
        check([5, 1], [1, 4], &device); // outer product
        check([1, 3], [3, 1], &device); // inner product
        check([2, 5, 3], [1, 3, 1], &device); // broadcast batch
        check([2, 1, 7], [2, 7, 4], &device);
        check([2, 3, 6, 4], [2, 3, 4, 1], &device); // attention over one key
        check([2, 3, 1, 4], [2, 3, 4, 6], &device); // one query
        check([2, 3, 6, 1], [2, 3, 1, 4], &device);
        check([2, 3, 6, 4], [2, 3, 4, 5], &device); // general: Tensor::matmul
    }
}
