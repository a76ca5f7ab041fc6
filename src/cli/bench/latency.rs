//! `quarry bench latency`: how long one batch of requests takes from submission to the last
//! token, over several iterations (as `vllm bench latency`). `--workload extract` sends
//! extractions (synthetic invoices, or the cases of `--cases`) as `quarry extract` asks them.
//! With `--speculative-tokens` the same iterations run again with speculative decoding, beside
//! the run without it: the outputs are compared, and each proposer's drafts are counted.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use serde_json::json;

use super::jobs::{self, Job};
use super::percentile;
use super::throughput::{differing, drafts_json, print_drafts, same_outputs_line, Workload};
use crate::cli::ModelArgs;
use crate::engine::proposers::NgramProposer;
use crate::engine::{DraftCounts, EngineConfig};
use crate::runtime::Backend;
use crate::tokenizer::Tokenizer;

/// Drafts a step in the replay that bounds prompt lookup's speed-up.
const LOOKUP_CEILING_DRAFTS: usize = 8;

#[derive(Args)]
pub struct LatencyArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Prompt tokens (random) or document tokens (synthetic invoices).
    #[arg(long, default_value_t = 32)]
    input_len: usize,
    /// Output tokens (random), or the most an answer may take (extract).
    #[arg(long, default_value_t = 128)]
    output_len: usize,
    /// Timed iterations, after one warm-up.
    #[arg(long, default_value_t = 10)]
    iters: usize,
    #[arg(long, value_enum, default_value = "random")]
    workload: Workload,
    /// Extraction cases (JSONL, `{schema, document}` per line, as `bench quality` reads)
    /// instead of synthetic invoices; taken in turn, one per request.
    #[arg(long)]
    cases: Option<PathBuf>,
    /// Context-aware decoding's weight for the extractions [default: `quarry extract`'s];
    /// 0 turns it off, and with it each request's second row per token.
    #[arg(long)]
    contrast: Option<f32>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// What the iterations of one configuration measured.
struct Run {
    name: &'static str,
    seconds: Vec<f64>,
    output_tokens: usize,
    /// Of those, appended without the model (the grammar's forced text under jump-forward).
    forced_tokens: usize,
    /// Time to each request's first token, and from it to the last, summed over requests.
    ttft: f64,
    decode: f64,
    /// Output tokens after each request's first.
    decoded_tokens: usize,
    drafts: DraftCounts,
    outputs: Vec<Vec<u32>>,
    /// Engine steps of the timed iterations, those of them pipelined, and the forward passes
    /// replayed from CUDA graphs (the others ran kernel by kernel).
    steps: u64,
    pipelined_steps: u64,
    graph_steps: u64,
}

impl Run {
    fn output_tok_s(&self) -> f64 {
        self.output_tokens as f64 / self.seconds.iter().sum::<f64>()
    }

    /// Output tokens per second of one request's decoding (at batch 1, of the batch): after
    /// each request's first token, which waits for its prefill (and speculation cannot hasten).
    fn decode_tok_s(&self) -> f64 {
        self.decoded_tokens as f64 / self.decode.max(f64::MIN_POSITIVE)
    }

    fn requests(&self) -> usize {
        self.outputs.len().max(1)
    }

    fn to_json(&self) -> serde_json::Value {
        let mut s = self.seconds.clone();
        let mean = s.iter().sum::<f64>() / s.len() as f64;
        json!({"run": self.name, "latency_s_mean": mean, "latency_s_p50": percentile(&mut s, 50.0),
            "latency_s_p90": percentile(&mut s, 90.0), "latency_s_p99": percentile(&mut s, 99.0),
            "output_tokens": self.output_tokens, "output_tok_s": self.output_tok_s(),
            "forced_tokens": self.forced_tokens, "ttft_s_mean": self.ttft / self.requests() as f64,
            "decode_tok_s_per_request": self.decode_tok_s(), "drafts": drafts_json(&self.drafts),
            "steps": self.steps, "pipelined_steps": self.pipelined_steps,
            "graph_steps": self.graph_steps})
    }
}

pub fn run(args: LatencyArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.batch_size > 0 && args.iters > 0,
        "--batch-size and --iters must be at least 1"
    );
    let mut draft = args.model.draft_model()?;
    let (backend, tokenizer, config) = args.model.load_shared()?;
    if let Some(d) = &draft {
        crate::cli::check_draft(&**d, &tokenizer)?;
    }
    let device = backend.device_name();
    // Every iteration gets fresh requests (the warm-up's too): none finds another's prompt
    // cached, unless a case file has fewer cases than requests.
    let n = (args.iters + 1) * args.batch_size;
    let jobs = match (args.workload, &args.cases) {
        (Workload::Random, None) => jobs::random(n, args.input_len, args.output_len, &tokenizer),
        (Workload::Random, Some(_)) => anyhow::bail!("--cases goes with --workload extract"),
        (Workload::Extract, None) => jobs::invoices(n, args.input_len, args.output_len, args.contrast, &tokenizer)?,
        (Workload::Extract, Some(path)) => jobs::cases(path, args.output_len, args.contrast, &tokenizer)?,
    };
    let plain = EngineConfig {
        speculative: None,
        ..config
    };
    let (without, backend) = iterate(
        "without speculation",
        backend,
        &tokenizer,
        plain,
        &jobs,
        &args,
        &mut draft,
    )?;
    let mut runs = vec![without];
    if config.speculative.is_some() {
        let (with, _) = iterate("speculative", backend, &tokenizer, config, &jobs, &args, &mut draft)?;
        runs.push(with);
    }
    let ratio = runs.get(1).map(|s| s.output_tok_s() / runs[0].output_tok_s());
    let decode_ratio = runs.get(1).map(|s| s.decode_tok_s() / runs[0].decode_tok_s());
    let differ = runs.get(1).map(|s| differing(&s.outputs, &runs[0].outputs));
    // The workload's own bound on prompt lookup, from the outputs without speculation.
    // Timed too: a speculating step asks one lookup (or more) of every request, on the host.
    let (mut decoded, mut steps) = (0, 0);
    let lookup = NgramProposer::default();
    let replay = Instant::now();
    for (i, output) in runs[0].outputs.iter().enumerate() {
        let job = &jobs[(args.batch_size + i) % jobs.len()];
        decoded += output.len().saturating_sub(1);
        steps += lookup.replay_steps(&job.prompt, output, LOOKUP_CEILING_DRAFTS);
    }
    let lookup_us = replay.elapsed().as_secs_f64() * 1e6 / steps.max(1) as f64;
    if args.json {
        println!(
            "{}",
            json!({"engine": "quarry", "device": device, "batch_size": args.batch_size,
                "input_len": args.input_len, "output_len": args.output_len, "iters": args.iters,
                "runs": runs.iter().map(Run::to_json).collect::<Vec<_>>(),
                "speculative_over_plain": ratio, "speculative_over_plain_decode": decode_ratio,
                "speculative_outputs_differing": differ,
                "lookup_ceiling": {"drafts": LOOKUP_CEILING_DRAFTS, "steps": steps, "tokens": decoded,
                    "us_per_lookup": lookup_us}})
        );
        return Ok(());
    }
    println!(
        "quarry bench latency: batch {}, {} iterations, {device}",
        args.batch_size, args.iters
    );
    println!(
        "{:<22}{:>10}{:>10}{:>10}{:>10}{:>9}{:>12}{:>10}{:>12}",
        "run", "mean s", "p50 s", "p99 s", "output", "forced", "out tok/s", "ttft s", "dec t/s/req"
    );
    for r in &runs {
        let v = r.to_json();
        let f = |k: &str| v[k].as_f64().unwrap_or(0.0);
        println!(
            "{:<22}{:>10.3}{:>10.3}{:>10.3}{:>10}{:>9}{:>12.1}{:>10.3}{:>12.1}",
            r.name,
            f("latency_s_mean"),
            f("latency_s_p50"),
            f("latency_s_p99"),
            r.output_tokens,
            r.forced_tokens,
            r.output_tok_s(),
            f("ttft_s_mean"),
            r.decode_tok_s()
        );
    }
    if let (Some(r), Some(d)) = (ratio, decode_ratio) {
        println!(
            "speculative / without output tok/s: {r:.2} (decoding alone: {d:.2}); {}",
            same_outputs_line(differ.unwrap_or(0), runs[1].outputs.len())
        );
        print_drafts("speculative", &runs[1].drafts);
    }
    for r in runs.iter().filter(|r| r.pipelined_steps > 0) {
        println!("{}: {} of {} steps pipelined", r.name, r.pipelined_steps, r.steps);
    }
    for r in runs.iter().filter(|r| r.graph_steps > 0) {
        println!(
            "{}: {} of {} steps replayed from CUDA graphs",
            r.name, r.graph_steps, r.steps
        );
    }
    println!(
        "prompt lookup's ceiling (up to {LOOKUP_CEILING_DRAFTS} drafts checked at no cost every step): \
         {steps} steps for {decoded} tokens after the first, {:.2} tokens a step; {lookup_us:.1} us a \
         lookup on this host",
        decoded as f64 / steps.max(1) as f64
    );
    Ok(())
}

/// The warm-up and the timed iterations on a fresh engine; the backend comes back.
fn iterate(
    name: &'static str,
    backend: Box<dyn Backend>,
    tokenizer: &Arc<Tokenizer>,
    config: EngineConfig,
    jobs: &[Job],
    args: &LatencyArgs,
    draft: &mut Option<Box<dyn Backend>>,
) -> anyhow::Result<(Run, Box<dyn Backend>)> {
    let mut engine = jobs::engine(backend, tokenizer, config, draft);
    let mut run = Run {
        name,
        seconds: Vec::new(),
        output_tokens: 0,
        forced_tokens: 0,
        ttft: 0.0,
        decode: 0.0,
        decoded_tokens: 0,
        drafts: DraftCounts::default(),
        outputs: Vec::new(),
        steps: 0,
        pipelined_steps: 0,
        graph_steps: 0,
    };
    let mut warm = engine.stats();
    for iter in 0..=args.iters {
        if iter == 1 {
            warm = engine.stats();
        }
        let started = Instant::now();
        for b in 0..args.batch_size {
            let id = iter * args.batch_size + b;
            engine.add_request(jobs[id % jobs.len()].request(id as u64))?;
        }
        let mut done = engine.run_until_idle(|_| {})?;
        // In the order they were sent, not finished: runs are compared output by output.
        done.sort_by_key(|c| c.id);
        if iter > 0 {
            run.seconds.push(started.elapsed().as_secs_f64());
            for c in done {
                run.output_tokens += c.tokens.len();
                run.forced_tokens += c.metrics.forced_tokens;
                run.ttft += c.metrics.ttft.as_secs_f64();
                run.decode += c.metrics.e2e.saturating_sub(c.metrics.ttft).as_secs_f64();
                run.decoded_tokens += c.tokens.len().saturating_sub(1);
                run.drafts.add(&c.metrics.drafts);
                run.outputs.push(c.tokens);
            }
        }
    }
    let end = engine.stats();
    run.steps = end.steps - warm.steps;
    run.pipelined_steps = end.pipelined_steps - warm.pipelined_steps;
    run.graph_steps = end.graph_steps - warm.graph_steps;
    Ok((run, jobs::into_backend(engine, draft)))
}
