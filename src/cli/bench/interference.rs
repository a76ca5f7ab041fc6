//! `quarry bench interference`: what long prompts arriving do to the requests decoding beside
//! them. `--decoders` requests decode all the time (each replaced by a new one as it ends)
//! while a long prompt arrives every `--arrival-interval` seconds; the decoders' inter-token
//! latency (ITL) over the measured window, and the arrivals' time to first token, are the
//! figures. On one engine a prompt's prefill chunks share steps with the decoders and stretch
//! them; with `--prefill-device` and `--decode-device` (disaggregated serving) the prompts are
//! computed elsewhere and only their KV blocks reach the decode engine. `--arrival-interval 0`
//! gives the decoders' ITL alone, the baseline.
//!
//! Times come from the engine's own per-request metrics (the time to the first token and each
//! token's gap), placed in time from the request's submission.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use serde_json::json;

use super::{bench_prompt, fixed_length, percentile};
use crate::cli::ModelArgs;
use crate::engine::{EngineClient, RequestMetrics};

#[derive(Args)]
pub struct InterferenceArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Requests decoding at once, all the time.
    #[arg(long, default_value_t = 64)]
    decoders: usize,
    #[arg(long, default_value_t = 512)]
    decode_input: usize,
    #[arg(long, default_value_t = 512)]
    decode_output: usize,
    /// Prompt tokens of each arriving request.
    #[arg(long, default_value_t = 8192)]
    arrival_input: usize,
    #[arg(long, default_value_t = 64)]
    arrival_output: usize,
    /// Seconds between arrivals; 0: none (the decoders' ITL alone).
    #[arg(long, default_value_t = 0.5)]
    arrival_interval: f64,
    /// Seconds measured, after the warm-up.
    #[arg(long, default_value_t = 120.0)]
    duration: f64,
    /// Seconds of decoding before the window opens (the decoders' own prefills, graphs).
    #[arg(long, default_value_t = 15.0)]
    warmup: f64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// Each token's time, from a request's submission and its metrics: the first at `ttft`, then
/// one gap after another.
fn token_times(submitted: Instant, m: &RequestMetrics) -> Vec<(Instant, Option<Duration>)> {
    let mut at = submitted + m.ttft;
    let mut times = vec![(at, None)];
    for &gap in &m.itl {
        at += gap;
        times.push((at, Some(gap)));
    }
    times
}

#[derive(Default)]
struct Seen {
    /// Decoders' gaps between tokens, in ms, for tokens inside the window.
    itl_ms: Vec<f64>,
    /// Arrivals' time to first token, in s, for those that arrived inside the window.
    ttft_s: Vec<f64>,
    /// Tokens produced inside the window, by decoders and arrivals.
    tokens: usize,
    arrivals: usize,
    failed: usize,
}

pub fn run(args: InterferenceArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.duration > 0.0 && args.warmup >= 0.0, "--duration must be positive");
    let (client, tokenizer, device) = args.model.client()?;
    let client = Arc::new(client);
    let vocab = tokenizer.vocab_size();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let start = Instant::now();
    let window = (
        start + Duration::from_secs_f64(args.warmup),
        start + Duration::from_secs_f64(args.warmup + args.duration),
    );
    let inside = move |t: Instant| t >= window.0 && t < window.1;
    runtime.block_on(async {
        let mut tasks = tokio::task::JoinSet::new();
        for d in 0..args.decoders {
            let (client, seen) = (client.clone(), seen.clone());
            let (input, output) = (args.decode_input, args.decode_output);
            tasks.spawn(async move {
                let mut round = 0;
                while Instant::now() < window.1 {
                    let prompt = bench_prompt(input, vocab, 1 + d + round * 1000);
                    round += 1;
                    let Some(m) = finish(&client, fixed_length(0, prompt, output)).await else {
                        seen.lock().unwrap().failed += 1;
                        // A refusal comes at once: not a loop that starves the runtime.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    };
                    let (submitted, m) = m;
                    let mut s = seen.lock().unwrap();
                    for (t, gap) in token_times(submitted, &m) {
                        if inside(t) {
                            s.tokens += 1;
                            if let Some(g) = gap {
                                s.itl_ms.push(g.as_secs_f64() * 1e3);
                            }
                        }
                    }
                }
            });
        }
        if args.arrival_interval > 0.0 {
            let interval = Duration::from_secs_f64(args.arrival_interval);
            let mut next = window.0;
            let mut n = 0;
            while next < window.1 {
                tokio::time::sleep_until(next.into()).await;
                let (client, seen) = (client.clone(), seen.clone());
                let prompt = bench_prompt(args.arrival_input, vocab, 1_000_000 + n);
                n += 1;
                let output = args.arrival_output;
                tasks.spawn(async move {
                    let Some((submitted, m)) = finish(&client, fixed_length(0, prompt, output)).await else {
                        seen.lock().unwrap().failed += 1;
                        return;
                    };
                    let mut s = seen.lock().unwrap();
                    s.arrivals += 1;
                    s.ttft_s.push(m.ttft.as_secs_f64());
                    s.tokens += token_times(submitted, &m).iter().filter(|(t, _)| inside(*t)).count();
                });
                next += interval;
            }
        }
        while let Some(r) = tasks.join_next().await {
            r?;
        }
        anyhow::Ok(())
    })?;
    let mut s = std::mem::take(&mut *seen.lock().unwrap());
    let stats = client.stats();
    let prefill = client.prefill_stats();
    let itl = [50.0, 90.0, 99.0].map(|p| percentile(&mut s.itl_ms, p));
    let ttft = [50.0, 99.0].map(|p| percentile(&mut s.ttft_s, p));
    let tok_s = s.tokens as f64 / args.duration;
    let mode = match (&prefill, args.model.tensor_parallel_size) {
        (Some(_), _) => "disaggregated".to_string(),
        (None, 1) => "one engine".to_string(),
        (None, n) => format!("one engine, tensor parallel {n}"),
    };
    if args.json {
        println!(
            "{}",
            json!({
                "device": device,
                "mode": mode,
                "decoders": args.decoders,
                "decode": [args.decode_input, args.decode_output],
                "arrival": [args.arrival_input, args.arrival_output],
                "arrival_interval_s": args.arrival_interval,
                "duration_s": args.duration,
                "itl_ms": {"p50": itl[0], "p90": itl[1], "p99": itl[2], "samples": s.itl_ms.len()},
                "arrivals": s.arrivals,
                "ttft_s": {"p50": ttft[0], "p99": ttft[1]},
                "output_tok_s": tok_s,
                "failed": s.failed,
                "kv_blocks_received": stats.kv_blocks_received,
                "kv_transfer_failures": stats.kv_transfer_failures + prefill.as_ref().map_or(0, |p| p.kv_transfer_failures),
                "preemptions": stats.preemptions,
            })
        );
        return Ok(());
    }
    println!("{device}: {mode}");
    println!(
        "{} decoders ({} -> {}), a {}-token prompt ({} out) every {} s, {} s measured after {} s",
        args.decoders,
        args.decode_input,
        args.decode_output,
        args.arrival_input,
        args.arrival_output,
        args.arrival_interval,
        args.duration,
        args.warmup
    );
    println!(
        "decode ITL ms: p50 {:.2}  p90 {:.2}  p99 {:.2}  ({} gaps)",
        itl[0],
        itl[1],
        itl[2],
        s.itl_ms.len()
    );
    println!(
        "arrivals: {} done, TTFT s p50 {:.3}  p99 {:.3}; output {tok_s:.0} tok/s; {} failed; KV blocks received {}",
        s.arrivals, ttft[0], ttft[1], s.failed, stats.kv_blocks_received
    );
    Ok(())
}

/// Submits `request` and waits for its end: when it was submitted and its metrics, or `None`
/// where it was refused or did not finish normally.
async fn finish(client: &EngineClient, request: crate::engine::EngineRequest) -> Option<(Instant, RequestMetrics)> {
    let submitted = Instant::now();
    let done = client.submit(request).await.ok()?.collect().await?;
    matches!(
        done.finish,
        crate::engine::FinishReason::Length | crate::engine::FinishReason::Stop
    )
    .then_some((submitted, done.metrics))
}
