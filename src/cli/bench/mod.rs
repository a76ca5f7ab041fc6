//! `quarry bench`: the engine's speed, in the style of `vllm bench`, and extraction quality. Each subcommand prints a
//! table (or one JSON object with --json) that scripts/bench-* put beside a peer's numbers.

mod all_reduce;
mod calibration;
mod interference;
mod jobs;
mod latency;
mod prefix_cache;
mod quality;
mod score;
mod single;
mod throughput;
mod workload;

use clap::Subcommand;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// One request at a time: prefill tokens/s and decode tokens/s.
    Single(single::SingleArgs),
    /// Many requests at once: requests/s, output tokens/s, TTFT and ITL percentiles, against
    /// the single-stream decode rate of the same binary.
    Throughput(throughput::ThroughputArgs),
    /// End-to-end latency of one batch of requests, over several iterations.
    Latency(latency::LatencyArgs),
    /// Time to first token of a request whose long prefix another request left in the cache.
    PrefixCache(prefix_cache::PrefixCacheArgs),
    /// Extraction quality on cases with gold records: outcomes, validity, exact matches and
    /// field accuracy.
    Quality(quality::QualityArgs),
    /// NCCL's all-reduce across this machine's GPUs (the collective tensor parallelism runs
    /// after each layer's row-parallel products): latency and bandwidth by message size.
    AllReduce(all_reduce::AllReduceArgs),
    /// Decode latency while long prompts arrive: requests decoding all the time beside a long
    /// prompt every so often, on one engine or with prefill and decode on separate devices.
    Interference(interference::InterferenceArgs),
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Single(args) => single::run(args),
        BenchCommand::Throughput(args) => throughput::run(args),
        BenchCommand::Latency(args) => latency::run(args),
        BenchCommand::PrefixCache(args) => prefix_cache::run(args),
        BenchCommand::Quality(args) => quality::run(args),
        BenchCommand::AllReduce(args) => all_reduce::run(args),
        BenchCommand::Interference(args) => interference::run(args),
    }
}

/// The benchmark prompt: ordinary (non-special) token ids from a fixed formula, so any engine
/// can be fed exactly the same sequence. `variant` changes every token, so prompts of
/// different variants share no prefix.
pub fn bench_prompt(len: usize, vocab: usize, variant: usize) -> Vec<u32> {
    (0..len)
        .map(|i| (100 + (i * 7919 + variant * 104_729) % (vocab - 200)) as u32)
        .collect()
}

/// A greedy request that decodes exactly `output_len` tokens, end-of-generation or not.
fn fixed_length(id: u64, prompt: Vec<u32>, output_len: usize) -> crate::engine::EngineRequest {
    crate::engine::EngineRequest {
        id,
        prompt,
        params: crate::sampling::SamplingParams {
            ignore_eos: true,
            ..crate::sampling::SamplingParams::greedy(output_len)
        },
        priority: 0,
        constraint: None,
    }
}

fn median(v: &mut [f64]) -> f64 {
    percentile(v, 50.0)
}

/// Nearest-rank percentile; 0 for an empty sample.
fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}
