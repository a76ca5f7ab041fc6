//! `quarry bench single`: single-stream prefill and decode speed. scripts/bench-cpu runs it
//! beside llama-cpp-python on the same tokens and prints both with their ratio.

use clap::Args;

use super::{bench_prompt, fixed_length, median};
use crate::cli::ModelArgs;

#[derive(Args)]
pub struct SingleArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[arg(long, default_value_t = 256)]
    input_len: usize,
    #[arg(long, default_value_t = 128)]
    output_len: usize,
    /// Timed repetitions after one warm-up; the median is reported.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(args: SingleArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.output_len >= 2, "--output-len must be at least 2");
    let (mut engine, tokenizer) = args.model.engine()?;
    let device = engine.backend().device_name();
    let prompt = bench_prompt(args.input_len, tokenizer.vocab_size(), 0);
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    for rep in 0..=args.repeats {
        // Each repeat differs in its first token, so none finds the others' prefix cached.
        let first = std::iter::once(rep as u32 + 1);
        let prompt = first.chain(prompt[1..].iter().copied()).collect();
        engine.add_request(fixed_length(rep as u64, prompt, args.output_len))?;
        let c = engine.run_until_idle(|_| {})?.remove(0);
        let m = &c.metrics;
        if rep > 0 {
            prefill.push(args.input_len as f64 / m.ttft.as_secs_f64());
            decode.push((c.tokens.len() - 1) as f64 / m.e2e.saturating_sub(m.ttft).as_secs_f64());
        }
    }
    let (p, d) = (median(&mut prefill), median(&mut decode));
    if args.json {
        println!(
            "{}",
            serde_json::json!({"engine": "quarry", "device": device, "input_len": args.input_len,
                "output_len": args.output_len, "prefill_tok_s": p, "decode_tok_s": d})
        );
    } else {
        println!("engine  device  input  output  prefill tok/s  decode tok/s");
        println!(
            "quarry  {device}  {}  {}  {p:.1}  {d:.1}",
            args.input_len, args.output_len
        );
    }
    Ok(())
}
