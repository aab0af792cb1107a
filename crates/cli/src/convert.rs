//! `aam-rs convert`: reference checkpoint → aam-rs model directory.

use std::path::PathBuf;

use aam_models::import::{infer_config, save_model_dir, ImportHints, TorchCheckpoint};
use aam_models::model::AamModel;
use aam_models::sequence_encoder::EncoderType;
use aam_models::sequence_predictor::OutputActivation;
use aam_models::{Activation, AttnImplementation};
use anyhow::{Context, Result};
use clap::{Args, ValueEnum};

/// Architecture fields are read off tensor names and shapes; the flags give
/// the few that no tensor records, with the reference's defaults.
#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// Reference checkpoint: a state dict (`torch.save(model.state_dict())`) or a
    /// trainer checkpoint (`best_model.pt`, `final_model.pt`, `checkpoint_epoch_*.pt`).
    #[arg(long = "from", value_name = "PT")]
    from: PathBuf,
    /// Output model directory (config.json + model.safetensors).
    #[arg(long = "out", value_name = "DIR")]
    out: PathBuf,
    /// Attention heads of every transformer stack (`--attention-heads` of the reference CLI).
    #[arg(long, default_value_t = 4)]
    attention_heads: usize,
    /// Heads of one stack, overriding --attention-heads: STACK=N with STACK one of
    /// asv, sample, encoder, count, target. Repeatable.
    #[arg(long = "stack-heads", value_name = "STACK=N", value_parser = parse_stack::<usize>)]
    stack_heads: Vec<(String, usize)>,
    /// Feed-forward activation of every stack.
    #[arg(long, value_enum, default_value_t = ActivationArg::Gelu)]
    activation: ActivationArg,
    /// Activation of one stack: STACK=gelu|relu. Repeatable.
    #[arg(long = "stack-activation", value_name = "STACK=ACT", value_parser = parse_stack::<ActivationArg>)]
    stack_activations: Vec<(String, ActivationArg)>,
    /// Heads of cross-attention / perceiver fusion.
    #[arg(long, default_value_t = 8)]
    cross_attn_heads: usize,
    /// Base model type when it has an `output_head` (default: faith_pd for width 1, else taxonomy).
    #[arg(long, value_enum)]
    encoder_type: Option<EncoderTypeArg>,
    /// Quantiles per output of a quantile-regression head.
    #[arg(long)]
    num_quantiles: Option<usize>,
    /// The model is a classifier (log-softmax output).
    #[arg(long)]
    classifier: bool,
    /// Sigmoid on the target output.
    #[arg(long)]
    bounded_targets: bool,
    /// Output activation of the target head.
    #[arg(long, value_enum, default_value_t = OutputActivationArg::None)]
    output_activation: OutputActivationArg,
    /// Dropout of an MLP head (only used in training).
    #[arg(long, default_value_t = 0.1)]
    regressor_dropout: f64,
    /// Order of conditional-scaling columns, comma-separated (default: sorted).
    #[arg(long, value_delimiter = ',')]
    conditional_scaling_columns: Option<Vec<String>>,
    /// Dropout of every stack (only used in training).
    #[arg(long, default_value_t = 0.1)]
    dropout: f64,
    /// Nucleotide mask ratio (only used in training).
    #[arg(long, default_value_t = 0.0)]
    mask_ratio: f64,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ActivationArg {
    Gelu,
    Relu,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum EncoderTypeArg {
    Taxonomy,
    FaithPd,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum OutputActivationArg {
    None,
    Relu,
    Softplus,
    Exp,
}

const STACKS: [&str; 5] = ["asv", "sample", "encoder", "count", "target"];

fn parse_stack<T: ValueEnumOrNumber>(s: &str) -> Result<(String, T), String> {
    let (stack, value) = s
        .split_once('=')
        .ok_or_else(|| format!("expected STACK=VALUE, got '{s}'"))?;
    if !STACKS.contains(&stack) {
        return Err(format!(
            "unknown stack '{stack}' (expected one of {})",
            STACKS.join(", ")
        ));
    }
    Ok((stack.to_string(), T::parse(value)?))
}

trait ValueEnumOrNumber: Sized + Clone + Send + Sync + 'static {
    fn parse(s: &str) -> Result<Self, String>;
}

impl ValueEnumOrNumber for usize {
    fn parse(s: &str) -> Result<Self, String> {
        s.parse()
            .map_err(|_| format!("'{s}' is not a positive integer"))
    }
}

impl ValueEnumOrNumber for ActivationArg {
    fn parse(s: &str) -> Result<Self, String> {
        <ActivationArg as ValueEnum>::from_str(s, true)
    }
}

fn activation(a: ActivationArg) -> Activation {
    match a {
        ActivationArg::Gelu => Activation::Gelu,
        ActivationArg::Relu => Activation::Relu,
    }
}

impl ConvertArgs {
    fn hints(&self) -> ImportHints {
        ImportHints {
            attention_heads: self.attention_heads,
            stack_heads: self.stack_heads.iter().cloned().collect(),
            activation: activation(self.activation),
            stack_activations: self
                .stack_activations
                .iter()
                .map(|(s, a)| (s.clone(), activation(*a)))
                .collect(),
            cross_attn_heads: self.cross_attn_heads,
            encoder_type: self.encoder_type.map(|t| match t {
                EncoderTypeArg::Taxonomy => EncoderType::Taxonomy,
                EncoderTypeArg::FaithPd => EncoderType::FaithPd,
            }),
            num_quantiles: self.num_quantiles,
            is_classifier: self.classifier,
            bounded_targets: self.bounded_targets,
            output_activation: match self.output_activation {
                OutputActivationArg::None => OutputActivation::None,
                OutputActivationArg::Relu => OutputActivation::Relu,
                OutputActivationArg::Softplus => OutputActivation::Softplus,
                OutputActivationArg::Exp => OutputActivation::Exp,
            },
            regressor_dropout: self.regressor_dropout,
            conditional_scaling_columns: self.conditional_scaling_columns.clone(),
            dropout: self.dropout,
            mask_ratio: self.mask_ratio,
            attn_implementation: AttnImplementation::Auto,
        }
    }
}

/// Reads the checkpoint, infers the architecture, loads and re-saves.
pub fn run(args: ConvertArgs) -> Result<()> {
    type B = burn::backend::NdArray<f32>;
    let device = Default::default();
    let checkpoint =
        TorchCheckpoint::read(&args.from).context("reading the reference checkpoint")?;
    let config = infer_config(&checkpoint.shapes(), &args.hints(), &checkpoint.path)
        .context("inferring the architecture (see `aam-rs convert --help` for the flags that set what tensors do not record)")?;
    let mut model: AamModel<B> = config.init(&device).context("building the model")?;
    let n_tensors = checkpoint.tensors.len();
    model
        .load_state_dict(&config, checkpoint.tensors, &checkpoint.path)
        .context("loading the weights")?;
    save_model_dir(&args.out, &config, &model).context("writing the model directory")?;
    let params: usize = model
        .state_dict_shapes(&config)
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    let class = match &config {
        aam_models::model::ModelConfig::SequenceEncoder(_) => "SequenceEncoder",
        aam_models::model::ModelConfig::SequencePredictor(_) => "SequencePredictor",
    };
    tracing::info!(
        "converted {} ({class}, {n_tensors} tensors, {params} parameters{}) -> {}",
        args.from.display(),
        if checkpoint.from_trainer_checkpoint {
            ", from a trainer checkpoint"
        } else {
            ""
        },
        args.out.display()
    );
    Ok(())
}
