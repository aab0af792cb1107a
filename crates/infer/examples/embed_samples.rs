//! Embeds the samples of a BIOM table with a trained model on the CPU and
//! prints, for each, its nearest other sample in the embedding space.
//!
//! ```sh
//! cargo run -p aam-infer --example embed_samples -- runs/demo/checkpoints/best.safetensors crates/data/demo/demo.biom
//! ```

use aam_infer::{read_table, Model, Options};
use burn::backend::NdArray;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model, table] = args.as_slice() else {
        return Err("usage: embed_samples <MODEL> <TABLE.biom>".into());
    };
    let model = Model::<NdArray>::load(model, &Default::default())?;
    let samples = read_table(table)?;
    let embeddings = model.embed(&samples, &Options::default())?;
    let n = embeddings.ids.len();
    let distance = |a: &[f32], b: &[f32]| -> f32 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y) * (x - y))
            .sum::<f32>()
            .sqrt()
    };
    for i in 0..n {
        let nearest = (0..n)
            .filter(|&j| j != i)
            .map(|j| (j, distance(embeddings.row(i), embeddings.row(j))))
            .min_by(|a, b| a.1.total_cmp(&b.1));
        match nearest {
            Some((j, d)) => println!("{}\t{}\t{d:.4}", embeddings.ids[i], embeddings.ids[j]),
            None => println!("{}", embeddings.ids[i]),
        }
    }
    eprintln!(
        "{n} samples embedded in {} dimensions; {} left out (fewer reads than the training depth)",
        embeddings.dim,
        embeddings.dropped.len()
    );
    Ok(())
}
