//! `GET /metrics`: counters and histograms in Prometheus' text format.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

/// Latency buckets, seconds.
const SECONDS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
/// Batch size buckets, samples.
const SAMPLES: [f64; 10] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

/// A cumulative histogram.
#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, value: f64) {
        for (bound, count) in self.bounds.iter().zip(&mut self.counts) {
            if value <= *bound {
                *count += 1;
            }
        }
        self.sum += value;
        self.count += 1;
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (bound, count) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {count}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

struct Inner {
    requests: BTreeMap<(&'static str, u16), u64>,
    request_seconds: Histogram,
    queue_seconds: Histogram,
    inference_seconds: Histogram,
    batch_samples: Histogram,
}

/// The service's measurements.
pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            inner: Mutex::new(Inner {
                requests: BTreeMap::new(),
                request_seconds: Histogram::new(&SECONDS),
                queue_seconds: Histogram::new(&SECONDS),
                inference_seconds: Histogram::new(&SECONDS),
                batch_samples: Histogram::new(&SAMPLES),
            }),
        }
    }
}

impl Metrics {
    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        f(&mut self.inner.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// A request answered on `route` with `status` after `seconds`.
    pub fn request(&self, route: &'static str, status: u16, seconds: f64) {
        self.with(|m| {
            *m.requests.entry((route, status)).or_default() += 1;
            m.request_seconds.observe(seconds);
        });
    }

    /// A request's wait in the queue.
    pub fn queue_seconds(&self, seconds: f64) {
        self.with(|m| m.queue_seconds.observe(seconds));
    }

    /// A device batch of `samples` that took `seconds`.
    pub fn batch(&self, samples: usize, seconds: f64) {
        self.with(|m| {
            m.batch_samples.observe(samples as f64);
            m.inference_seconds.observe(seconds);
        });
    }

    /// The text of `/metrics`; `queued` is the queue's length now.
    pub fn render(&self, queued: usize, in_flight: usize) -> String {
        self.with(|m| {
            let mut out = String::new();
            out.push_str("# HELP aam_requests_total Requests answered, by route and HTTP status.\n# TYPE aam_requests_total counter\n");
            for ((route, status), n) in &m.requests {
                let _ = writeln!(
                    out,
                    "aam_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}"
                );
            }
            let _ = writeln!(out, "# HELP aam_queue_size Requests waiting for the model.\n# TYPE aam_queue_size gauge\naam_queue_size {queued}");
            let _ = writeln!(out, "# HELP aam_requests_in_flight Requests admitted and not yet answered.\n# TYPE aam_requests_in_flight gauge\naam_requests_in_flight {in_flight}");
            m.request_seconds.write(
                &mut out,
                "aam_request_duration_seconds",
                "Time from a request's arrival to its answer.",
            );
            m.queue_seconds.write(
                &mut out,
                "aam_queue_duration_seconds",
                "Time a request waited for the model.",
            );
            m.inference_seconds.write(
                &mut out,
                "aam_inference_duration_seconds",
                "Time of one device batch (preparation and forward pass).",
            );
            m.batch_samples.write(
                &mut out,
                "aam_batch_samples",
                "Samples per device batch.",
            );
            out
        })
    }
}
