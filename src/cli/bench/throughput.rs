//! `quarry bench throughput`: every request at once through the engine, against the
//! single-stream decode rate of the same binary. With `--workload extract` the requests are
//! extraction prompts (schema and a synthetic invoice) constrained by the schema, and the same
//! prompts run again unconstrained with each request's output length fixed to what the
//! constrained run produced, so the two passes do exactly the same amount of model work. With
//! `--speculative-tokens` the main pass runs again with speculative decoding, beside the same
//! pass without it, with each proposer's drafts checked and kept.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::{Args, ValueEnum};
use serde_json::{json, Value};

use super::jobs::{self, Job};
use super::{bench_prompt, median, percentile};
use crate::cli::ModelArgs;
use crate::engine::{DraftCounts, EngineConfig};
use crate::runtime::cpu::Prefault;
use crate::runtime::Backend;
use crate::tokenizer::Tokenizer;

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Workload {
    /// Prompts of ordinary token ids, exactly --input-len and --output-len tokens each.
    Random,
    /// Schema-constrained extraction from synthetic invoices of --input-len tokens.
    Extract,
}

#[derive(Args)]
pub struct ThroughputArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value_t = 32)]
    num_prompts: usize,
    /// Prompt tokens (random) or document tokens (extract).
    #[arg(long, default_value_t = 400)]
    input_len: usize,
    /// Output tokens (random), or the most an answer may take (extract).
    #[arg(long, default_value_t = 100)]
    output_len: usize,
    #[arg(long, value_enum, default_value = "random")]
    workload: Workload,
    /// Context-aware decoding's weight for extractions [default: `quarry extract`'s]; 0 turns
    /// it off, and with it each request's second row per token.
    #[arg(long)]
    contrast: Option<f32>,
    /// Write each request (prompt token ids and output length) as JSON lines, so a peer can
    /// serve exactly the same work (scripts/bench-throughput).
    #[arg(long)]
    save_requests: Option<PathBuf>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// What one pass measured.
struct Pass {
    name: &'static str,
    requests: usize,
    prompt_tokens: usize,
    cached_tokens: usize,
    output_tokens: usize,
    forced_tokens: usize,
    seconds: f64,
    ttft_ms: Vec<f64>,
    itl_ms: Vec<f64>,
    /// Output tokens of each request, in job order.
    lengths: Vec<usize>,
    drafts: DraftCounts,
    /// The outputs, to check that speculation changed none.
    outputs: Vec<Vec<u32>>,
}

impl Pass {
    fn output_tok_s(&self) -> f64 {
        self.output_tokens as f64 / self.seconds
    }

    fn to_json(&self) -> Value {
        let (mut ttft, mut itl) = (self.ttft_ms.clone(), self.itl_ms.clone());
        json!({
            "pass": self.name, "requests": self.requests, "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens, "output_tokens": self.output_tokens,
            "forced_tokens": self.forced_tokens, "seconds": self.seconds,
            "requests_per_s": self.requests as f64 / self.seconds, "output_tok_s": self.output_tok_s(),
            "total_tok_s": (self.prompt_tokens + self.output_tokens) as f64 / self.seconds,
            "ttft_ms_p50": percentile(&mut ttft, 50.0), "ttft_ms_p99": percentile(&mut ttft, 99.0),
            "itl_ms_p50": percentile(&mut itl, 50.0), "itl_ms_p99": percentile(&mut itl, 99.0),
            "drafts": drafts_json(&self.drafts),
        })
    }
}

/// The least output budget of an extraction request: an invoice answer runs to ~150 tokens, so
/// a smaller --output-len would truncate them all.
const MIN_ANSWER_TOKENS: usize = 160;

pub fn run(mut args: ThroughputArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.num_prompts > 0, "--num-prompts must be at least 1");
    anyhow::ensure!(args.output_len >= 2, "--output-len must be at least 2");
    // A pool the size of the workload (every request at once, with room for an extraction
    // prompt's schema and instructions), backed before the clock starts: the passes then
    // time the engine, and the first pass does not pay the kernel for zeroing fresh pages.
    if args.model.kv_cache_tokens.is_none() && args.model.kv_cache_memory.is_none() {
        args.model.kv_cache_tokens =
            Some(args.num_prompts * (args.input_len + args.output_len.max(MIN_ANSWER_TOKENS) + 1024));
    }
    args.model.prefault_kv = Prefault::AtLoad;
    let mut draft = args.model.draft_model()?;
    let (backend, tokenizer, config) = args.model.load_shared()?;
    if let Some(d) = &draft {
        crate::cli::check_draft(&**d, &tokenizer)?;
    }
    let device = backend.device_name();
    let jobs = jobs(&args, &tokenizer)?;
    let speculative = config.speculative.is_some();
    let plain = EngineConfig {
        speculative: None,
        ..config
    };
    let mut backend = Some(backend);
    let mut pass = |name, config: EngineConfig, jobs: &[Job]| -> anyhow::Result<Pass> {
        let (p, b) = run_pass(
            name,
            backend.take().expect("returned"),
            &tokenizer,
            config,
            jobs,
            &mut draft,
        )?;
        backend = Some(b);
        Ok(p)
    };

    // Warm-up (page in the weights, start the thread pool), then the single-stream rate: one
    // unconstrained request of the first prompt alone, decoding --output-len tokens.
    let lone = |variant: usize| Job {
        prompt: match args.workload {
            Workload::Random => bench_prompt(args.input_len, tokenizer.vocab_size(), 1000 + variant),
            Workload::Extract => jobs[variant % jobs.len()].prompt.clone(),
        },
        max_tokens: args.output_len,
        params: None,
        constraint: None,
    };
    pass("warm-up", plain, &[lone(0)])?;
    let mut decode = Vec::new();
    for variant in 0..3 {
        let p = pass("single", plain, &[lone(variant)])?;
        let decode_ms = p.itl_ms.iter().sum::<f64>();
        decode.push(p.itl_ms.len() as f64 / (decode_ms / 1e3));
    }
    let single_decode = median(&mut decode);

    let mut passes = vec![pass("concurrent", plain, &jobs)?];
    if speculative {
        passes.push(pass("concurrent, speculative", config, &jobs)?);
    }
    if args.workload == Workload::Extract {
        // The same work without the grammar: each request decodes exactly as many tokens.
        let lengths = passes[0].lengths.clone();
        let free: Vec<Job> = jobs
            .iter()
            .zip(&lengths)
            .map(|(j, &n)| Job {
                prompt: j.prompt.clone(),
                max_tokens: n,
                params: j.params.clone(),
                constraint: None,
            })
            .collect();
        passes[0].name = "concurrent, constrained";
        if speculative {
            passes[1].name = "constrained, speculative";
        }
        passes.push(pass("concurrent, unconstrained", plain, &free)?);
    }
    if let Some(path) = &args.save_requests {
        let lines: Vec<String> = jobs
            .iter()
            .zip(&passes[0].lengths)
            .map(|(j, &n)| json!({"prompt": j.prompt, "max_tokens": n}).to_string())
            .collect();
        std::fs::write(path, lines.join("\n") + "\n").map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    }
    report(&args, &device, single_decode, &passes);
    Ok(())
}

fn jobs(args: &ThroughputArgs, tokenizer: &Tokenizer) -> anyhow::Result<Vec<Job>> {
    match args.workload {
        Workload::Random => Ok(jobs::random(
            args.num_prompts,
            args.input_len,
            args.output_len,
            tokenizer,
        )),
        Workload::Extract => jobs::invoices(
            args.num_prompts,
            args.input_len,
            args.output_len.max(MIN_ANSWER_TOKENS),
            args.contrast,
            tokenizer,
        ),
    }
}

/// Every job at once on a fresh engine (an empty prefix cache); returns the backend too.
fn run_pass(
    name: &'static str,
    backend: Box<dyn Backend>,
    tokenizer: &Arc<Tokenizer>,
    config: EngineConfig,
    jobs: &[Job],
    draft: &mut Option<Box<dyn Backend>>,
) -> anyhow::Result<(Pass, Box<dyn Backend>)> {
    let mut engine = jobs::engine(backend, tokenizer, config, draft);
    let started = Instant::now();
    for (i, j) in jobs.iter().enumerate() {
        engine.add_request(j.request(i as u64))?;
    }
    let done = engine.run_until_idle(|_| {})?;
    let seconds = started.elapsed().as_secs_f64();
    let steps = engine.stats().steps;
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    let pass = Pass {
        name,
        requests: done.len(),
        prompt_tokens: done.iter().map(|c| c.metrics.prompt_tokens).sum(),
        cached_tokens: done.iter().map(|c| c.metrics.cached_tokens).sum(),
        output_tokens: done.iter().map(|c| c.tokens.len()).sum(),
        forced_tokens: done.iter().map(|c| c.metrics.forced_tokens).sum(),
        seconds,
        ttft_ms: done.iter().map(|c| ms(c.metrics.ttft)).collect(),
        itl_ms: done.iter().flat_map(|c| c.metrics.itl.iter().map(|&d| ms(d))).collect(),
        lengths: done.iter().map(|c| c.tokens.len()).collect(),
        drafts: done.iter().fold(DraftCounts::default(), |mut d, c| {
            d.add(&c.metrics.drafts);
            d
        }),
        outputs: done.into_iter().map(|c| c.tokens).collect(),
    };
    let mut backend = jobs::into_backend(engine, draft);
    // Where each pass's device time went, apart (QUARRY_CUDA_TIMING).
    if let Some(report) = backend.take_timing_report() {
        eprintln!("{name}: {steps} engine steps\n{report}");
    }
    Ok((pass, backend))
}

/// How many outputs of two runs of the same requests differ. Speculation changes no output
/// where a row's numbers do not depend on the batch (the CPU backend, where a difference is a
/// bug); on the GPU a batch's shape can move a near-tie.
pub fn differing(a: &[Vec<u32>], b: &[Vec<u32>]) -> usize {
    a.iter().zip(b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len())
}

/// The line that says whether speculation changed outputs.
pub fn same_outputs_line(differ: usize, total: usize) -> String {
    match differ {
        0 => format!("the same {total} outputs"),
        n => format!("{n} of {total} outputs differ (a near-tie the batch's shape moved, on a GPU; a bug on the CPU)"),
    }
}

/// Each proposer's drafts checked and kept, and the rate.
pub fn drafts_json(d: &DraftCounts) -> Value {
    let rate = |kept: usize, proposed: usize| (proposed > 0).then(|| kept as f64 / proposed as f64);
    json!({
        "ngram": {"proposed": d.ngram_proposed, "accepted": d.ngram_accepted,
            "rate": rate(d.ngram_accepted, d.ngram_proposed)},
        "grammar": {"proposed": d.grammar_proposed, "accepted": d.grammar_accepted,
            "rate": rate(d.grammar_accepted, d.grammar_proposed)},
        "model": {"proposed": d.model_proposed, "accepted": d.model_accepted,
            "rate": rate(d.model_accepted, d.model_proposed)},
        "checks": d.checks,
        "mean_accepted": (d.checks > 0).then(|| d.accepted() as f64 / d.checks as f64),
    })
}

/// One line per proposer that proposed: drafts checked, kept, the rate; and the mean run of
/// drafts kept per check.
pub fn print_drafts(what: &str, d: &DraftCounts) {
    for (name, proposed, kept) in [
        ("prompt lookup", d.ngram_proposed, d.ngram_accepted),
        ("grammar", d.grammar_proposed, d.grammar_accepted),
        ("draft model", d.model_proposed, d.model_accepted),
    ] {
        if proposed > 0 {
            println!(
                "{what}: {name} drafts {proposed} checked, {kept} kept ({:.1}%)",
                100.0 * kept as f64 / proposed as f64
            );
        }
    }
    if d.checks > 0 {
        println!(
            "{what}: {:.2} drafts kept per check ({} checks)",
            d.accepted() as f64 / d.checks as f64,
            d.checks
        );
    }
}

fn report(args: &ThroughputArgs, device: &str, single_decode: f64, passes: &[Pass]) {
    let concurrent = passes[0].output_tok_s();
    let speculative = passes.iter().find(|p| p.name.ends_with("speculative"));
    let free = passes.iter().find(|p| p.name.ends_with("unconstrained"));
    let constrained_ratio = free.map(|free| concurrent / free.output_tok_s());
    let speculative_ratio = speculative.map(|s| s.output_tok_s() / concurrent);
    let differ = speculative.map(|s| differing(&s.outputs, &passes[0].outputs));
    if args.json {
        println!(
            "{}",
            json!({"engine": "quarry", "device": device, "num_prompts": args.num_prompts,
                "input_len": args.input_len, "output_len": args.output_len,
                "single_decode_tok_s": single_decode,
                "passes": passes.iter().map(Pass::to_json).collect::<Vec<_>>(),
                "concurrent_over_single": concurrent / single_decode,
                "constrained_over_unconstrained": constrained_ratio,
                "speculative_over_plain": speculative_ratio, "speculative_outputs_differing": differ})
        );
        return;
    }
    println!(
        "quarry bench throughput: {} requests, {} input tokens, {} output tokens, {device}",
        args.num_prompts, args.input_len, args.output_len
    );
    println!("single-stream decode: {single_decode:.1} tok/s");
    println!(
        "{:<28}{:>9}{:>9}{:>9}{:>9}{:>9}{:>9}{:>10}{:>10}{:>10}{:>10}",
        "pass", "prompt", "cached", "output", "forced", "s", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50"
    );
    for p in passes {
        let v = p.to_json();
        println!(
            "{:<28}{:>9}{:>9}{:>9}{:>9}{:>9.2}{:>9.2}{:>10.1}{:>10.0}{:>10.0}{:>10.1}",
            p.name,
            p.prompt_tokens,
            p.cached_tokens,
            p.output_tokens,
            p.forced_tokens,
            p.seconds,
            v["requests_per_s"].as_f64().unwrap_or(0.0),
            p.output_tok_s(),
            v["ttft_ms_p50"].as_f64().unwrap_or(0.0),
            v["ttft_ms_p99"].as_f64().unwrap_or(0.0),
            v["itl_ms_p50"].as_f64().unwrap_or(0.0),
        );
    }
    println!(
        "concurrent output tok/s / single-stream decode: {:.2}",
        concurrent / single_decode
    );
    if let Some(r) = constrained_ratio {
        println!("constrained / unconstrained output tok/s: {r:.2}");
    }
    if let (Some(r), Some(s)) = (speculative_ratio, speculative) {
        println!(
            "speculative / without output tok/s: {r:.2}; {}",
            same_outputs_line(differ.unwrap_or(0), s.outputs.len())
        );
        print_drafts("speculative", &s.drafts);
    }
}
