//! What a training forward pass tells about its dense layers before their
//! kernels run, so that other processes can compile those kernels first.
//!
//! Why: CUDA and HIP compile each kernel at its first launch, one after
//! another on the thread that launches. On an empty kernel cache (every new
//! cluster node) an H200 spent 26 of a first training step's 46 s in NVRTC
//! compiling 15 matmul kernels (2026-11-28,
//! `benches/results/2026-11-28_h200_matmul_plan.txt`). The kernels of a
//! dense layer follow from its shapes (rows, widths, type, bias, which
//! gradients are wanted), and a forward pass knows them early: a model
//! announces the row counts of its levels before its first layer
//! ([`announce_rows`]), and every dense layer's forward its backward's
//! problem, seconds before the backward runs ([`Ahead::Dense`]). A program
//! that sets [`set_compile_ahead_hook`] receives these; [`run_dense_problem`]
//! is what a helper process runs for a problem: the same
//! [`DenseOps::dense`] and [`DenseOps::dense_backward`] calls on zeros of
//! those shapes, which compile the same kernels and leave them in CubeCL's
//! on-disk cache, where the training process finds them (CubeCL shares that
//! cache between processes). Nothing here changes a value the training
//! computes; without a hook an announcement is one lock read.
//!
//! [`DenseProblem`]'s text form (its `Display` and `FromStr`, one line:
//! `rows inputs outputs dtype bias forward want_dx want_dw want_db`, e.g.
//! `62967 128 512 f32 1 0 1 1 1`) is how a program hands a problem to a
//! helper.

use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, RwLock};

use burn::prelude::*;
use burn::tensor::DType;

use crate::DenseOps;

/// A dense layer `y = x·wᵀ + b` as its kernels see it: `x` is
/// `[rows, inputs]`, `w` is `[outputs, inputs]`, `bias` whether `b` is
/// given; `forward` whether the layer's forward runs, and `want` which of
/// the backward's `(dx, dw, db)` do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DenseProblem {
    pub rows: usize,
    pub inputs: usize,
    pub outputs: usize,
    pub dtype: DType,
    pub bias: bool,
    pub forward: bool,
    pub want: [bool; 3],
}

/// What a forward pass tells ahead of its kernels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ahead {
    /// A dense layer's forward ran; its backward (`forward` false) follows.
    Dense(DenseProblem),
    /// The row counts of the dense layers this forward pass is about to run
    /// (the model's levels: tokens, ASV slots, samples) and their types
    /// (mixed precision's, the model's), before the first.
    Rows {
        rows: Vec<usize>,
        dtypes: Vec<DType>,
    },
}

/// Receives what forward passes announce.
pub type AheadHook = Arc<dyn Fn(Ahead) + Send + Sync>;

static HOOK: RwLock<Option<AheadHook>> = RwLock::new(None);

/// Sets (or, with `None`, removes) the process's receiver of announcements.
/// The dense layers are reached from deep inside the model, where no run
/// option is at hand, hence one receiver for the whole process. The hook
/// runs on the thread that builds the forward pass: it should only queue
/// (a problem repeats at every step; the receiver deduplicates).
pub fn set_compile_ahead_hook(hook: Option<AheadHook>) {
    *HOOK.write().unwrap_or_else(|e| e.into_inner()) = hook;
}

/// Hands what `ahead()` describes to the hook, if one is set.
pub(crate) fn announce(ahead: impl FnOnce() -> Ahead) {
    let hook = HOOK.read().unwrap_or_else(|e| e.into_inner()).clone();
    if let Some(hook) = hook {
        hook(ahead());
    }
}

/// For a model: the row counts its dense layers are about to run on in
/// this (training) forward pass, and their types ([`Ahead::Rows`]).
pub fn announce_rows(rows: &[usize], dtypes: &[DType]) {
    announce(|| Ahead::Rows {
        rows: rows.to_vec(),
        dtypes: dtypes.to_vec(),
    });
}

/// A dense layer as [`dense_problems`] sees it: its weight's
/// `[outputs, inputs]` and whether it has a bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DenseLayer {
    pub outputs: usize,
    pub inputs: usize,
    pub bias: bool,
}

/// The distinct dense layers of a model, from its torch-named parameter
/// shapes: every 2-D `...weight` is one, with a bias where a `...bias` of the
/// same stem is. (A table used transposed, as the token embedding's, is
/// another layer than this says; its forward announces it.)
pub fn dense_layers(shapes: &[(String, Vec<usize>)]) -> Vec<DenseLayer> {
    let names: std::collections::HashSet<&str> = shapes.iter().map(|(n, _)| n.as_str()).collect();
    let mut layers = Vec::new();
    for (name, shape) in shapes {
        let (Some(stem), [outputs, inputs]) = (name.strip_suffix("weight"), shape.as_slice())
        else {
            continue;
        };
        let layer = DenseLayer {
            outputs: *outputs,
            inputs: *inputs,
            bias: names.contains(format!("{stem}bias").as_str()),
        };
        if !layers.contains(&layer) {
            layers.push(layer);
        }
    }
    layers
}

/// Every layer at every announced row count in every announced type: the
/// forwards first (a training step reaches them first), then the backwards
/// with every gradient. A superset of the dense problems of the step that
/// announced `rows` and `dtypes`, the transposed tables aside.
pub fn dense_problems(
    rows: &[usize],
    dtypes: &[DType],
    layers: &[DenseLayer],
) -> Vec<DenseProblem> {
    let mut all = Vec::new();
    for forward in [true, false] {
        for &dtype in dtypes {
            for &rows in rows {
                for layer in layers {
                    all.push(DenseProblem {
                        rows,
                        inputs: layer.inputs,
                        outputs: layer.outputs,
                        dtype,
                        bias: layer.bias,
                        forward,
                        want: [!forward, !forward, layer.bias && !forward],
                    });
                }
            }
        }
    }
    all
}

/// Whether running `by` compiles the kernels `problem` needs: the same
/// layer and type, and the forward or each wanted gradient too.
pub fn covers(by: &DenseProblem, problem: &DenseProblem) -> bool {
    let same = (by.rows, by.inputs, by.outputs, by.dtype, by.bias)
        == (
            problem.rows,
            problem.inputs,
            problem.outputs,
            problem.dtype,
            problem.bias,
        );
    same && (by.forward || !problem.forward) && (0..3).all(|i| by.want[i] || !problem.want[i])
}

/// Runs `problem` on zeros on `device` and waits for it: the kernels it
/// launches are those of a training step's dense layer of that shape,
/// compiled (and kept in CubeCL's cache) if they were not.
pub fn run_dense_problem<B: DenseOps>(
    problem: &DenseProblem,
    device: &B::Device,
) -> Result<(), String> {
    let dtype = problem.dtype.into();
    let zeros = |dims: &[usize]| B::float_zeros(Shape::from(dims.to_vec()), device, dtype);
    let (rows, inputs, outputs) = (problem.rows, problem.inputs, problem.outputs);
    // The traits' methods, as the model and the autodiff node call them (one
    // custom op each on the fusion backend), not the tensor-op defaults.
    if problem.forward {
        let bias = problem.bias.then(|| zeros(&[outputs]));
        drop(B::dense(
            zeros(&[rows, inputs]),
            zeros(&[outputs, inputs]),
            bias,
        ));
    }
    if problem.want.contains(&true) {
        let (x, w, dy) = (
            zeros(&[rows, inputs]),
            zeros(&[outputs, inputs]),
            zeros(&[rows, outputs]),
        );
        drop(B::dense_backward(x, w, dy, problem.want));
    }
    B::sync(device).map_err(|e| format!("{e:?}"))
}

impl fmt::Display for DenseProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dtype = match self.dtype {
            DType::F64 => "f64",
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            _ => "other",
        };
        let flag = u8::from;
        let [a, b, c] = self.want.map(flag);
        write!(
            f,
            "{} {} {} {dtype} {} {} {a} {b} {c}",
            self.rows,
            self.inputs,
            self.outputs,
            flag(self.bias),
            flag(self.forward)
        )
    }
}

impl FromStr for DenseProblem {
    type Err = String;

    /// `rows inputs outputs dtype bias forward want_dx want_dw want_db`.
    fn from_str(line: &str) -> Result<Self, String> {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [rows, inputs, outputs, dtype, bias, forward, a, b, c] = fields[..] else {
            return Err(format!(
                "expected `rows inputs outputs dtype bias forward want_dx want_dw want_db`, got {} fields",
                fields.len()
            ));
        };
        let size = |name: &str, v: &str| match v.parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!("{name} `{v}` is not a positive integer")),
        };
        let flag = |name: &str, v: &str| match v {
            "0" => Ok(false),
            "1" => Ok(true),
            _ => Err(format!("{name} `{v}` is not 0 or 1")),
        };
        let dtype = match dtype {
            "f64" => DType::F64,
            "f32" => DType::F32,
            "f16" => DType::F16,
            "bf16" => DType::BF16,
            other => return Err(format!("dtype `{other}` is not f64, f32, f16 or bf16")),
        };
        Ok(Self {
            rows: size("rows", rows)?,
            inputs: size("inputs", inputs)?,
            outputs: size("outputs", outputs)?,
            dtype,
            bias: flag("bias", bias)?,
            forward: flag("forward", forward)?,
            want: [
                flag("want_dx", a)?,
                flag("want_dw", b)?,
                flag("want_db", c)?,
            ],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, NdArray};
    use std::sync::Mutex;

    /// The forward of two dense layers (the first on an input that needs no
    /// gradient, the second without a bias) announces each backward with
    /// its shapes and wanted gradients, and a model's row counts pass
    /// through; the text form reads back; a problem runs; nothing is
    /// announced once the hook is removed.
    #[test]
    fn the_forward_announces_each_backward_problem() {
        // f64, as every test of this crate: the CPU device's float type is
        // the process's, set by the first tensor made on it.
        type B = Autodiff<NdArray<f64>>;
        let device = Default::default();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        set_compile_ahead_hook(Some(Arc::new(move |a| sink.lock().unwrap().push(a))));
        // Sizes no other test uses: the hook is the process's, and tests run
        // in parallel.
        announce_rows(&[7, 3], &[DType::F64]);
        let x = Tensor::<B, 2>::ones([7, 13], &device);
        let w1 = Tensor::<B, 2>::ones([11, 13], &device).require_grad();
        let b1 = Tensor::<B, 1>::zeros([11], &device).require_grad();
        let w2 = Tensor::<B, 2>::ones([6, 11], &device).require_grad();
        let h = crate::dense(x, w1, Some(b1));
        let y = crate::dense(h, w2, None);
        set_compile_ahead_hook(None);
        let _ = crate::dense(y.clone(), Tensor::ones([5, 6], &device), None);
        let _ = y.sum().backward();

        let seen: Vec<Ahead> = seen
            .lock()
            .unwrap()
            .iter()
            .filter(|a| match a {
                Ahead::Dense(p) => p.rows == 7,
                Ahead::Rows { rows, .. } => rows == &[7, 3],
            })
            .cloned()
            .collect();
        let dense = |inputs, outputs, bias, want| DenseProblem {
            rows: 7,
            inputs,
            outputs,
            dtype: DType::F64,
            bias,
            forward: false,
            want,
        };
        let want = [
            dense(13, 11, true, [false, true, true]),
            dense(11, 6, false, [true, true, false]),
        ];
        assert_eq!(
            seen,
            vec![
                Ahead::Rows {
                    rows: vec![7, 3],
                    dtypes: vec![DType::F64]
                },
                Ahead::Dense(want[0]),
                Ahead::Dense(want[1])
            ]
        );
        assert_eq!(want[0].to_string(), "7 13 11 f64 1 0 0 1 1");
        for p in want.iter().chain(&[DenseProblem {
            forward: true,
            ..want[0]
        }]) {
            assert_eq!(p.to_string().parse::<DenseProblem>().as_ref(), Ok(p));
            run_dense_problem::<NdArray<f64>>(p, &device).unwrap();
        }
        for bad in [
            "7 13 11 f32 1 0 0 1",
            "7 x 11 f32 1 0 0 1 1",
            "7 13 0 f32 1 0 0 1 1",
            "7 13 11 i8 1 0 0 1 1",
            "7 13 11 f32 1 0 0 2 1",
        ] {
            assert!(bad.parse::<DenseProblem>().is_err(), "{bad}");
        }
    }

    /// Layers from torch names (a bias by the weight's stem, repeats once,
    /// vectors and 3-D tensors none), and the problems made from them.
    #[test]
    fn layers_from_weight_shapes_and_the_problems_made_of_them() {
        let shapes: Vec<(String, Vec<usize>)> = [
            ("a.in_proj_weight", vec![24, 8]),
            ("a.in_proj_bias", vec![24]),
            ("b.in_proj_weight", vec![24, 8]),
            ("b.in_proj_bias", vec![24]),
            ("head.weight", vec![1, 8]),
            ("norm.weight", vec![8]),
            ("pos.weight", vec![1, 4, 8]),
        ]
        .into_iter()
        .map(|(n, s)| (n.to_string(), s))
        .collect();
        let layers = dense_layers(&shapes);
        let layer = |outputs, inputs, bias| DenseLayer {
            outputs,
            inputs,
            bias,
        };
        assert_eq!(layers, vec![layer(24, 8, true), layer(1, 8, false)]);
        let made = dense_problems(&[100, 6], &[DType::BF16, DType::F32], &layers);
        assert_eq!(made.len(), 2 * 2 * 2 * 2);
        assert!(made[..8].iter().all(|p| p.forward && p.want == [false; 3]));
        assert_eq!(made[0].dtype, DType::BF16);
        let backward = DenseProblem {
            rows: 6,
            inputs: 8,
            outputs: 1,
            dtype: DType::F32,
            bias: false,
            forward: false,
            want: [true, true, false],
        };
        assert!(made.iter().any(|m| covers(m, &backward)));
        assert!(!made.iter().any(|m| covers(
            m,
            &DenseProblem {
                rows: 7,
                ..backward
            }
        )));
        assert!(!covers(
            &DenseProblem {
                want: [false, true, false],
                ..backward
            },
            &backward
        ));
    }
}
