//! `serve-bench`: `aam-rs serve` under load beside offline `aam-rs embed`
//! on the same samples and machine, in one run.
//!
//! 1. Offline: `aam-rs embed` on the whole table once to warm up (kernels
//!    compiled), then on the samples it embedded (those at least as deep as
//!    the model's rarefaction depth; the service gets the same) and on their
//!    first 64 (a quarter of a smaller table): samples/s of the first with process start and model load,
//!    and without them (the difference of the two runs), the baseline;
//!    with `--rounds R` the pair R times, the median the baseline.
//! 2. Service: `aam-rs serve` on a free local port; for each concurrency,
//!    that many clients send `--samples-per-request` samples of the table
//!    per `POST /embed` (round robin) until `--requests` have been answered:
//!    requests/s, samples/s, p50/p99 latency, and the mean device batch of
//!    that phase from `/metrics` (`aam_inference_duration_seconds`; at
//!    concurrency 1, one request's forward pass and preparation), and the
//!    largest difference of any answered embedding from the offline one;
//!    with `--rounds R` all phases R times over, then each concurrency's
//!    median against the median offline run.
//! 3. Soak (`--soak-minutes M`, instead of 2's phases): requests at a
//!    steady `--soak-rate` per second for M minutes, from `--soak-clients`
//!    threads (at most that many in flight: a slower server sees them all
//!    busy until the time is up); each `--soak-interval` seconds a line
//!    (and a `--soak-csv` row) with the server's resident memory
//!    (`/proc/<pid>/status`), the requests answered, the errors and the
//!    p50/p99 latency of the interval. A leak shows as resident memory that
//!    grows after the first interval.
//!
//! ```sh
//! cargo build --release -p aam-benches --bin serve-bench
//! target/release/serve-bench --aam-rs target/release/aam-rs --model runs/demo/checkpoints/best.safetensors \
//!   --table ../shared/data/oral2550/oral_2550.biom --concurrency 1,16,64
//! ```

use std::io::{BufRead, Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aam_data::{BiomTable, SampleReads};
use clap::Parser;
use serde_json::json;

#[derive(Parser, Debug)]
struct Args {
    /// The `aam-rs` binary.
    #[arg(long)]
    aam_rs: PathBuf,
    /// The model (a checkpoint).
    #[arg(long)]
    model: PathBuf,
    /// The samples (a BIOM table).
    #[arg(long)]
    table: PathBuf,
    /// `--backend` of both runs.
    #[arg(long, default_value = "ndarray")]
    backend: String,
    /// Batch size of the offline `embed`.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Concurrent clients, one phase each.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    concurrency: Vec<usize>,
    /// Rounds: the offline pair of runs this many times, then the
    /// concurrency phases this many times over (all offline rounds come
    /// first: the service holds the device while it runs); the baseline is
    /// the median offline figure, and each concurrency's summary the median
    /// of its rounds (one GPU run varies by 10-20% from the next).
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Requests per phase (at least 4 per client).
    #[arg(long, default_value_t = 400)]
    requests: usize,
    /// Samples per request.
    #[arg(long, default_value_t = 1)]
    samples_per_request: usize,
    /// Also write the results here (JSON).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Soak: minutes of steady load instead of the concurrency phases.
    #[arg(long, default_value_t = 0.0)]
    soak_minutes: f64,
    /// Soak: requests a second.
    #[arg(long, default_value_t = 5.0)]
    soak_rate: f64,
    /// Soak: client threads sending them.
    #[arg(long, default_value_t = 4)]
    soak_clients: usize,
    /// Soak: seconds between two report lines.
    #[arg(long, default_value_t = 60)]
    soak_interval: u64,
    /// Soak: also write the report lines here (CSV).
    #[arg(long)]
    soak_csv: Option<PathBuf>,
    /// One more argument of `aam-rs serve` (repeatable), e.g.
    /// `--serve-arg=--max-batch-asvs=8192`.
    #[arg(long, allow_hyphen_values = true)]
    serve_arg: Vec<String>,
}

fn main() {
    let args = Args::parse();
    let table = BiomTable::read(&args.table).expect("reads the table");
    let mut samples = SampleReads::from_table(&table);
    let tmp = std::env::temp_dir().join(format!("serve-bench-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();

    // 1. Offline: a warm-up run, then the kept samples and their first 64
    // (the difference removes process start and model load).
    let embed = |table: &std::path::Path| {
        let start = Instant::now();
        let status = Command::new(&args.aam_rs)
            .args(["embed", "--model"])
            .arg(&args.model)
            .arg("--table")
            .arg(table)
            .arg("--output")
            .arg(tmp.join("offline.tsv"))
            .args(["--backend", &args.backend, "--batch-size"])
            .arg(args.batch_size.to_string())
            .stderr(Stdio::null())
            .status()
            .expect("runs aam-rs embed");
        assert!(status.success(), "aam-rs embed failed");
        start.elapsed().as_secs_f64()
    };
    let warm_up = embed(&args.table);
    // The samples embedded: those at least as deep as the model's
    // rarefaction depth (the service answers the others with 422).
    let text = std::fs::read_to_string(tmp.join("offline.tsv")).expect("the offline output");
    // Every answer is compared with these (the largest difference is printed).
    let reference: Arc<std::collections::HashMap<String, Vec<f64>>> = Arc::new(
        text.lines()
            .skip(1)
            .filter_map(|l| {
                let mut fields = l.split('\t');
                let id = fields.next()?.to_string();
                Some((id, fields.filter_map(|v| v.parse().ok()).collect()))
            })
            .collect(),
    );
    samples.retain(|s| reference.contains_key(&s.id));
    let n = samples.len();
    let (all, few) = (tmp.join("kept.json"), tmp.join("few.json"));
    let small = 64.min(n / 4);
    std::fs::write(&all, biom_json(&samples)).unwrap();
    std::fs::write(&few, biom_json(&samples[..small])).unwrap();
    println!("offline embed: warm-up {warm_up:.2} s");
    let (mut offline_rounds, mut with_start_rounds) = (Vec::new(), Vec::new());
    for round in 1..=args.rounds.max(1) {
        let (t_all, t_few) = (embed(&all), embed(&few));
        let offline_process = n as f64 / t_all;
        with_start_rounds.push(offline_process);
        let offline = (n - small) as f64 / (t_all - t_few).max(1e-9);
        println!(
            "offline embed, round {round}: {n} samples in {t_all:.2} s = {offline_process:.1} samples/s \
             with process start and model load; {small} samples in {t_few:.2} s; so {offline:.1} samples/s without them"
        );
        offline_rounds.push(offline);
    }
    let offline = median(&offline_rounds);
    let offline_process = median(&with_start_rounds);
    if offline_rounds.len() > 1 {
        println!(
            "offline embed: median {offline:.1} samples/s of {} rounds",
            offline_rounds.len()
        );
    }

    // 2. The service.
    let mut server = Command::new(&args.aam_rs)
        .args(["serve", "--port", "0", "--model"])
        .arg(&args.model)
        .args([
            "--backend",
            &args.backend,
            "--max-concurrent-requests",
            "4096",
        ])
        .args(&args.serve_arg)
        .env("AAM_LOG", "info")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("starts aam-rs serve");
    let stderr = server.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if line.contains("warming up on") || line.contains(" ready in ") {
                eprintln!("serve: {}", line.trim());
            }
            if let Some(at) = line.find("listening on http://") {
                let _ = tx.send(
                    line[at + 20..]
                        .split_whitespace()
                        .next()
                        .unwrap()
                        .to_string(),
                );
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("the server's address");
    let loaded = Instant::now();
    while http(&addr, "GET", "/health", "").0 != 200 {
        assert!(loaded.elapsed() < Duration::from_secs(900), "never healthy");
        std::thread::sleep(Duration::from_millis(50));
    }
    println!(
        "service healthy {:.1} s after it listened (model load and warm-up)",
        loaded.elapsed().as_secs_f64()
    );
    let bodies: Arc<Vec<String>> = Arc::new(
        samples
            .chunks(args.samples_per_request)
            .map(request_json)
            .collect(),
    );
    if args.soak_minutes > 0.0 {
        soak(&args, &addr, server.id(), bodies);
        let _ = Command::new("kill")
            .args(["-TERM", &server.id().to_string()])
            .status();
        let _ = server.wait();
        let _ = std::fs::remove_dir_all(&tmp);
        return;
    }
    let mut phases = Vec::new();
    let mut concurrency = args.concurrency.clone();
    concurrency.dedup();
    let rounds: Vec<(usize, usize)> = (1..=args.rounds.max(1))
        .flat_map(|r| concurrency.iter().map(move |&c| (r, c)))
        .collect();
    for (round, c) in rounds {
        let total = args.requests.max(4 * c);
        let before = inference(&addr);
        let next = Arc::new(AtomicUsize::new(0));
        let start = Instant::now();
        let clients: Vec<_> = (0..c)
            .map(|_| {
                let (addr, bodies, next) = (addr.clone(), bodies.clone(), next.clone());
                std::thread::spawn(move || {
                    let (mut latencies, mut answers) = (Vec::new(), Vec::new());
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        if k >= total {
                            break (latencies, answers);
                        }
                        let t = Instant::now();
                        let (status, body) =
                            http(&addr, "POST", "/embed", &bodies[k % bodies.len()]);
                        latencies.push(t.elapsed().as_secs_f64());
                        assert_eq!(status, 200, "{body}");
                        answers.push(body);
                    }
                })
            })
            .collect();
        let (mut latencies, mut answers) = (Vec::new(), Vec::new());
        for client in clients {
            let (l, a) = client.join().unwrap();
            latencies.extend(l);
            answers.extend(a);
        }
        let seconds = start.elapsed().as_secs_f64();
        let after = inference(&addr);
        // Compared after the phase's clock stopped: the clients only send.
        let largest = answers
            .iter()
            .map(|body| difference(body, &reference))
            .fold(0f64, f64::max);
        latencies.sort_by(f64::total_cmp);
        let pct =
            |p: f64| latencies[((latencies.len() as f64 * p) as usize).min(latencies.len() - 1)];
        let samples_per_s = (total * args.samples_per_request) as f64 / seconds;
        let batch_ms = 1e3 * (after.0 - before.0) / (after.1 - before.1).max(1.0);
        let batch_samples =
            (total * args.samples_per_request) as f64 / (after.1 - before.1).max(1.0);
        if args.rounds > 1 && c == concurrency[0] {
            println!("-- round {round}");
        }
        println!(
            "concurrency {c:3}: {:8.1} requests/s {samples_per_s:8.1} samples/s ({:.2}x offline), p50 {:7.2} ms, p99 {:7.2} ms; device batches {batch_samples:.1} samples, {batch_ms:.2} ms mean; largest difference from offline {largest:.1e}",
            total as f64 / seconds,
            samples_per_s / offline,
            1e3 * pct(0.5),
            1e3 * pct(0.99),
        );
        phases.push(json!({
            "round": round, "concurrency": c, "requests": total, "seconds": seconds,
            "requests_per_s": total as f64 / seconds, "samples_per_s": samples_per_s,
            "ratio_to_offline": samples_per_s / offline,
            "p50_ms": 1e3 * pct(0.5), "p99_ms": 1e3 * pct(0.99),
            "mean_batch_samples": batch_samples, "mean_batch_ms": batch_ms,
            "largest_difference_from_offline": largest,
        }));
    }
    let _ = Command::new("kill")
        .args(["-TERM", &server.id().to_string()])
        .status();
    let _ = server.wait();
    let _ = std::fs::remove_dir_all(&tmp);
    // Each concurrency's median over the rounds, against the median offline run.
    let mut summary = Vec::new();
    if args.rounds > 1 {
        for &c in &concurrency {
            let rates: Vec<f64> = phases
                .iter()
                .filter(|p| p["concurrency"] == c)
                .map(|p| p["samples_per_s"].as_f64().unwrap())
                .collect();
            let (mid, low, high) = (
                median(&rates),
                rates.iter().copied().fold(f64::INFINITY, f64::min),
                rates.iter().copied().fold(0f64, f64::max),
            );
            println!(
                "concurrency {c:3}, median of {} rounds: {mid:8.1} samples/s = {:.2}x the median offline run \
                 (rounds {:.2}x-{:.2}x)",
                rates.len(),
                mid / offline,
                low / offline,
                high / offline
            );
            summary.push(json!({
                "concurrency": c, "median_samples_per_s": mid, "median_ratio_to_offline": mid / offline,
                "rounds_samples_per_s": rates,
            }));
        }
    }
    if let Some(path) = &args.json {
        let out = json!({
            "table": args.table, "model": args.model, "backend": args.backend, "samples": n,
            "samples_per_request": args.samples_per_request,
            "offline_samples_per_s": offline, "offline_rounds_samples_per_s": offline_rounds,
            "offline_with_start_samples_per_s": offline_process,
            "phases": phases, "summary": summary,
        });
        std::fs::write(path, serde_json::to_string_pretty(&out).unwrap()).unwrap();
    }
}

/// The largest difference between an `/embed` answer's embeddings and
/// `reference`'s (offline `aam-rs embed`), over max(|offline value|, 1).
fn difference(body: &str, reference: &std::collections::HashMap<String, Vec<f64>>) -> f64 {
    let answer: serde_json::Value = serde_json::from_str(body).expect("an /embed answer");
    let mut largest = 0f64;
    for e in answer["embeddings"].as_array().expect("embeddings") {
        let id = e["id"].as_str().expect("an ID");
        let offline = &reference[id];
        for (served, offline) in e["embedding"]
            .as_array()
            .expect("values")
            .iter()
            .zip(offline)
        {
            let served = served.as_f64().expect("a number");
            largest = largest.max((served - offline).abs() / offline.abs().max(1.0));
        }
    }
    largest
}

/// Steady load for `--soak-minutes`: request `k` leaves at `k / rate`
/// seconds (whichever client is free), and every interval reports the
/// server's resident memory and the interval's answers.
fn soak(args: &Args, addr: &str, pid: u32, bodies: Arc<Vec<String>>) {
    let total = (args.soak_minutes * 60.0 * args.soak_rate) as usize;
    let duration = Duration::from_secs_f64(args.soak_minutes * 60.0);
    let start = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    // (latency in seconds, status) of the requests answered since the last report
    let answers = Arc::new(std::sync::Mutex::new(Vec::<(f64, u16)>::new()));
    let clients: Vec<_> = (0..args.soak_clients.max(1))
        .map(|_| {
            let (addr, bodies, next, answers) = (
                addr.to_string(),
                bodies.clone(),
                next.clone(),
                answers.clone(),
            );
            let rate = args.soak_rate;
            std::thread::spawn(move || loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                // A server slower than the rate gets the clients' concurrency
                // until the time is up, not a backlog past it.
                if k >= total || start.elapsed() >= duration {
                    break;
                }
                let due = Duration::from_secs_f64(k as f64 / rate);
                if let Some(wait) = due.checked_sub(start.elapsed()) {
                    std::thread::sleep(wait);
                }
                let t = Instant::now();
                let (status, _) = http(&addr, "POST", "/embed", &bodies[k % bodies.len()]);
                let latency = t.elapsed().as_secs_f64();
                answers.lock().unwrap().push((latency, status));
            })
        })
        .collect();
    let rss_mib = || {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|t| {
                t.lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))
                    .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            })
            .map_or(f64::NAN, |kib| kib / 1024.0)
    };
    let mut csv = String::from("seconds,rss_mib,answered,errors,p50_ms,p99_ms\n");
    println!(
        "soak: {total} requests at {} a second for {} min, {} clients",
        args.soak_rate, args.soak_minutes, args.soak_clients
    );
    let mut done = false;
    while !done {
        std::thread::sleep(Duration::from_secs(args.soak_interval.max(1)));
        done = clients.iter().all(|c| c.is_finished());
        let mut interval: Vec<(f64, u16)> = std::mem::take(&mut *answers.lock().unwrap());
        let errors = interval.iter().filter(|a| a.1 != 200).count();
        interval.sort_by(|a, b| a.0.total_cmp(&b.0));
        let pct = |p: f64| {
            interval
                .get(((interval.len() as f64 * p) as usize).min(interval.len().saturating_sub(1)))
                .map_or(f64::NAN, |a| 1e3 * a.0)
        };
        let (seconds, rss) = (start.elapsed().as_secs_f64(), rss_mib());
        println!(
            "{seconds:7.0} s: RSS {rss:8.1} MiB, {:5} answered, {errors} errors, p50 {:8.2} ms, p99 {:8.2} ms",
            interval.len(),
            pct(0.5),
            pct(0.99)
        );
        csv.push_str(&format!(
            "{seconds:.0},{rss:.1},{},{errors},{:.2},{:.2}\n",
            interval.len(),
            pct(0.5),
            pct(0.99)
        ));
        if let Some(path) = &args.soak_csv {
            std::fs::write(path, &csv).expect("writes the soak CSV");
        }
    }
    for c in clients {
        c.join().unwrap();
    }
}

/// The median of `values` (the mean of the middle two for an even count).
fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// (sum, count) of `aam_inference_duration_seconds`.
fn inference(addr: &str) -> (f64, f64) {
    let (_, text) = http(addr, "GET", "/metrics", "");
    let value = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    };
    (
        value("aam_inference_duration_seconds_sum "),
        value("aam_inference_duration_seconds_count "),
    )
}

/// A BIOM 1.0 (JSON, sparse) table of `samples`.
fn biom_json(samples: &[SampleReads]) -> String {
    let mut rows: Vec<&str> = Vec::new();
    let mut row_of = std::collections::HashMap::new();
    let mut data = Vec::new();
    for (c, s) in samples.iter().enumerate() {
        for (q, reads) in &s.reads {
            let r = *row_of.entry(q.as_str()).or_insert_with(|| {
                rows.push(q.as_str());
                rows.len() - 1
            });
            data.push(json!([r, c, reads]));
        }
    }
    json!({
        "id": null, "format": "1.0.0", "type": "OTU table",
        "matrix_type": "sparse", "matrix_element_type": "float",
        "shape": [rows.len(), samples.len()],
        "rows": rows.iter().map(|q| json!({"id": q, "metadata": null})).collect::<Vec<_>>(),
        "columns": samples.iter().map(|s| json!({"id": s.id, "metadata": null})).collect::<Vec<_>>(),
        "data": data,
    })
    .to_string()
}

/// `{"samples": [...]}` with each sample's ASVs in table order.
fn request_json(samples: &[SampleReads]) -> String {
    let samples: Vec<String> = samples
        .iter()
        .map(|s| {
            let reads: Vec<String> = s
                .reads
                .iter()
                .map(|(q, n)| format!("[\"{q}\",{n}]"))
                .collect();
            format!(
                "{{\"id\":{},\"counts\":[{}]}}",
                serde_json::Value::from(s.id.clone()),
                reads.join(",")
            )
        })
        .collect();
    format!("{{\"samples\":[{}]}}", samples.join(","))
}

/// One HTTP/1.1 request on a fresh connection: (status, body).
fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut stream = std::net::TcpStream::connect(addr).expect("connects");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").expect("a response head");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status");
    (status, rest.to_string())
}
