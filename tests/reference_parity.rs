//! Forward and gradient parity against the PyTorch reference, per fixture case
//! (`fixtures/reference/`), on the CPU (ndarray, f32).
//!
//! Each case goes the way a user's checkpoint does: the `.pt` file is read,
//! its architecture inferred from tensor names and shapes (plus the hints
//! `convert` takes as flags), the weights loaded, and the model run in eval
//! mode. Gradients use the same weights in a dropout-free copy on
//! `Autodiff<NdArray>`, against `f = Σ_k Σ out_k ⊙ W_k` with the reference's W.

use aam_models::import::{infer_config, TorchCheckpoint};
use aam_models::model::AamModel;
use aam_tests::*;
use burn::backend::{Autodiff, NdArray};
use burn::prelude::*;

type Cpu = NdArray<f32>;
type CpuAd = Autodiff<Cpu>;

fn load<B: Backend>(
    case: &Case,
    device: &B::Device,
) -> (aam_models::model::ModelConfig, AamModel<B>) {
    let ckpt = TorchCheckpoint::read(&case.checkpoint()).unwrap();
    let config = infer_config(&ckpt.shapes(), &case.hints(), &ckpt.path).unwrap();
    let mut model = config.init::<B>(device).unwrap();
    model
        .load_state_dict(&config, ckpt.tensors, &ckpt.path)
        .unwrap();
    (config, model)
}

fn check_case(name: &str) {
    let case = Case::load(name);
    let device = Default::default();
    let (config, model) = load::<Cpu>(&case, &device);

    // Names and shapes, in the reference's order.
    let ours = model.state_dict_shapes(&config);
    let mut ours_sorted = ours.clone();
    ours_sorted.sort();
    let mut theirs = case.params();
    theirs.sort();
    assert_eq!(
        ours_sorted,
        theirs,
        "{name}: state-dict names/shapes differ\nconfig: {}",
        config_json(&config)
    );

    // Forward, eval mode.
    let outputs = model.forward_named(case.inputs::<Cpu>(&device), case.return_nucleotides());
    let expected = case.outputs();
    let ours_names: std::collections::BTreeSet<&str> = outputs.iter().map(|(n, _)| *n).collect();
    let theirs_names: std::collections::BTreeSet<&str> =
        expected.keys().map(String::as_str).collect();
    assert_eq!(ours_names, theirs_names, "{name}: output keys differ");
    for (key, tensor) in &outputs {
        let want = &expected[*key];
        assert_eq!(tensor.shape(), want.shape(), "{name}/{key}: shape");
        let got = tensor.to_data().convert::<f32>().to_vec::<f32>().unwrap();
        let diff = max_abs_diff(&got, want.as_slice().unwrap());
        assert!(
            diff <= FORWARD_ATOL,
            "{name}/{key}: max |Δ| = {diff:e} > {FORWARD_ATOL:e}"
        );
    }

    // Gradients of f = Σ out ⊙ W with dropout 0 and no masking.
    if !case.has_grads() {
        return;
    }
    let (config_ad, model_ad) = load::<CpuAd>(&case, &device);
    let model_ad = config_ad
        .without_dropout()
        .init::<CpuAd>(&device)
        .unwrap()
        .with_weights_of(model_ad);
    let weights = grad_weights(&case);
    let outputs = model_ad.forward_named(case.inputs::<CpuAd>(&device), case.return_nucleotides());
    let f = outputs
        .iter()
        .filter_map(|(n, t)| {
            weights
                .get(*n)
                .and_then(|w| t.weighted_sum(w.as_slice().unwrap()))
        })
        .reduce(|a, b| a + b)
        .expect("some weighted output");
    let grads = f.backward();
    let want = reference_grads(&case);
    let no_grad = case.no_grad_params();
    let named = model_ad.named_gradients(&config_ad, &grads);
    assert_eq!(
        named.len(),
        case.params().len(),
        "{name}: one gradient entry per parameter"
    );
    let with_grad = named.iter().filter(|(_, g)| g.is_some()).count();
    assert_eq!(with_grad, want.len(), "{name}: parameters with a gradient");
    for (key, grad) in named {
        match (grad, want.get(&key)) {
            (Some(g), Some(w)) => {
                let g = g.convert::<f32>().to_vec::<f32>().unwrap();
                let rel = max_rel_diff(&g, w.as_slice().unwrap());
                assert!(
                    rel <= GRAD_RTOL,
                    "{name}: grad {key}: relative max |Δ| = {rel:e} > {GRAD_RTOL:e}"
                );
            }
            (None, None) => assert!(
                no_grad.contains(&key),
                "{name}: {key} has no gradient on either side but is not listed"
            ),
            (Some(g), None) => {
                // The reference had None: ours must be zero.
                let g = g.convert::<f32>().to_vec::<f32>().unwrap();
                assert!(
                    g.iter().all(|x| *x == 0.0),
                    "{name}: {key} has a gradient; the reference has none"
                );
            }
            (None, Some(w)) => {
                assert!(
                    w.iter().all(|x| *x == 0.0),
                    "{name}: {key}: no gradient here, non-zero in the reference"
                );
            }
        }
    }
}

macro_rules! parity_cases {
    ($($test:ident => $case:literal),* $(,)?) => {
        $( #[test] fn $test() { check_case($case); } )*

        /// Every fixture folder has a test above.
        #[test]
        fn every_fixture_case_is_tested() {
            let listed = [$($case),*];
            for entry in std::fs::read_dir(fixtures_dir()).unwrap() {
                let entry = entry.unwrap();
                if entry.path().is_dir() {
                    let name = entry.file_name().into_string().unwrap();
                    assert!(listed.contains(&name.as_str()), "fixture case {name} has no test");
                }
            }
        }
    };
}

parity_cases! {
    encoder_unifrac => "encoder_unifrac",
    encoder_faith_pd => "encoder_faith_pd",
    encoder_taxonomy => "encoder_taxonomy",
    encoder_combined => "encoder_combined",
    encoder_countemb_add => "encoder_countemb_add",
    encoder_countemb_concat => "encoder_countemb_concat",
    encoder_countemb_film => "encoder_countemb_film",
    predictor_default => "predictor_default",
    predictor_cat_concat => "predictor_cat_concat",
    predictor_cat_add => "predictor_cat_add",
    predictor_cat_gmu => "predictor_cat_gmu",
    predictor_cat_cross_attention => "predictor_cat_cross-attention",
    predictor_cat_perceiver => "predictor_cat_perceiver",
    predictor_mlp_dropout => "predictor_mlp_dropout",
    predictor_mlp => "predictor_mlp",
    predictor_residual => "predictor_residual",
    predictor_classifier => "predictor_classifier",
    predictor_quantiles => "predictor_quantiles",
    predictor_bounded => "predictor_bounded",
    predictor_softplus => "predictor_softplus",
    predictor_exp => "predictor_exp",
    predictor_relu_out => "predictor_relu_out",
    predictor_no_target_norm => "predictor_no_target_norm",
    predictor_countemb_film => "predictor_countemb_film",
    predictor_faith_base => "predictor_faith_base",
}
