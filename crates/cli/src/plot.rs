//! PNG plots of a run (plotters): loss curves per epoch, and predicted vs
//! true values on validation. Text uses the bundled DejaVu Sans, so plots
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
    if history.is_empty() {
        return Ok(());
    }
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    let mut keys: Vec<&String> = history
        .iter()
        .flat_map(|r| r.train.keys())
        .filter(|k| k.ends_with("_loss"))
        .collect();
    keys.sort();
    keys.dedup();
    for k in keys {
        for (side, pick) in [("train", true), ("val", false)] {
            let points: Vec<(f64, f64)> = history
                .iter()
                .filter_map(|r| {
                    (if pick { &r.train } else { &r.validation })
                        .get(k)
                        .map(|v| ((r.epoch + 1) as f64, *v))
                })
                .filter(|(_, v)| v.is_finite())
                .collect();
            if !points.is_empty() {
                series.push((format!("{side} {k}"), points));
            }
        }
    }
    let (y0, y1) = range(series.iter().flat_map(|(_, p)| p.iter().map(|(_, y)| *y)));
    let epochs = history.last().map_or(1, |r| r.epoch + 1) as f64;
    atomic_png(&out_dir.join("plots/loss.png"), |path| {
        let root = BitMapBackend::new(path, (1000, 640)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption("losses per epoch", ("sans-serif", 24))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0.5..epochs.max(1.0) + 0.5, y0..y1)?;
        chart
            .configure_mesh()
            .x_desc("epoch")
            .y_desc("loss")
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
    let pairs: Vec<(f64, f64)> = pairs
        .iter()
        .copied()
        .filter(|(a, b)| a.is_finite() && b.is_finite())
        .collect();
    if pairs.is_empty() {
        return Ok(());
    }
    let (lo, hi) = range(pairs.iter().flat_map(|(a, b)| [*a, *b]));
    atomic_png(&out_dir.join("plots/val_predictions.png"), |path| {
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
            .x_desc("true")
            .y_desc("predicted")
            .draw()?;
        chart.draw_series(LineSeries::new([(lo, lo), (hi, hi)], BLACK.mix(0.4)))?;
        chart.draw_series(
            pairs
                .iter()
                .map(|&(t, p)| Circle::new((t, p), 3, BLUE.mix(0.6).filled())),
        )?;
        root.present()?;
        Ok(())
    })
}
