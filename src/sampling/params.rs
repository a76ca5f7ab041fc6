//! What a request asks of sampling, checked once before it reaches the engine.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    /// Fixes the random stream of this request alone, whatever else runs beside it.
    pub seed: Option<u64>,
    /// Divides positive (multiplies negative) logits of tokens seen in prompt or output.
    pub repetition_penalty: f32,
    /// Subtracted once per earlier occurrence in the output.
    pub frequency_penalty: f32,
    /// Subtracted once if the token occurred in the output.
    pub presence_penalty: f32,
    /// Number of most likely alternatives to report per token (log-probabilities of the model's
    /// own distribution, before penalties and temperature).
    pub logprobs: Option<usize>,
    /// Report each drawn token's probability under the distribution it was drawn from (see
    /// `SampledToken::confidence`): a pass of `exp` over the vocabulary per token, so only when
    /// asked.
    pub confidence: bool,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    /// Keep going past the model's end-of-generation tokens (benchmarks, references).
    pub ignore_eos: bool,
    /// Pushes down tokens that would extend a repeat inside the output (off when `None`).
    pub dry: Option<DryParams>,
    /// Added to the logit of every token that continues a run copied from the request's
    /// document (a constraint given one; see `Matcher::copy_mask`): a prior for copying over
    /// inventing. 0 turns it off.
    pub copy_bias: f32,
    /// Lets the engine guess this request's tokens ahead where it speculates (the output is
    /// the same either way; false spares the request the work of checking guesses).
    pub speculate: bool,
    /// Context-aware decoding (see `engine::contrast`): each token is drawn from `(1 + weight)`
    /// times the logits minus `weight` times the logits of `prompt` (the request's prompt with
    /// its document left out) followed by the same output. Off when `None`.
    pub contrast: Option<ContrastParams>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContrastParams {
    /// The prompt without the context whose influence is amplified.
    pub prompt: Vec<u32>,
    pub weight: f32,
}

/// DRY ("don't repeat yourself", llama.cpp's `--dry-multiplier`): a token that would extend a
/// run of the output repeating an earlier run of the output, `n` tokens long with `n` at least
/// `allowed_length`, loses `multiplier * base^(n - allowed_length)` from its logit. Only the
/// output is scanned: copying from the prompt (an extraction's document) is the point. A run
/// never reaches back across a token containing one of `breakers`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DryParams {
    pub multiplier: f32,
    pub base: f32,
    pub allowed_length: usize,
    pub breakers: Vec<String>,
}

impl Default for DryParams {
    /// llama.cpp's suggested values, without its sequence breakers.
    fn default() -> Self {
        DryParams {
            multiplier: 0.8,
            base: 1.75,
            allowed_length: 2,
            breakers: Vec::new(),
        }
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            confidence: false,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logprobs: None,
            max_tokens: 256,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            dry: None,
            copy_bias: 0.0,
            speculate: true,
            contrast: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid sampling parameter `{field}`: {reason}")]
pub struct SamplingParamError {
    pub field: &'static str,
    pub reason: String,
}

/// Most alternatives a request may ask for per token.
pub const MAX_LOGPROBS: usize = 20;

impl SamplingParams {
    pub fn greedy(max_tokens: usize) -> Self {
        SamplingParams {
            max_tokens,
            ..Default::default()
        }
    }

    pub fn validate(&self, vocab_size: usize) -> Result<(), SamplingParamError> {
        let err = |field, reason: String| Err(SamplingParamError { field, reason });
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return err(
                "temperature",
                format!("{} is not a finite number >= 0", self.temperature),
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return err("top_p", format!("{} is not in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return err("min_p", format!("{} is not in [0, 1]", self.min_p));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return err("repetition_penalty", format!("{} is not > 0", self.repetition_penalty));
        }
        for (field, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return err(field, format!("{v} is not in [-2, 2]"));
            }
        }
        if let Some(n) = self.logprobs {
            if n > MAX_LOGPROBS {
                return err("logprobs", format!("{n} is more than {MAX_LOGPROBS}"));
            }
        }
        if let Some(c) = &self.contrast {
            if !(c.weight.is_finite() && c.weight >= 0.0) {
                return err("contrast", format!("weight {} is not a finite number >= 0", c.weight));
            }
            if c.prompt.is_empty() {
                return err("contrast", "the prompt without the context is empty".into());
            }
            if let Some(&t) = c.prompt.iter().find(|&&t| t as usize >= vocab_size) {
                return err("contrast", format!("token {t} is past the vocabulary ({vocab_size})"));
            }
        }
        if let Some(d) = &self.dry {
            if !(d.multiplier.is_finite() && d.multiplier >= 0.0) {
                return err(
                    "dry.multiplier",
                    format!("{} is not a finite number >= 0", d.multiplier),
                );
            }
            if !(d.base.is_finite() && d.base >= 1.0) {
                return err("dry.base", format!("{} is not a finite number >= 1", d.base));
            }
            if d.allowed_length == 0 {
                return err("dry.allowed_length", "must be at least 1".into());
            }
        }
        if !(self.copy_bias.is_finite() && self.copy_bias >= 0.0) {
            return err("copy_bias", format!("{} is not a finite number >= 0", self.copy_bias));
        }
        if self.max_tokens == 0 {
            return err("max_tokens", "must be at least 1".into());
        }
        if let Some(s) = self.stop.iter().find(|s| s.is_empty()) {
            return err("stop", format!("empty stop string {s:?}"));
        }
        if let Some(t) = self.stop_token_ids.iter().find(|&&t| t as usize >= vocab_size) {
            return err(
                "stop_token_ids",
                format!("{t} is outside the vocabulary of {vocab_size}"),
            );
        }
        Ok(())
    }
}
