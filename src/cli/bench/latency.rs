//! `quarry bench latency`: how long one batch of requests takes from submission to the last
//! token, over several iterations (as `vllm bench latency`).

use clap::Args;
use serde_json::json;

use super::{bench_prompt, fixed_length, percentile};
use crate::cli::ModelArgs;

#[derive(Args)]
pub struct LatencyArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    #[arg(long, default_value_t = 32)]
    input_len: usize,
    #[arg(long, default_value_t = 128)]
    output_len: usize,
    /// Timed iterations, after one warm-up.
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(args: LatencyArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.batch_size > 0 && args.iters > 0,
        "--batch-size and --iters must be at least 1"
    );
    let (mut engine, tokenizer) = args.model.engine()?;
    let device = engine.backend().device_name();
    let mut seconds = Vec::new();
    for iter in 0..=args.iters {
        let started = std::time::Instant::now();
        for b in 0..args.batch_size {
            let id = (iter * args.batch_size + b) as u64;
            // A fresh prompt every time: no iteration finds another's prefix cached.
            let prompt = bench_prompt(args.input_len, tokenizer.vocab_size(), id as usize);
            engine.add_request(fixed_length(id, prompt, args.output_len))?;
        }
        engine.run_until_idle(|_| {})?;
        if iter > 0 {
            seconds.push(started.elapsed().as_secs_f64());
        }
    }
    let mean = seconds.iter().sum::<f64>() / seconds.len() as f64;
    let (p50, p90, p99) = (
        percentile(&mut seconds, 50.0),
        percentile(&mut seconds, 90.0),
        percentile(&mut seconds, 99.0),
    );
    if args.json {
        println!(
            "{}",
            json!({"engine": "quarry", "device": device, "batch_size": args.batch_size,
                "input_len": args.input_len, "output_len": args.output_len, "iters": args.iters,
                "latency_s_mean": mean, "latency_s_p50": p50, "latency_s_p90": p90, "latency_s_p99": p99})
        );
    } else {
        println!(
            "quarry bench latency: batch {}, {} input, {} output tokens, {} iterations, {device}",
            args.batch_size, args.input_len, args.output_len, args.iters
        );
        println!("latency s: mean {mean:.3}  p50 {p50:.3}  p90 {p90:.3}  p99 {p99:.3}");
    }
    Ok(())
}
