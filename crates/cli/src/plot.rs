//! PNG plots of a run (plotters): loss curves and nucleotide accuracy per
//! epoch, predicted against true values on validation (a regression
//! target, or the UniFrac distances of pretraining), and a classifier's
//! confusion matrix. Text uses the bundled DejaVu Sans, so plots
//! render the same everywhere without system fonts.

use std::path::{Path, PathBuf};
use std::sync::Once;

use aam_train::checkpoint::EpochRecord;
use anyhow::{Context, Result};
use plotters::prelude::*;

static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");
static REGISTER: Once = Once::new();

fn register_font() {
    REGISTER.call_once(|| {
        // The font is bundled and valid; a failure would only lose the text.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    });
}

/// Renders to `<path>.tmp.png`, then renames, so a plot is never half-written.
fn atomic_png(path: &Path, draw: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    register_font();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let tmp: PathBuf = path.with_extension("tmp.png");
    draw(&tmp).with_context(|| format!("drawing {}", path.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
}

fn range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), v| {
            (l.min(v), h.max(v))
        });
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    let pad = ((hi - lo) * 0.05).max(1e-9);
    (lo - pad, hi + pad)
}

/// `plots/loss.png`: every training and validation loss per epoch.
pub fn loss_curves(out_dir: &Path, history: &[EpochRecord]) -> Result<()> {
    let mut keys: Vec<&String> = history
        .iter()
        .flat_map(|r| r.train.keys())
        .filter(|k| k.ends_with("_loss"))
        .collect();
    keys.sort();
    keys.dedup();
    let keys: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
    epoch_curves(
        out_dir,
        "loss",
        "losses per epoch",
        "loss",
        &keys,
        history,
        None,
    )
}

/// `plots/nuc_accuracy.png`: training and validation accuracy of the
/// masked-nucleotide prediction per epoch (runs that have the loss).
pub fn nucleotide_accuracy(out_dir: &Path, history: &[EpochRecord]) -> Result<()> {
    epoch_curves(
        out_dir,
        "nuc_accuracy",
        "masked-nucleotide accuracy per epoch",
        "accuracy",
        &["nuc_accuracy"],
        history,
        Some((0.0, 1.0)),
    )
}

/// `plots/<name>.png`: the training and validation values of `keys` per
/// epoch (nothing when none has a finite value).
fn epoch_curves(
    out_dir: &Path,
    name: &str,
    title: &str,
    y_desc: &str,
    keys: &[&str],
    history: &[EpochRecord],
    y_range: Option<(f64, f64)>,
) -> Result<()> {
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for k in keys {
        for (side, pick) in [("train", true), ("val", false)] {
            let points: Vec<(f64, f64)> = history
                .iter()
                .filter_map(|r| {
                    (if pick { &r.train } else { &r.validation })
                        .get(*k)
                        .map(|v| ((r.epoch + 1) as f64, *v))
                })
                .filter(|(_, v)| v.is_finite())
                .collect();
            if !points.is_empty() {
                series.push((format!("{side} {k}"), points));
            }
        }
    }
    if series.is_empty() {
        return Ok(());
    }
    let (y0, y1) = y_range
        .unwrap_or_else(|| range(series.iter().flat_map(|(_, p)| p.iter().map(|(_, y)| *y))));
    let epochs = history.last().map_or(1, |r| r.epoch + 1) as f64;
    atomic_png(&out_dir.join(format!("plots/{name}.png")), |path| {
        let root = BitMapBackend::new(path, (1000, 640)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 24))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0.5..epochs.max(1.0) + 0.5, y0..y1)?;
        chart
            .configure_mesh()
            .x_desc("epoch")
            .y_desc(y_desc)
            .draw()?;
        for (i, (name, points)) in series.iter().enumerate() {
            let color = Palette99::pick(i / 2).to_rgba();
            let style = if name.starts_with("val") {
                color.stroke_width(2)
            } else {
                color.stroke_width(1)
            };
            chart
                .draw_series(LineSeries::new(points.iter().copied(), style).point_size(2))?
                .label(name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    })
}

/// `plots/val_predictions.png`: predicted against true values (original units).
pub fn predicted_vs_true(out_dir: &Path, pairs: &[(f64, f64)], title: &str) -> Result<()> {
    scatter(
        out_dir,
        "val_predictions",
        pairs,
        title,
        ("true", "predicted"),
    )
}

/// `plots/<name>.png`: predicted against true values, with the diagonal.
pub fn scatter(
    out_dir: &Path,
    name: &str,
    pairs: &[(f64, f64)],
    title: &str,
    axes: (&str, &str),
) -> Result<()> {
    scatter_file(
        &out_dir.join(format!("plots/{name}.png")),
        pairs,
        title,
        axes,
    )
}

/// A scatter plot of `pairs` (x, y) with the diagonal, written to `file`.
pub fn scatter_file(
    file: &Path,
    pairs: &[(f64, f64)],
    title: &str,
    (x_desc, y_desc): (&str, &str),
) -> Result<()> {
    let pairs: Vec<(f64, f64)> = pairs
        .iter()
        .copied()
        .filter(|(a, b)| a.is_finite() && b.is_finite())
        .collect();
    if pairs.is_empty() {
        return Ok(());
    }
    let (lo, hi) = range(pairs.iter().flat_map(|(a, b)| [*a, *b]));
    atomic_png(file, |path| {
        let root = BitMapBackend::new(path, (720, 720)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(lo..hi, lo..hi)?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_desc)
            .draw()?;
        chart.draw_series(LineSeries::new([(lo, lo), (hi, hi)], BLACK.mix(0.4)))?;
        chart.draw_series(
            pairs
                .iter()
                .map(|&(t, p)| Circle::new((t, p), 2, BLUE.mix(0.5).filled())),
        )?;
        root.present()?;
        Ok(())
    })
}

/// `plots/confusion_matrix.png`: validation samples by true (rows) and
/// predicted (columns) class, counts written in the cells.
pub fn confusion_matrix(
    out_dir: &Path,
    labels: &[String],
    pairs: &[(String, String)],
    title: &str,
) -> Result<()> {
    let k = labels.len();
    if k == 0 || pairs.is_empty() {
        return Ok(());
    }
    let index = |l: &str| labels.iter().position(|x| x == l);
    let mut counts = vec![vec![0usize; k]; k];
    for (truth, predicted) in pairs {
        if let (Some(t), Some(p)) = (index(truth), index(predicted)) {
            counts[t][p] += 1;
        }
    }
    let max = counts.iter().flatten().copied().max().unwrap_or(0).max(1) as f64;
    let size = (160 + 60 * k as u32).clamp(400, 1400);
    atomic_png(&out_dir.join("plots/confusion_matrix.png"), |path| {
        let root = BitMapBackend::new(path, (size, size)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(60)
            .y_label_area_size(110)
            .build_cartesian_2d(0..k, 0..k)?;
        let name = |i: &usize| labels.get(*i).cloned().unwrap_or_default();
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc("predicted")
            .y_desc("true")
            .x_labels(k)
            .y_labels(k)
            .x_label_formatter(&name)
            .y_label_formatter(&|i: &usize| name(&(k - 1 - i.min(&(k - 1)))))
            .draw()?;
        for (t, row) in counts.iter().enumerate() {
            for (p, &n) in row.iter().enumerate() {
                let y = k - 1 - t;
                let shade = n as f64 / max;
                let fill = RGBColor(
                    (255.0 * (1.0 - 0.8 * shade)) as u8,
                    (255.0 * (1.0 - 0.6 * shade)) as u8,
                    255,
                );
                chart.draw_series(std::iter::once(Rectangle::new(
                    [(p, y), (p + 1, y + 1)],
                    fill.filled(),
                )))?;
                chart.draw_series(std::iter::once(Text::new(
                    n.to_string(),
                    (p, y + 1),
                    ("sans-serif", 18).into_font().color(&BLACK),
                )))?;
            }
        }
        root.present()?;
        Ok(())
    })
}
