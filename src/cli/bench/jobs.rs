//! The requests the speed benchmarks send: random token prompts decoded to a fixed length, or
//! extractions asked as `quarry extract` asks them with its defaults (prompt, constraint with
//! the document for the copy prior, sampling), of synthetic invoices or of cases from a file.

use std::path::Path;

use serde_json::Value;

use super::{bench_prompt, workload};
use std::sync::Arc;

use crate::engine::{CompiledConstraint, EngineConfig, EngineCore, EngineRequest, StructuredOutputs};
use crate::extract::Task;
use crate::runtime::Backend;
use crate::sampling::SamplingParams;
use crate::tokenizer::Tokenizer;

pub struct Job {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    /// The extraction's sampling (its `max_tokens` aside); greedy where `None`.
    pub params: Option<SamplingParams>,
    pub constraint: Option<CompiledConstraint>,
}

impl Job {
    /// The request, as request `id`. Unconstrained requests decode exactly their length, as
    /// in `vllm bench`.
    pub fn request(&self, id: u64) -> EngineRequest {
        EngineRequest {
            id,
            prompt: self.prompt.clone(),
            params: SamplingParams {
                ignore_eos: self.constraint.is_none(),
                max_tokens: self.max_tokens,
                ..self.params.clone().unwrap_or_default()
            },
            priority: 0,
            constraint: self.constraint.clone(),
        }
    }
}

/// `n` prompts of `input_len` ordinary token ids, each decoding `output_len` tokens.
pub fn random(n: usize, input_len: usize, output_len: usize, tokenizer: &Tokenizer) -> Vec<Job> {
    (0..n)
        .map(|i| Job {
            prompt: bench_prompt(input_len, tokenizer.vocab_size(), i),
            max_tokens: output_len,
            params: None,
            constraint: None,
        })
        .collect()
}

/// One extraction of `document` into `schema`, as `quarry extract` asks it (with `contrast` as
/// its context-aware decoding weight where given).
pub fn extraction(
    tokenizer: &Tokenizer,
    structured: &StructuredOutputs,
    schema: &Value,
    document: &str,
    max_tokens: usize,
    contrast: Option<f32>,
) -> anyhow::Result<Job> {
    let mut task = Task::new(schema.clone(), document.to_string());
    task.contrast = contrast.unwrap_or(task.contrast);
    let compiled = structured.compile(&task.constraint())?;
    let constraint = compiled.with_document(document, false).unwrap_or(compiled);
    Ok(Job {
        prompt: crate::extract::prompt(tokenizer, task.layout, schema, document, None)?,
        max_tokens,
        params: Some(crate::sampling::SamplingParams {
            contrast: task.contrast_params(tokenizer)?,
            ..task.sampling(0)
        }),
        constraint: Some(constraint),
    })
}

/// `n` synthetic invoices of at least `input_len` tokens, each different.
pub fn invoices(
    n: usize,
    input_len: usize,
    max_tokens: usize,
    contrast: Option<f32>,
    tokenizer: &Tokenizer,
) -> anyhow::Result<Vec<Job>> {
    let schema = workload::invoice_schema();
    let structured = StructuredOutputs::new(tokenizer);
    (0..n)
        .map(|i| {
            let document = workload::invoice_document(tokenizer, i, input_len)?;
            extraction(tokenizer, &structured, &schema, &document, max_tokens, contrast)
        })
        .collect()
}

/// The cases of a JSONL file (`{schema, document}` per line, as `bench quality` reads them).
pub fn cases(path: &Path, max_tokens: usize, contrast: Option<f32>, tokenizer: &Tokenizer) -> anyhow::Result<Vec<Job>> {
    let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let structured = StructuredOutputs::new(tokenizer);
    let mut jobs = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let at = |e: &dyn std::fmt::Display| anyhow::anyhow!("{}:{}: {e}", path.display(), i + 1);
        let v: Value = serde_json::from_str(line).map_err(|e| at(&e))?;
        let (Some(schema), Some(document)) = (v.get("schema"), v.get("document").and_then(Value::as_str)) else {
            return Err(at(&"needs `schema` and a string `document`"));
        };
        let job = extraction(tokenizer, &structured, schema, document, max_tokens, contrast);
        jobs.push(job.map_err(|e| at(&e))?);
    }
    anyhow::ensure!(!jobs.is_empty(), "{}: no cases", path.display());
    Ok(jobs)
}

/// A fresh engine over `backend` (an empty prefix cache); where `config` speculates, it
/// guesses with the draft model in `draft`, which `into_backend` gives back.
pub fn engine(
    backend: Box<dyn Backend>,
    tokenizer: &Arc<Tokenizer>,
    config: EngineConfig,
    draft: &mut Option<Box<dyn Backend>>,
) -> EngineCore {
    let mut engine = EngineCore::new(backend, tokenizer.clone(), config);
    if config.speculative.is_some() {
        if let Some(d) = draft.take() {
            engine.set_draft_model(d);
        }
    }
    engine
}

/// The engine's backend, its draft model back in `draft`.
pub fn into_backend(mut engine: EngineCore, draft: &mut Option<Box<dyn Backend>>) -> Box<dyn Backend> {
    if let Some(d) = engine.take_draft_model() {
        *draft = Some(d);
    }
    engine.into_backend()
}
