//! Weights in and out: reference PyTorch checkpoints, and aam-rs model files.
//!
//! Parameter paths of aam-rs modules already are the reference's state-dict
//! keys (see the crate doc), except where Burn has no equivalent container:
//! - `nn.Sequential` heads skip indices (`target_head.0`, `.2` or `.0`, `.3`
//!   with dropout); ours count `target_head.mlp.0`, `.1`, …
//! - `ModuleDict`s keyed by column name (`categorical_embedder.embeddings.<col>`,
//!   `output_scales.<col>`); ours are `Vec`s in sorted / listed column order.
//! - the plain linear head is `target_head.weight` in torch and
//!   `target_head.linear.weight` here.
//!
//! [`torch_key`] is that whole table. Everything else (the model file format,
//! checkpoint import, architecture inference) is built on it, so a name either
//! maps exactly or is reported.
//!
//! **Model file** (`<dir>/config.json` + `<dir>/model.safetensors`): the
//! safetensors file *is* a torch state dict (torch names, torch layouts, f32),
//! so `safetensors.torch.load_file` + `load_state_dict` works on the reference
//! model too; `config.json` is a [`ModelConfig`] holding every architecture
//! field, so the directory alone rebuilds the model.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use burn::prelude::*;
use burn::tensor::DType;
use serde::{Deserialize, Serialize};

use crate::asv_encoder::AsvEncoderConfig;
use crate::categorical::CategoricalEmbedDim;
pub use crate::error::ImportError;
use crate::model::{AamModel, ModelConfig, StateTensor};
use crate::nn::Activation;
use crate::sample_encoder::{CountEmbeddingMethod, SampleSequenceEncoderConfig};
use crate::sequence_encoder::{EncoderType, SequenceEncoderConfig};
use crate::sequence_predictor::{CategoricalFusion, OutputActivation, SequencePredictorConfig};
use crate::AttnImplementation;

/// File name of the weights inside a model directory.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// File name of the architecture inside a model directory.
pub const CONFIG_FILE: &str = "config.json";

/// A reference checkpoint's tensors, prefixes stripped.
#[derive(Debug)]
pub struct TorchCheckpoint {
    /// The file read.
    pub path: PathBuf,
    /// Torch key → tensor (float32).
    pub tensors: HashMap<String, StateTensor>,
    /// Whether it was a trainer checkpoint dict (`model_state_dict`).
    pub from_trainer_checkpoint: bool,
}

/// Prefixes that wrappers add to every key: `torch.compile` and DataParallel/DDP.
const WRAPPER_PREFIXES: [&str; 2] = ["_orig_mod.", "module."];

/// Strips `module.` / `_orig_mod.` (in any order, repeated) from a key.
pub fn strip_wrapper_prefixes(mut key: &str) -> &str {
    while let Some(rest) = WRAPPER_PREFIXES.iter().find_map(|p| key.strip_prefix(p)) {
        key = rest;
    }
    key
}

impl TorchCheckpoint {
    /// Reads a `.pt`/`.pth` file: a plain state dict, or the reference
    /// trainer's checkpoint dict (weights under `model_state_dict`).
    pub fn read(path: &Path) -> Result<Self, ImportError> {
        use burn_store::pytorch::PytorchReader;
        let format_err = |reason: String| ImportError::Format {
            path: path.to_path_buf(),
            reason,
        };
        if !path.is_file() {
            return Err(ImportError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
            });
        }
        let (reader, from_trainer_checkpoint) =
            match PytorchReader::with_top_level_key(path, "model_state_dict") {
                Ok(r) if !r.is_empty() => (r, true),
                _ => (
                    PytorchReader::new(path).map_err(|e| {
                        format_err(format!("not a readable PyTorch checkpoint ({e})"))
                    })?,
                    false,
                ),
            };
        let mut tensors = HashMap::new();
        for (key, snapshot) in reader.into_tensors() {
            let stripped = strip_wrapper_prefixes(&key).to_string();
            let data = snapshot
                .to_data()
                .map_err(|e| format_err(format!("tensor {key}: {e}")))?;
            if !matches!(
                data.dtype,
                DType::F32 | DType::F64 | DType::F16 | DType::BF16
            ) {
                return Err(format_err(format!(
                    "tensor {key} has dtype {:?}; weights must be floating point",
                    data.dtype
                )));
            }
            let shape = data.shape.to_vec();
            let values = data
                .convert::<f32>()
                .to_vec::<f32>()
                .map_err(|e| format_err(format!("tensor {key}: {e:?}")))?;
            if tensors
                .insert(stripped.clone(), StateTensor { shape, values })
                .is_some()
            {
                return Err(format_err(format!(
                    "tensor {stripped} appears twice once prefixes are stripped"
                )));
            }
        }
        if tensors.is_empty() {
            return Err(format_err("no tensors found".into()));
        }
        Ok(Self {
            path: path.to_path_buf(),
            tensors,
            from_trainer_checkpoint,
        })
    }

    /// Key → shape.
    pub fn shapes(&self) -> BTreeMap<String, Vec<usize>> {
        self.tensors
            .iter()
            .map(|(k, t)| (k.clone(), t.shape.clone()))
            .collect()
    }
}

/// What cannot be read off tensor shapes; the reference's defaults.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ImportHints {
    /// Heads of the ASV, sample, encoder, count and target stacks. Default: 4.
    pub attention_heads: usize,
    /// Per-stack head overrides: `asv`, `sample`, `encoder`, `count`, `target`.
    pub stack_heads: BTreeMap<String, usize>,
    /// Activation of every stack. Default: gelu.
    pub activation: Activation,
    /// Per-stack activation overrides (keys as `stack_heads`).
    pub stack_activations: BTreeMap<String, Activation>,
    /// Heads of cross-attention / perceiver fusion. Default: 8.
    pub cross_attn_heads: usize,
    /// `taxonomy` or `faith_pd` when the base has an `output_head`
    /// (indistinguishable by shape). Default: faith_pd for width 1, else taxonomy.
    pub encoder_type: Option<EncoderType>,
    /// Quantiles (target_head rows = out_dim · Q). Default: None.
    pub num_quantiles: Option<usize>,
    /// Log-softmax classifier. Default: false.
    pub is_classifier: bool,
    /// Sigmoid output. Default: false.
    pub bounded_targets: bool,
    /// Output activation. Default: none.
    pub output_activation: OutputActivation,
    /// Dropout of an MLP head whose indices step by 3. Default: 0.1.
    pub regressor_dropout: f64,
    /// Order of conditional-scaling columns (state dicts keep it, but the
    /// checkpoint reader does not). Default: sorted.
    pub conditional_scaling_columns: Option<Vec<String>>,
    /// Dropout of every stack (training only). Default: 0.1.
    pub dropout: f64,
    /// Nucleotide mask ratio (training only). Default: 0.0.
    pub mask_ratio: f64,
    /// Attention implementation. Default: auto.
    pub attn_implementation: AttnImplementation,
}

impl Default for ImportHints {
    fn default() -> Self {
        Self {
            attention_heads: 4,
            stack_heads: BTreeMap::new(),
            activation: Activation::Gelu,
            stack_activations: BTreeMap::new(),
            cross_attn_heads: 8,
            encoder_type: None,
            num_quantiles: None,
            is_classifier: false,
            bounded_targets: false,
            output_activation: OutputActivation::None,
            regressor_dropout: 0.1,
            conditional_scaling_columns: None,
            dropout: 0.1,
            mask_ratio: 0.0,
            attn_implementation: AttnImplementation::Auto,
        }
    }
}

impl ImportHints {
    fn heads(&self, stack: &str) -> usize {
        *self.stack_heads.get(stack).unwrap_or(&self.attention_heads)
    }
    fn activation(&self, stack: &str) -> Activation {
        *self
            .stack_activations
            .get(stack)
            .unwrap_or(&self.activation)
    }
}

/// Reads architecture fields off a state dict's names and shapes.
struct ShapeReader<'a> {
    shapes: &'a BTreeMap<String, Vec<usize>>,
    path: &'a Path,
}

/// A transformer stack read off the shapes: (layers, feed-forward width).
struct Stack {
    layers: usize,
    intermediate_size: Option<usize>,
}

impl ShapeReader<'_> {
    fn get(&self, key: &str) -> Option<&Vec<usize>> {
        self.shapes.get(key)
    }
    fn require(&self, key: &str) -> Result<&Vec<usize>, ImportError> {
        self.get(key).ok_or_else(|| ImportError::Inference {
            path: self.path.to_path_buf(),
            reason: format!("tensor {key} is missing"),
        })
    }
    fn has_prefix(&self, prefix: &str) -> bool {
        self.shapes
            .range(prefix.to_string()..)
            .next()
            .is_some_and(|(k, _)| k.starts_with(prefix))
    }
    /// Distinct values of the path segment right after `prefix`.
    fn children(&self, prefix: &str) -> BTreeSet<String> {
        self.shapes
            .keys()
            .filter_map(|k| k.strip_prefix(prefix))
            .filter_map(|rest| rest.split('.').next())
            .map(str::to_string)
            .collect()
    }
    fn indices(&self, prefix: &str) -> Vec<usize> {
        let mut v: Vec<usize> = self
            .children(prefix)
            .iter()
            .filter_map(|c| c.parse().ok())
            .collect();
        v.sort();
        v
    }
    /// A `TransformerEncoder` at `prefix` (`P.` with `P.encoder.layers.<i>`).
    fn stack(&self, prefix: &str, d: usize) -> Result<Stack, ImportError> {
        let layers = self.indices(&format!("{prefix}encoder.layers."));
        if layers.is_empty() {
            return Ok(Stack {
                layers: 0,
                intermediate_size: None,
            });
        }
        let ff = self.require(&format!("{prefix}encoder.layers.0.linear1.weight"))?[0];
        Ok(Stack {
            layers: layers.len(),
            intermediate_size: (ff != 4 * d).then_some(ff),
        })
    }
}

/// Works out a [`ModelConfig`] from a state dict's names and shapes plus the
/// few fields no tensor records (`hints`).
pub fn infer_config(
    shapes: &BTreeMap<String, Vec<usize>>,
    hints: &ImportHints,
    source: &Path,
) -> Result<ModelConfig, ImportError> {
    let r = ShapeReader {
        shapes,
        path: source,
    };
    let is_predictor = r.has_prefix("base_model.");
    let p = if is_predictor { "base_model." } else { "" };
    let asv = format!("{p}sample_encoder.asv_encoder.");
    let [vocab, d] = two(r.require(&format!("{asv}token_embedding.weight"))?);
    let max_bp = r.require(&format!(
        "{asv}position_embedding.position_embedding.weight"
    ))?[0]
        - 1;
    let token_limit = r.require(&format!(
        "{p}sample_encoder.sample_position_embedding.position_embedding.weight"
    ))?[0]
        - 5;
    let asv_stack = r.stack(&format!("{asv}transformer."), d)?;
    let sample_stack = r.stack(&format!("{p}sample_encoder.sample_transformer."), d)?;
    let encoder_stack = r.stack(&format!("{p}encoder_transformer."), d)?;
    let count_method = if r
        .get(&format!("{p}sample_encoder.count_film.weight"))
        .is_some()
    {
        Some(CountEmbeddingMethod::Film)
    } else if r
        .get(&format!("{p}sample_encoder.count_proj.weight"))
        .is_some()
    {
        Some(CountEmbeddingMethod::Concat)
    } else if r
        .get(&format!("{p}sample_encoder.count_embed.weight"))
        .is_some()
    {
        Some(CountEmbeddingMethod::Add)
    } else {
        None
    };
    let output_head = r.get(&format!("{p}output_head.weight")).map(|s| s[0]);
    let encoder_type = if r.get(&format!("{p}uni_ff.weight")).is_some() {
        EncoderType::Combined
    } else if let Some(width) = output_head {
        hints.encoder_type.unwrap_or(if width == 1 {
            EncoderType::FaithPd
        } else {
            EncoderType::Taxonomy
        })
    } else {
        EncoderType::Unifrac
    };
    let asv_config = AsvEncoderConfig::new()
        .with_vocab_size(vocab)
        .with_embedding_dim(d)
        .with_max_bp(max_bp)
        .with_num_layers(asv_stack.layers)
        .with_num_heads(hints.heads("asv"))
        .with_intermediate_size(asv_stack.intermediate_size)
        .with_dropout(hints.dropout)
        .with_activation(hints.activation("asv"))
        .with_predict_nucleotides(r.get(&format!("{asv}nucleotide_head.weight")).is_some())
        .with_attn_implementation(hints.attn_implementation)
        .with_mask_ratio(hints.mask_ratio);
    let sample_config = SampleSequenceEncoderConfig::new(asv_config)
        .with_token_limit(token_limit)
        .with_sample_num_layers(sample_stack.layers)
        .with_sample_num_heads(hints.heads("sample"))
        .with_sample_intermediate_size(sample_stack.intermediate_size)
        .with_sample_dropout(hints.dropout)
        .with_sample_activation(hints.activation("sample"))
        .with_count_embedding(count_method.is_some())
        .with_count_embedding_method(count_method.unwrap_or_default());
    let base = SequenceEncoderConfig::new(sample_config)
        .with_encoder_num_layers(encoder_stack.layers)
        .with_encoder_num_heads(hints.heads("encoder"))
        .with_encoder_intermediate_size(encoder_stack.intermediate_size)
        .with_encoder_dropout(hints.dropout)
        .with_encoder_activation(hints.activation("encoder"))
        .with_base_output_dim(output_head)
        .with_encoder_type(encoder_type);
    if !is_predictor {
        return Ok(ModelConfig::SequenceEncoder(base));
    }
    infer_predictor(&r, base, d, hints).map(ModelConfig::SequencePredictor)
}

fn infer_predictor(
    r: &ShapeReader,
    base: SequenceEncoderConfig,
    d: usize,
    hints: &ImportHints,
) -> Result<SequencePredictorConfig, ImportError> {
    let count = r.stack("count_encoder.", d)?;
    let target = r.stack("target_encoder.", d)?;
    // target head: linear, residual (skip + mlp.<k>) or MLP (<k>)
    let (mlp_prefix, residual) = if r.get("target_head.skip.weight").is_some() {
        ("target_head.mlp.", true)
    } else {
        ("target_head.", false)
    };
    let mlp_indices = r.indices(mlp_prefix);
    let (head_out, hidden, regressor_dropout) = if r.get("target_head.weight").is_some() {
        (r.require("target_head.weight")?[0], None, 0.0)
    } else if mlp_indices.len() >= 2 {
        let widths: Vec<usize> = mlp_indices
            .iter()
            .map(|k| r.require(&format!("{mlp_prefix}{k}.weight")).map(|s| s[0]))
            .collect::<Result<_, _>>()?;
        let stride = mlp_indices[1] - mlp_indices[0];
        let dropout = if stride == 3 {
            hints.regressor_dropout
        } else {
            0.0
        };
        (
            *widths.last().expect("≥2"),
            Some(widths[..widths.len() - 1].to_vec()),
            dropout,
        )
    } else {
        return Err(ImportError::Inference {
            path: r.path.to_path_buf(),
            reason: "no target_head weights (expected target_head.weight or an MLP head)".into(),
        });
    };
    let out_dim = match hints.num_quantiles {
        Some(q) if head_out % q == 0 => head_out / q,
        Some(q) => {
            return Err(ImportError::Inference {
                path: r.path.to_path_buf(),
                reason: format!(
                    "target_head has {head_out} outputs, not a multiple of --num-quantiles {q}"
                ),
            })
        }
        None => head_out,
    };
    // categoricals
    let columns = r.children("categorical_embedder.embeddings.");
    let (cardinalities, embed_dim) = if columns.is_empty() {
        (None, CategoricalEmbedDim::Uniform(16))
    } else {
        let mut cards = BTreeMap::new();
        let mut dims = BTreeMap::new();
        for col in &columns {
            let [card, dim] =
                two(r.require(&format!("categorical_embedder.embeddings.{col}.weight"))?);
            cards.insert(col.clone(), card);
            dims.insert(col.clone(), dim);
        }
        let first = *dims.values().next().expect("non-empty");
        let embed = if dims.values().all(|&x| x == first) {
            CategoricalEmbedDim::Uniform(first)
        } else {
            CategoricalEmbedDim::PerColumn(dims)
        };
        (Some(cards), embed)
    };
    let fusion = if r.has_prefix("gmu.") {
        CategoricalFusion::Gmu
    } else if r.has_prefix("cross_attn_fusion.") {
        CategoricalFusion::CrossAttention
    } else if r.has_prefix("perceiver_fusion.") {
        CategoricalFusion::Perceiver
    } else if let Some(s) = r.get("categorical_projection.weight") {
        // concat: [D, D+C]; add: [D, C]
        let c = total_dim(&columns, &embed_dim);
        if s[1] == d + c {
            CategoricalFusion::Concat
        } else if s[1] == c {
            CategoricalFusion::Add
        } else {
            return Err(ImportError::Inference {
                path: r.path.to_path_buf(),
                reason: format!("categorical_projection.weight is {s:?}; expected [{d}, {}] (concat) or [{d}, {c}] (add)", d + c),
            });
        }
    } else {
        CategoricalFusion::Concat
    };
    let scaling: Vec<String> = r.children("output_scales.").into_iter().collect();
    let scaling = (!scaling.is_empty()).then(|| match &hints.conditional_scaling_columns {
        Some(order) if order.iter().collect::<BTreeSet<_>>() == scaling.iter().collect() => {
            order.clone()
        }
        _ => scaling,
    });
    let mut config = SequencePredictorConfig::new(base)
        .with_count_num_layers(count.layers)
        .with_count_num_heads(hints.heads("count"))
        .with_count_intermediate_size(count.intermediate_size)
        .with_count_dropout(hints.dropout)
        .with_count_activation(hints.activation("count"))
        .with_target_num_layers(target.layers)
        .with_target_num_heads(hints.heads("target"))
        .with_target_intermediate_size(target.intermediate_size)
        .with_target_dropout(hints.dropout)
        .with_target_activation(hints.activation("target"))
        .with_out_dim(out_dim)
        .with_is_classifier(hints.is_classifier)
        .with_target_layer_norm(r.get("target_norm.weight").is_some())
        .with_bounded_targets(hints.bounded_targets)
        .with_learnable_output_scale(r.get("output_scale").is_some())
        .with_output_activation(hints.output_activation)
        .with_categorical_cardinalities(cardinalities)
        .with_categorical_embed_dim(embed_dim)
        .with_categorical_fusion(fusion)
        .with_regressor_hidden_dims(hidden)
        .with_regressor_dropout(regressor_dropout)
        .with_residual_regression_head(residual)
        .with_conditional_scaling_columns(scaling)
        .with_cross_attn_heads(hints.cross_attn_heads)
        .with_num_quantiles(hints.num_quantiles)
        .with_count_prediction(count.layers > 0);
    if let Some(latents) = r.get("perceiver_fusion.latents") {
        config = config
            .with_perceiver_num_latents(latents[0])
            .with_perceiver_num_layers(r.indices("perceiver_fusion.self_attn_layers.").len());
    }
    config.validate()?;
    Ok(config)
}

fn total_dim(columns: &BTreeSet<String>, dim: &CategoricalEmbedDim) -> usize {
    columns.iter().map(|c| dim.of(c)).sum()
}

fn two(shape: &[usize]) -> [usize; 2] {
    [shape[0], shape.get(1).copied().unwrap_or(0)]
}

/// Writes a model directory: `config.json` and `model.safetensors` (torch
/// names and layouts). Each file is written to a temporary name and renamed,
/// so an interrupted save never leaves a truncated model behind.
pub fn save_model_dir<B: Backend>(
    dir: &Path,
    config: &ModelConfig,
    model: &AamModel<B>,
) -> Result<(), ImportError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ImportError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let state = model.state_dict(config);
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = state
        .into_iter()
        .map(|(k, t)| {
            (
                k,
                t.shape,
                t.values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            )
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = bytes
        .iter()
        .map(|(k, shape, data)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data)
                    .expect("shape matches data");
            (k.clone(), view)
        })
        .collect();
    let mut metadata = HashMap::new();
    metadata.insert("format".to_string(), "pt".to_string());
    metadata.insert(
        "producer".to_string(),
        format!("aam-rs {}", env!("CARGO_PKG_VERSION")),
    );
    let weights =
        safetensors::serialize(views, Some(metadata)).map_err(|e| ImportError::Format {
            path: dir.join(WEIGHTS_FILE),
            reason: e.to_string(),
        })?;
    let json = serde_json::to_string_pretty(config).expect("config serialises");
    write_atomic(&dir.join(WEIGHTS_FILE), &weights)?;
    write_atomic(&dir.join(CONFIG_FILE), json.as_bytes())?;
    Ok(())
}

/// [`aam_data::write_atomic`], with its error as an [`ImportError`].
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ImportError> {
    aam_data::write_atomic(path, bytes).map_err(|e| match e {
        aam_data::Error::Io { path, source } => ImportError::Io { path, source },
        e => ImportError::Format {
            path: path.to_path_buf(),
            reason: e.to_string(),
        },
    })
}

/// Whether `path` is a PyTorch checkpoint (a torch zip archive, `.pt`/`.pth`)
/// rather than an aam-rs checkpoint or model directory.
pub fn is_torch_checkpoint(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    path.is_file()
        && std::fs::File::open(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
        && magic == *b"PK\x03\x04"
}

/// The architecture and weights of a model given as a reference PyTorch
/// checkpoint (architecture inferred with `hints`, as `aam-rs convert` does)
/// or as a model directory of `aam-rs convert`.
pub fn read_model_weights(
    path: &Path,
    hints: &ImportHints,
) -> Result<(ModelConfig, HashMap<String, StateTensor>), ImportError> {
    if path.is_dir() {
        let config_path = path.join(CONFIG_FILE);
        let config = read_config(&config_path)?;
        return Ok((config, read_safetensors(&path.join(WEIGHTS_FILE))?));
    }
    let checkpoint = TorchCheckpoint::read(path)?;
    let config = infer_config(&checkpoint.shapes(), hints, &checkpoint.path)?;
    Ok((config, checkpoint.tensors))
}

/// Loads a model given as [`read_model_weights`] takes it onto `device`.
pub fn load_model<B: Backend>(
    path: &Path,
    hints: &ImportHints,
    device: &B::Device,
) -> Result<(ModelConfig, AamModel<B>), ImportError> {
    let (config, state) = read_model_weights(path, hints)?;
    let mut model = config.init::<B>(device)?;
    model.load_state_dict(&config, state, path)?;
    Ok((config, model))
}

fn read_config(config_path: &Path) -> Result<ModelConfig, ImportError> {
    let text = std::fs::read_to_string(config_path).map_err(|source| ImportError::Io {
        path: config_path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| ImportError::Format {
        path: config_path.to_path_buf(),
        reason: format!("invalid model config: {e}"),
    })
}

/// Reads a model directory written by [`save_model_dir`].
pub fn load_model_dir<B: Backend>(
    dir: &Path,
    device: &B::Device,
) -> Result<(ModelConfig, AamModel<B>), ImportError> {
    let config = read_config(&dir.join(CONFIG_FILE))?;
    let weights_path = dir.join(WEIGHTS_FILE);
    let state = read_safetensors(&weights_path)?;
    let mut model = config.init::<B>(device)?;
    model.load_state_dict(&config, state, &weights_path)?;
    Ok((config, model))
}

/// Reads a safetensors file of float tensors.
pub fn read_safetensors(path: &Path) -> Result<HashMap<String, StateTensor>, ImportError> {
    let bytes = std::fs::read(path).map_err(|source| ImportError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let format_err = |reason: String| ImportError::Format {
        path: path.to_path_buf(),
        reason,
    };
    let file = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
        format_err(format!(
            "not a valid safetensors file (truncated or corrupt?): {e}"
        ))
    })?;
    let mut out = HashMap::new();
    for (name, view) in file.tensors() {
        let values: Vec<f32> = match view.dtype() {
            safetensors::Dtype::F32 => view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            safetensors::Dtype::F64 => view
                .data()
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32)
                .collect(),
            other => {
                return Err(format_err(format!(
                    "tensor {name} has dtype {other:?}; expected F32"
                )))
            }
        };
        out.insert(
            name,
            StateTensor {
                shape: view.shape().to_vec(),
                values,
            },
        );
    }
    Ok(out)
}
