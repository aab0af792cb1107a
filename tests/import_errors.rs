//! Import reports exactly what does not fit: unknown, missing and mis-shaped
//! tensors by name, and damaged model files by path.

use aam_models::import::{
    infer_config, load_model_dir, save_model_dir, ImportError, TorchCheckpoint,
};
use aam_models::model::StateTensor;
use aam_tests::Case;
use burn::backend::NdArray;

type Cpu = NdArray<f32>;

#[test]
fn unknown_missing_and_misshaped_tensors_are_named() {
    let case = Case::load("predictor_cat_gmu");
    let ckpt = TorchCheckpoint::read(&case.checkpoint()).unwrap();
    let config = infer_config(&ckpt.shapes(), &case.hints(), &ckpt.path).unwrap();
    let mut tensors = ckpt.tensors.clone();
    tensors.remove("gmu.gate.bias");
    tensors.insert(
        "gmu.extra.weight".into(),
        StateTensor {
            shape: vec![2],
            values: vec![0.0, 1.0],
        },
    );
    let t = tensors.get_mut("target_head.weight").unwrap();
    t.shape = vec![t.shape[1], t.shape[0]];
    let mut model = config.init::<Cpu>(&Default::default()).unwrap();
    let err = model
        .load_state_dict(&config, tensors, &ckpt.path)
        .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, ImportError::Mismatch { .. }), "{msg}");
    for needle in [
        "state_dict.pt",
        "unknown tensors (1): gmu.extra.weight",
        "missing tensors (1): gmu.gate.bias",
        "target_head.weight is [32, 1] in the file, [1, 32] in the model",
    ] {
        assert!(msg.contains(needle), "missing '{needle}' in: {msg}");
    }
}

#[test]
fn a_state_dict_without_the_token_embedding_cannot_be_inferred() {
    let case = Case::load("encoder_taxonomy");
    let ckpt = TorchCheckpoint::read(&case.checkpoint()).unwrap();
    let mut shapes = ckpt.shapes();
    shapes.remove("sample_encoder.asv_encoder.token_embedding.weight");
    let err = infer_config(&shapes, &case.hints(), &ckpt.path).unwrap_err();
    assert!(
        err.to_string()
            .contains("sample_encoder.asv_encoder.token_embedding.weight is missing"),
        "{err}"
    );
}

#[test]
fn model_dir_round_trips_and_a_truncated_weights_file_is_detected() {
    let case = Case::load("encoder_countemb_concat");
    let device = Default::default();
    let ckpt = TorchCheckpoint::read(&case.checkpoint()).unwrap();
    let config = infer_config(&ckpt.shapes(), &case.hints(), &ckpt.path).unwrap();
    let mut model = config.init::<Cpu>(&device).unwrap();
    model
        .load_state_dict(&config, ckpt.tensors.clone(), &ckpt.path)
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    save_model_dir(dir.path(), &config, &model).unwrap();
    // The file is a torch state dict: same names, same values.
    let (_, reloaded) = load_model_dir::<Cpu>(dir.path(), &device).unwrap();
    for ((k1, a), (k2, b)) in model
        .state_dict(&config)
        .into_iter()
        .zip(reloaded.state_dict(&config))
    {
        assert_eq!(k1, k2);
        assert_eq!(a.values, b.values, "{k1}");
        assert_eq!(
            a.values, ckpt.tensors[&k1].values,
            "{k1} differs from the checkpoint"
        );
    }
    let weights = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_model_dir::<Cpu>(dir.path(), &device)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.safetensors") && err.contains("truncated or corrupt"),
        "{err}"
    );
}

#[test]
fn a_frozen_base_stays_frozen_after_loading_weights() {
    use aam_models::model::{AamModel, ModelConfig};
    use burn::backend::Autodiff;
    type Ad = Autodiff<Cpu>;
    let case = Case::load("predictor_default");
    let device = Default::default();
    let ckpt = TorchCheckpoint::read(&case.checkpoint()).unwrap();
    let ModelConfig::SequencePredictor(mut predictor) =
        infer_config(&ckpt.shapes(), &case.hints(), &ckpt.path).unwrap()
    else {
        panic!("a predictor")
    };
    predictor.freeze_base = true;
    let config = ModelConfig::SequencePredictor(predictor).without_dropout();
    let mut model = config.init::<Ad>(&device).unwrap();
    model
        .load_state_dict(&config, ckpt.tensors, &ckpt.path)
        .unwrap();
    let AamModel::SequencePredictor(ref m) = model else {
        unreachable!()
    };
    let out = m.forward(case.inputs::<Ad>(&device).tokens, None, None, false);
    let aam_models::sequence_predictor::TargetPrediction::Point(y) = out.target_prediction else {
        unreachable!()
    };
    let grads = y.sum().backward();
    let named = model.named_gradients(&config, &grads);
    let base_with_grad: Vec<_> = named
        .iter()
        .filter(|(k, g)| k.starts_with("base_model.") && g.is_some())
        .collect();
    assert!(
        base_with_grad.is_empty(),
        "frozen base got gradients: {:?}",
        base_with_grad.iter().map(|(k, _)| k).collect::<Vec<_>>()
    );
    assert!(
        named
            .iter()
            .any(|(k, g)| k.starts_with("target_head") && g.is_some()),
        "the head must train"
    );
}
