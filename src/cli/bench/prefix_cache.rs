//! `quarry bench prefix-cache`: a request whose long prefix another request left in the cache
//! skips computing it. Each round sends a request with a fresh --prefix-len prefix (cold),
//! then another with the same prefix and a different ending (warm), and reports the time to
//! first token of both, and the same warm request with prefix caching turned off.

use clap::Args;
use serde_json::json;

use super::{bench_prompt, median};
use crate::cli::ModelArgs;
use crate::engine::{EngineConfig, EngineCore, EngineRequest};
use crate::runtime::Backend;
use crate::sampling::SamplingParams;

#[derive(Args)]
pub struct PrefixCacheArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value_t = 1000)]
    prefix_len: usize,
    /// Tokens after the shared prefix, different in every request.
    #[arg(long, default_value_t = 24)]
    suffix_len: usize,
    /// Timed rounds after one warm-up; medians are reported.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(args: PrefixCacheArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.prefix_len > 0 && args.suffix_len > 0,
        "--prefix-len and --suffix-len must be at least 1"
    );
    let (backend, tokenizer, config) = args.model.load_shared()?;
    let device = backend.device_name();
    let vocab = tokenizer.vocab_size();
    let no_cache = EngineConfig {
        prefix_caching: false,
        ..config
    };
    let mut backend: Option<Box<dyn Backend>> = Some(backend);
    let (mut cold, mut warm, mut uncached, mut cached_tokens) = (Vec::new(), Vec::new(), Vec::new(), 0);
    let mut next_id = 0u64;
    for round in 0..=args.rounds {
        let prefix = bench_prompt(args.prefix_len, vocab, 10_000 + round);
        let with_suffix = |k: usize| -> Vec<u32> {
            let suffix = bench_prompt(args.suffix_len, vocab, 20_000 + 3 * round + k);
            prefix.iter().chain(&suffix).copied().collect()
        };
        let mut engine = EngineCore::new(backend.take().expect("returned"), tokenizer.clone(), config);
        let (t_cold, _) = ttft(&mut engine, &mut next_id, with_suffix(0))?;
        let (t_warm, hit) = ttft(&mut engine, &mut next_id, with_suffix(1))?;
        // The same second request on an engine without prefix caching.
        let mut plain = EngineCore::new(engine.into_backend(), tokenizer.clone(), no_cache);
        let (t_plain, _) = ttft(&mut plain, &mut next_id, with_suffix(1))?;
        backend = Some(plain.into_backend());
        if round > 0 {
            cold.push(t_cold);
            warm.push(t_warm);
            uncached.push(t_plain);
            cached_tokens = hit;
        }
    }
    let (cold, warm, uncached) = (median(&mut cold), median(&mut warm), median(&mut uncached));
    if args.json {
        println!(
            "{}",
            json!({"engine": "quarry", "device": device, "prefix_len": args.prefix_len,
                "suffix_len": args.suffix_len, "cached_tokens": cached_tokens,
                "ttft_ms_cold": cold, "ttft_ms_warm": warm, "ttft_ms_no_prefix_caching": uncached,
                "speedup": uncached / warm})
        );
    } else {
        println!(
            "quarry bench prefix-cache: {}-token shared prefix + {}-token suffix, {device} (median of {} rounds)",
            args.prefix_len, args.suffix_len, args.rounds
        );
        println!("{:<44}{:>14}{:>10}", "request", "cached tokens", "TTFT ms");
        println!("{:<44}{:>14}{:>10.1}", "first with the prefix (cold)", 0, cold);
        println!(
            "{:<44}{:>14}{:>10.1}",
            "second with the prefix (warm)", cached_tokens, warm
        );
        println!("{:<44}{:>14}{:>10.1}", "second, prefix caching off", 0, uncached);
        println!("TTFT speedup from the prefix cache: {:.1}x", uncached / warm);
    }
    Ok(())
}

/// Runs one request to its first token; returns the TTFT in ms and its cached prompt tokens.
fn ttft(engine: &mut EngineCore, next_id: &mut u64, prompt: Vec<u32>) -> anyhow::Result<(f64, usize)> {
    *next_id += 1;
    engine.add_request(EngineRequest {
        id: *next_id,
        prompt,
        params: SamplingParams::greedy(1),
        priority: 0,
        constraint: None,
    })?;
    let c = engine.run_until_idle(|_| {})?.remove(0);
    Ok((c.metrics.ttft.as_secs_f64() * 1e3, c.metrics.cached_tokens))
}
