use std::io::Write;

use clap::Args;

use super::ModelArgs;
use crate::engine::{GenerateRequest, Generator};
use crate::sampling::SamplingParams;
use crate::tokenizer::ChatMessage;

#[derive(Args)]
#[command(allow_negative_numbers = true)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt text.
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt in the model's chat template as a user message.
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
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let (mut backend, tokenizer) = args.model.load()?;
    let text = if args.chat {
        let mut messages = Vec::new();
        if let Some(s) = &args.system {
            messages.push(ChatMessage::new("system", s));
        }
        messages.push(ChatMessage::new("user", &args.prompt));
        tokenizer.chat_prompt(&messages)?
    } else {
        args.prompt.clone()
    };
    // Special tokens are parsed only in text the template produced, never in a raw prompt.
    let prompt = tokenizer.encode(&text, args.chat)?;
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        seed: args.seed,
        repetition_penalty: args.repetition_penalty,
        frequency_penalty: args.frequency_penalty,
        presence_penalty: args.presence_penalty,
        logprobs: args.logprobs,
        max_tokens: args.max_tokens,
        stop: args.stop.clone(),
        stop_token_ids: Vec::new(),
        ignore_eos: args.ignore_eos,
    };
    let request = GenerateRequest {
        prompt,
        params,
        arrival_step: 0,
    };
    let mut generator = Generator::new(&mut backend, &tokenizer);
    let mut stdout = std::io::stdout().lock();
    let completions = generator.run(std::slice::from_ref(&request), |_, sampled, text| {
        let _ = stdout.write_all(text.as_bytes());
        let _ = stdout.flush();
        if !sampled.top.is_empty() {
            let alts: Vec<String> = sampled
                .top
                .iter()
                .map(|t| format!("{:?} {:.3}", tokenizer.token_text(t.token).unwrap_or("?"), t.logprob))
                .collect();
            eprintln!("[{} {:.3}] {}", sampled.token, sampled.logprob, alts.join(", "));
        }
    })?;
    let _ = writeln!(stdout);
    let c = &completions[0];
    let rate = |n: usize, d: std::time::Duration| n as f64 / d.as_secs_f64().max(1e-9);
    let decoded = c.tokens.len().saturating_sub(1);
    eprintln!(
        "prefill: {} tokens in {:.1} ms ({:.1} tok/s) | decode: {} tokens in {:.1} ms ({:.1} tok/s) | finish: {:?}",
        c.prompt_tokens,
        c.timings.prefill.as_secs_f64() * 1e3,
        rate(c.prompt_tokens, c.timings.prefill),
        decoded,
        c.timings.decode.as_secs_f64() * 1e3,
        rate(decoded, c.timings.decode),
        c.finish_reason,
    );
    Ok(())
}
