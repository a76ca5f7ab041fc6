use std::io::{BufRead, Write};
use std::path::PathBuf;

use clap::Args;

use super::ModelArgs;
use crate::engine::{EngineCore, EngineRequest};
use crate::sampling::{DryParams, SamplingParams};
use crate::tokenizer::{ChatMessage, Tokenizer};

#[derive(Args)]
#[command(allow_negative_numbers = true)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt text (streamed to stdout).
    #[arg(long, required_unless_present = "prompts", conflicts_with = "prompts")]
    prompt: Option<String>,
    /// Many prompts, one per line: a JSON string or {"prompt": "..."}; all run through the
    /// engine at once and print one JSON line each, in input order.
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Wrap each prompt in the model's chat template as a user message.
    #[arg(long)]
    chat: bool,
    /// System message for --chat (the template's default when absent).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long)]
    seed: Option<u64>,
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    /// Stop when this text appears (repeatable); it is not printed.
    #[arg(long)]
    stop: Vec<String>,
    /// Print the top-N log-probabilities of each token to stderr.
    #[arg(long)]
    logprobs: Option<usize>,
    /// Keep generating past end-of-generation tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// DRY penalty on tokens that extend a repeat inside the output (0 = off; llama.cpp
    /// suggests 0.8), with base 1.75 and runs from 2 tokens.
    #[arg(long, default_value_t = 0.0)]
    dry_multiplier: f32,
}

impl GenerateArgs {
    fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed: self.seed,
            repetition_penalty: self.repetition_penalty,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            logprobs: self.logprobs,
            confidence: false,
            max_tokens: self.max_tokens,
            stop: self.stop.clone(),
            stop_token_ids: Vec::new(),
            ignore_eos: self.ignore_eos,
            dry: (self.dry_multiplier != 0.0).then(|| DryParams {
                multiplier: self.dry_multiplier,
                ..Default::default()
            }),
            copy_bias: 0.0,
            speculate: true,
            contrast: None,
        }
    }

    fn prompt_tokens(&self, tokenizer: &Tokenizer, text: &str) -> anyhow::Result<Vec<u32>> {
        if !self.chat {
            return Ok(tokenizer.encode(text, false)?);
        }
        let mut messages = Vec::new();
        if let Some(s) = &self.system {
            messages.push(ChatMessage::new("system", s));
        }
        messages.push(ChatMessage::new("user", text));
        // Special tokens are parsed only in text the template produced, never in a raw prompt.
        Ok(tokenizer.encode(&tokenizer.chat_prompt(&messages)?, true)?)
    }
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let (mut engine, tokenizer) = args.model.engine()?;
    match &args.prompts {
        Some(file) => many(&args, &mut engine, &tokenizer, file),
        None => one(&args, &mut engine, &tokenizer),
    }
}

fn one(args: &GenerateArgs, engine: &mut EngineCore, tokenizer: &Tokenizer) -> anyhow::Result<()> {
    let prompt = args.prompt_tokens(tokenizer, args.prompt.as_deref().unwrap_or_default())?;
    let prompt_tokens = prompt.len();
    engine.add_request(EngineRequest {
        id: 0,
        prompt,
        params: args.params(),
        priority: 0,
        constraint: None,
    })?;
    let mut stdout = std::io::stdout().lock();
    let done = engine.run_until_idle(|out| {
        let _ = stdout.write_all(out.text.as_bytes());
        let _ = stdout.flush();
        for sampled in out.tokens.iter().filter(|s| !s.top.is_empty()) {
            let alts: Vec<String> = sampled
                .top
                .iter()
                .map(|t| format!("{:?} {:.3}", tokenizer.token_text(t.token).unwrap_or("?"), t.logprob))
                .collect();
            let logprob = sampled.logprob.unwrap_or(f32::NAN);
            eprintln!("[{} {logprob:.3}] {}", sampled.token, alts.join(", "));
        }
    })?;
    let _ = writeln!(stdout);
    let c = &done[0];
    let m = &c.metrics;
    let rate = |n: usize, d: std::time::Duration| n as f64 / d.as_secs_f64().max(1e-9);
    let decoded = c.tokens.len().saturating_sub(1);
    let decode_time = m.e2e.saturating_sub(m.ttft);
    eprintln!(
        "prefill: {prompt_tokens} tokens in {:.1} ms ({:.1} tok/s) | decode: {decoded} tokens in {:.1} ms ({:.1} tok/s) | finish: {:?}",
        m.ttft.as_secs_f64() * 1e3,
        rate(prompt_tokens, m.ttft),
        decode_time.as_secs_f64() * 1e3,
        rate(decoded, decode_time),
        c.finish,
    );
    Ok(())
}

fn many(args: &GenerateArgs, engine: &mut EngineCore, tokenizer: &Tokenizer, file: &PathBuf) -> anyhow::Result<()> {
    let reader =
        std::io::BufReader::new(std::fs::File::open(file).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?);
    let mut count = 0u64;
    for (i, line) in reader.lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value = serde_json::from_str(&line)
            .map_err(|e| anyhow::anyhow!("{} line {}: not JSON: {e}", file.display(), i + 1))?;
        let text = match &value {
            serde_json::Value::String(s) => s.as_str(),
            v => v["prompt"].as_str().ok_or_else(|| {
                anyhow::anyhow!(
                    "{} line {}: expected a string or {{\"prompt\": \"...\"}}",
                    file.display(),
                    i + 1
                )
            })?,
        };
        let prompt = args.prompt_tokens(tokenizer, text)?;
        engine
            .add_request(EngineRequest {
                id: count,
                prompt,
                params: args.params(),
                priority: 0,
                constraint: None,
            })
            .map_err(|e| anyhow::anyhow!("{} line {}: {e}", file.display(), i + 1))?;
        count += 1;
    }
    let done = engine.run_until_idle(|_| {})?;
    let mut stdout = std::io::stdout().lock();
    for c in done {
        let m = &c.metrics;
        let line = serde_json::json!({
            "index": c.id,
            "text": c.text,
            "finish_reason": format!("{:?}", c.finish).to_lowercase(),
            "prompt_tokens": m.prompt_tokens,
            "completion_tokens": c.tokens.len(),
            "cached_tokens": m.cached_tokens,
            "queue_ms": m.queue.as_secs_f64() * 1e3,
            "ttft_ms": m.ttft.as_secs_f64() * 1e3,
            "e2e_ms": m.e2e.as_secs_f64() * 1e3,
        });
        writeln!(stdout, "{line}")?;
    }
    Ok(())
}
