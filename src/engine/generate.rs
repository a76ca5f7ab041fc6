//! A small continuous-batching loop over the runtime: requests arrive at given steps, their
//! whole prompts prefill in the same forward pass as the decode tokens of requests already
//! running. It has no token budget, chunking or preemption: the scheduler of the engine issue
//! replaces it. Until then it drives the CLI and the runtime's correctness tests.

use std::time::{Duration, Instant};

use super::block_pool::BlockPool;
use super::detokenizer::Detokenizer;
use super::stop::{StopScan, StopStrings};
use crate::runtime::{Backend, ForwardBatch, RuntimeError};
use crate::sampling::{SampledToken, Sampler, SamplingParamError, SamplingParams};
use crate::tokenizer::{Tokenizer, TokenizerError};

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// The loop step at which the request joins (0: from the start).
    pub arrival_step: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token, a stop token id or a stop string.
    Stop,
    /// `max_tokens` reached, or the model's context is full.
    Length,
}

#[derive(Debug, Clone, Default)]
pub struct Timings {
    /// Duration of the forward pass that held this request's prompt.
    pub prefill: Duration,
    /// Summed duration of the passes that decoded its later tokens.
    pub decode: Duration,
}

#[derive(Debug, Clone)]
pub struct Completion {
    pub prompt_tokens: usize,
    /// Generated ids, an end-of-generation token included.
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    /// The stop string that ended the text, if one did.
    pub stop_string: Option<String>,
    pub sampled: Vec<SampledToken>,
    pub timings: Timings,
}

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("request {request}: the prompt is empty")]
    EmptyPrompt { request: usize },
    #[error("request {request}: prompt of {tokens} tokens leaves no room to generate (limit {limit} tokens)")]
    PromptTooLong {
        request: usize,
        tokens: usize,
        limit: usize,
    },
    #[error("request {request}: {source}")]
    BadParams { request: usize, source: SamplingParamError },
    #[error(
        "the KV cache is full ({free} blocks free, {needed} needed); lower the concurrency or raise the cache size"
    )]
    OutOfKvBlocks { needed: usize, free: usize },
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

struct Active {
    request: usize,
    tokens: Vec<u32>,
    /// Tokens whose K and V are in the cache.
    computed: usize,
    blocks: Vec<u32>,
    sampler: Sampler,
    detokenizer: Detokenizer,
    stops: StopStrings,
    completion: Completion,
}

pub struct Generator<'a> {
    backend: &'a mut dyn Backend,
    tokenizer: &'a Tokenizer,
    pool: BlockPool,
}

impl<'a> Generator<'a> {
    pub fn new(backend: &'a mut dyn Backend, tokenizer: &'a Tokenizer) -> Self {
        let pool = BlockPool::new(backend.kv_layout().num_blocks);
        Self::with_pool(backend, tokenizer, pool)
    }

    pub fn with_pool(backend: &'a mut dyn Backend, tokenizer: &'a Tokenizer, pool: BlockPool) -> Self {
        Generator {
            backend,
            tokenizer,
            pool,
        }
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Runs every request to completion; `on_token(request, token, text)` sees each token as
    /// it is sampled, with the text it completes (held back while it may start a stop string).
    pub fn run(
        &mut self,
        requests: &[GenerateRequest],
        mut on_token: impl FnMut(usize, &SampledToken, &str),
    ) -> Result<Vec<Completion>, GenerateError> {
        self.check(requests)?;
        let mut done: Vec<Option<Completion>> = vec![None; requests.len()];
        let mut active: Vec<Active> = Vec::new();
        let mut step = 0;
        let result = loop {
            for (i, r) in requests.iter().enumerate() {
                if r.arrival_step == step {
                    active.push(self.admit(i, r));
                }
            }
            if active.is_empty() {
                if requests.iter().all(|r| r.arrival_step < step) {
                    break Ok(());
                }
                step += 1;
                continue;
            }
            if let Err(e) = self.step(&mut active, &mut done, &mut on_token) {
                break Err(e);
            }
            step += 1;
        };
        // On error the requests still running give their blocks back too.
        for a in active.drain(..) {
            self.pool.free(a.blocks);
        }
        result.map(|()| done.into_iter().map(|c| c.expect("every request finished")).collect())
    }

    fn check(&self, requests: &[GenerateRequest]) -> Result<(), GenerateError> {
        let layout = self.backend.kv_layout();
        let limit = self.backend.config().context_length.min(layout.num_slots());
        for (i, r) in requests.iter().enumerate() {
            if r.prompt.is_empty() {
                return Err(GenerateError::EmptyPrompt { request: i });
            }
            if r.prompt.len() >= limit {
                return Err(GenerateError::PromptTooLong {
                    request: i,
                    tokens: r.prompt.len(),
                    limit,
                });
            }
            r.params
                .validate(self.backend.config().vocab_size)
                .map_err(|source| GenerateError::BadParams { request: i, source })?;
        }
        Ok(())
    }

    fn admit(&self, request: usize, r: &GenerateRequest) -> Active {
        Active {
            request,
            tokens: r.prompt.clone(),
            computed: 0,
            blocks: Vec::new(),
            sampler: Sampler::new(r.params.clone(), &r.prompt),
            detokenizer: Detokenizer::default(),
            stops: StopStrings::new(r.params.stop.clone()),
            completion: Completion {
                prompt_tokens: r.prompt.len(),
                tokens: Vec::new(),
                text: String::new(),
                finish_reason: FinishReason::Length,
                stop_string: None,
                sampled: Vec::new(),
                timings: Timings::default(),
            },
        }
    }

    fn step(
        &mut self,
        active: &mut Vec<Active>,
        done: &mut [Option<Completion>],
        on_token: &mut impl FnMut(usize, &SampledToken, &str),
    ) -> Result<(), GenerateError> {
        let block_size = self.backend.kv_layout().block_size;
        let mut batch = ForwardBatch::default();
        for a in active.iter_mut() {
            let needed = a.tokens.len().div_ceil(block_size).saturating_sub(a.blocks.len());
            let blocks = self.pool.allocate(needed).ok_or(GenerateError::OutOfKvBlocks {
                needed,
                free: self.pool.num_free(),
            })?;
            a.blocks.extend(blocks);
            batch.push_sequence(&a.tokens[a.computed..], a.computed, &a.blocks, block_size);
            batch
                .logits_rows
                .push(*batch.query_start.last().expect("just pushed") - 1);
        }
        let start = Instant::now();
        let logits = self.backend.forward(&batch)?;
        let elapsed = start.elapsed();

        let context_length = self.backend.config().context_length;
        let mut i = 0;
        let mut row = 0;
        while i < active.len() {
            let a = &mut active[i];
            if a.computed == 0 {
                a.completion.timings.prefill = elapsed;
            } else {
                a.completion.timings.decode += elapsed;
            }
            a.computed = a.tokens.len();
            let sampled = a.sampler.sample(logits.row(row));
            row += 1;
            let finished = self.accept(a, &sampled, context_length, on_token)?;
            if finished {
                let a = active.remove(i);
                self.pool.free(a.blocks);
                done[a.request] = Some(a.completion);
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Records one sampled token; says whether the request is finished.
    fn accept(
        &self,
        a: &mut Active,
        sampled: &SampledToken,
        context_length: usize,
        on_token: &mut impl FnMut(usize, &SampledToken, &str),
    ) -> Result<bool, GenerateError> {
        let params = a.sampler.params();
        let token = sampled.token;
        a.tokens.push(token);
        a.completion.tokens.push(token);
        a.completion.sampled.push(sampled.clone());
        let end_of_generation = !params.ignore_eos && self.tokenizer.end_of_generation_ids().contains(&token);
        let mut finish = if end_of_generation || params.stop_token_ids.contains(&token) {
            Some(FinishReason::Stop)
        } else {
            None
        };
        let delta = a.detokenizer.push(self.tokenizer, token)?;
        let mut text = match a.stops.push(&delta) {
            StopScan::Continue(t) => t,
            StopScan::Stopped(t, stop) => {
                a.completion.stop_string = Some(stop);
                finish = Some(FinishReason::Stop);
                t
            }
        };
        if finish.is_none() && (a.completion.tokens.len() >= params.max_tokens || a.tokens.len() >= context_length) {
            finish = Some(FinishReason::Length);
        }
        if finish.is_some() && a.completion.stop_string.is_none() {
            text.push_str(&a.stops.flush());
        }
        a.completion.text.push_str(&text);
        on_token(a.request, sampled, &text);
        if let Some(f) = finish {
            a.completion.finish_reason = f;
        }
        Ok(finish.is_some())
    }
}
