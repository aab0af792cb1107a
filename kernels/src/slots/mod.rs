//! Rows computed for some slots only, put back in their slots: `out[s]` is
//! packed row `r` where slot `s` is the `r`-th non-empty slot, and a shared
//! `fill` row everywhere else, as one op each way.
//!
//! Why: AAM runs the ASV encoder on the non-empty ASV slots only (a batch
//! fills ~400 of 8,192) and puts the pooled embeddings and nucleotide logits
//! back in their slots. Built from tensor ops (a slice per run of filled
//! slots, an expanded `fill` per empty run, one concatenation) that cost a
//! GPU training step ~40 host ops forward and ~100 backward, each recorded
//! by autodiff and by Burn's fusion stream and launched by CubeCL; Burn's
//! `select` has the same value, but its backward is a scatter whose CubeCL
//! kernel walks the indexed axis serially. As one node the backward is two
//! gathers instead: `dpacked = dout[non_empty]` and `dfill = Σ dout[empty]`.
//!
//! The indices are host data ([`RowSlots`]): the caller knows them from
//! the batch, and under fusion the op uploads them when it runs, so the
//! stream records no index tensors.

use std::sync::Arc;

use burn::prelude::*;
use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorPrimitive;

#[cfg(feature = "cubecl")]
impl<R, F, I, BT> SlotOps for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
}

mod autodiff;
#[cfg(feature = "fusion")]
mod fusion;

/// Rows computed for the non-empty slots only, put back in their slots.
pub trait SlotOps: Backend {
    /// Packed rows back in their slots and `fill` in the others
    /// ([`unpack_rows`]). The default is a concatenation and a gather; under
    /// autodiff it is one node whose backward is
    /// [`SlotOps::unpack_rows_backward`], and under fusion one
    /// custom op each way.
    ///
    /// # Shapes
    /// - packed: `[M, W]`, fill: `[1, W]`
    /// - output: `[slots, W]`
    fn unpack_rows(
        packed: FloatTensor<Self>,
        fill: FloatTensor<Self>,
        slots: &RowSlots,
    ) -> FloatTensor<Self> {
        unpack_rows_ops::<Self>(packed, fill, slots)
    }

    /// [`SlotOps::unpack_rows`]' backward: `(dpacked, dfill)`, the
    /// gradients of the non-empty slots gathered and those of the empty
    /// slots summed.
    ///
    /// # Shapes
    /// - dout: `[slots, W]`
    /// - dpacked: `[M, W]`, dfill: `[1, W]`
    fn unpack_rows_backward(
        dout: FloatTensor<Self>,
        slots: &RowSlots,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        unpack_rows_backward_ops::<Self>(dout, slots)
    }
}

/// Which of `slots` slots hold a packed row: `non_empty[r]` is the slot of
/// row `r`, ascending. Cheap to clone (the list is shared).
#[derive(Clone, Debug)]
pub struct RowSlots {
    slots: usize,
    non_empty: Arc<[i64]>,
}

impl RowSlots {
    /// The slots of the packed rows, in `0..slots` and strictly ascending.
    ///
    /// # Panics
    /// If a slot is out of range or the list is not strictly ascending (a
    /// caller's bug: the list comes from the batch, not from user input).
    pub fn new(slots: usize, non_empty: impl Into<Arc<[i64]>>) -> Self {
        let non_empty = non_empty.into();
        assert!(
            non_empty.windows(2).all(|w| w[0] < w[1]),
            "row slots: the non-empty slots must be strictly ascending"
        );
        assert!(
            non_empty.iter().all(|&s| (0..slots as i64).contains(&s)),
            "row slots: a non-empty slot is outside 0..{slots}"
        );
        Self { slots, non_empty }
    }

    /// Slots in all.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Packed rows (non-empty slots).
    pub fn rows(&self) -> usize {
        self.non_empty.len()
    }

    /// The slot of each packed row.
    pub fn non_empty(&self) -> &[i64] {
        &self.non_empty
    }

    /// Every slot filled (then `out = packed`).
    pub fn all_filled(&self) -> bool {
        self.non_empty.len() == self.slots
    }

    /// The slots that take `fill`, ascending.
    pub fn empty(&self) -> Vec<i64> {
        let mut filled = self.non_empty.iter().peekable();
        (0..self.slots as i64)
            .filter(|s| {
                let taken = filled.peek() == Some(&s);
                if taken {
                    filled.next();
                }
                !taken
            })
            .collect()
    }

    /// Per slot, the row of `[packed; fill]` it reads: its packed row, or
    /// `rows()` (the fill row).
    pub fn source(&self) -> Vec<i64> {
        let mut source = vec![self.rows() as i64; self.slots];
        for (row, &slot) in self.non_empty.iter().enumerate() {
            source[slot as usize] = row as i64;
        }
        source
    }
}

fn index<B: Backend>(values: Vec<i64>, device: &B::Device) -> Tensor<B, 1, Int> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), device)
}

fn float<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// [`SlotOps::unpack_rows`] as tensor ops: a gather from `packed`
/// with the fill row appended.
pub(crate) fn unpack_rows_ops<B: Backend>(
    packed: FloatTensor<B>,
    fill: FloatTensor<B>,
    slots: &RowSlots,
) -> FloatTensor<B> {
    let packed = float::<B, 2>(packed);
    if slots.all_filled() {
        return packed.into_primitive().tensor();
    }
    if slots.rows() == 0 {
        // Every slot takes `fill`; no concatenation with a tensor of no rows
        // (CUDA refuses to launch a kernel over nothing).
        return float::<B, 2>(fill)
            .repeat_dim(0, slots.slots())
            .into_primitive()
            .tensor();
    }
    let device = packed.device();
    Tensor::cat(vec![packed, float::<B, 2>(fill)], 0)
        .select(0, index::<B>(slots.source(), &device))
        .into_primitive()
        .tensor()
}

/// [`SlotOps::unpack_rows_backward`] as tensor ops: `dpacked` the
/// gather of the non-empty slots' gradients, `dfill` the sum of the empty
/// slots' (zeros without any).
pub(crate) fn unpack_rows_backward_ops<B: Backend>(
    dout: FloatTensor<B>,
    slots: &RowSlots,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let dout = float::<B, 2>(dout);
    let [_, width] = dout.dims();
    let device = dout.device();
    let empty = slots.empty();
    let dfill = if empty.is_empty() {
        Tensor::<B, 2>::zeros([1, width], &device)
    } else if slots.rows() == 0 {
        // Every slot is empty: the sum of all, without a gather.
        dout.clone().sum_dim(0)
    } else {
        dout.clone()
            .select(0, index::<B>(empty, &device))
            .sum_dim(0)
    };
    let dpacked = if slots.all_filled() {
        dout
    } else if slots.rows() == 0 {
        // No packed rows: an empty gradient, made without a kernel launch.
        Tensor::<B, 2>::empty([0, width], &device)
    } else {
        dout.select(0, index::<B>(slots.non_empty().to_vec(), &device))
    };
    (
        dpacked.into_primitive().tensor(),
        dfill.into_primitive().tensor(),
    )
}

/// Puts packed rows back in their slots, `fill` in the others, through
/// [`SlotOps::unpack_rows`] (under autodiff one node, whose
/// backward gathers).
///
/// # Shapes
/// - packed: `[M, W]` (`M = slots.rows()`), fill: `[1, W]`
/// - output: `[slots.slots(), W]`
pub fn unpack_rows<B: SlotOps>(
    packed: Tensor<B, 2>,
    fill: Tensor<B, 2>,
    slots: &RowSlots,
) -> Tensor<B, 2> {
    assert_eq!(
        packed.dims()[0],
        slots.rows(),
        "unpack_rows: one packed row per non-empty slot"
    );
    assert_eq!(
        fill.dims(),
        [1, packed.dims()[1]],
        "unpack_rows: one fill row as wide as the packed rows"
    );
    float(B::unpack_rows(
        packed.into_primitive().tensor(),
        fill.into_primitive().tensor(),
        slots,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, NdArray};

    type Ad = Autodiff<NdArray<f64>>;

    #[test]
    fn empty_and_source_complement_the_filled_slots() {
        let slots = RowSlots::new(7, vec![1, 2, 5]);
        assert_eq!(slots.empty(), vec![0, 3, 4, 6]);
        assert_eq!(slots.source(), vec![3, 0, 1, 3, 3, 2, 3]);
        assert!(RowSlots::new(2, vec![0, 1]).all_filled());
        assert_eq!(RowSlots::new(3, Vec::new()).empty(), vec![0, 1, 2]);
    }

    #[test]
    #[should_panic(expected = "strictly ascending")]
    fn unordered_slots_are_refused() {
        RowSlots::new(4, vec![2, 1]);
    }

    /// Values and both gradients against the slot-by-slot definition, for
    /// gaps at the start, middle and end, every slot filled, none filled.
    #[test]
    fn unpack_rows_places_rows_and_gathers_gradients() {
        let device = Default::default();
        let width = 3;
        for (n, non_empty) in [
            (7, vec![1, 2, 5]),
            (4, vec![0, 1, 2, 3]),
            (3, vec![]),
            (5, vec![4]),
        ] {
            let slots = RowSlots::new(n, non_empty.clone());
            let m = non_empty.len();
            let packed_values: Vec<f64> = (0..m * width).map(|i| 1.0 + i as f64).collect();
            let packed = Tensor::<Ad, 2>::from_data(
                TensorData::new(packed_values.clone(), [m, width]),
                &device,
            )
            .require_grad();
            let fill = Tensor::<Ad, 2>::from_data(
                TensorData::new(vec![-1.0, -2.0, -3.0], [1, width]),
                &device,
            )
            .require_grad();
            let weights: Vec<f64> = (0..n * width).map(|i| 0.5 + 0.25 * i as f64).collect();
            let out = unpack_rows(packed.clone(), fill.clone(), &slots);
            let grads = (out.clone()
                * Tensor::<Ad, 2>::from_data(
                    TensorData::new(weights.clone(), [n, width]),
                    &device,
                ))
            .sum()
            .backward();
            let mut want = Vec::new();
            let mut want_dpacked = vec![0.0; m * width];
            let mut want_dfill = vec![0.0; width];
            for s in 0..n {
                let w = &weights[s * width..(s + 1) * width];
                match non_empty.iter().position(|&x| x == s as i64) {
                    Some(r) => {
                        want.extend_from_slice(&packed_values[r * width..(r + 1) * width]);
                        want_dpacked[r * width..(r + 1) * width].copy_from_slice(w);
                    }
                    None => {
                        want.extend_from_slice(&[-1.0, -2.0, -3.0]);
                        want_dfill.iter_mut().zip(w).for_each(|(a, b)| *a += b);
                    }
                }
            }
            assert_eq!(
                out.into_data().to_vec::<f64>().unwrap(),
                want,
                "{non_empty:?}"
            );
            let dpacked = packed
                .grad(&grads)
                .map(|g| g.into_data().to_vec::<f64>().unwrap());
            if m > 0 {
                assert_eq!(dpacked.unwrap(), want_dpacked, "{non_empty:?}");
            }
            let dfill = fill
                .grad(&grads)
                .unwrap()
                .into_data()
                .to_vec::<f64>()
                .unwrap();
            assert_eq!(dfill, want_dfill, "{non_empty:?}");
        }
    }
}
