//! One extraction over the engine: compile the schema, build the prompt, run the constrained
//! request and say how it ended. `/extract`, batch jobs and `quarry extract` all go through
//! here, so they cannot disagree about what counts as success.

use std::sync::Arc;

use quarry_grammar::document::MAX_DOCUMENT_CHARS;
use quarry_grammar::json::Whitespace;
use quarry_grammar::GrammarError;
use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

use super::confidence::{field_confidence, leaves, score_leaves, token_ranges, Candidates};
use super::grounding::{ground, Grounding, Span};
use super::prompt::PromptLayout;
use super::validate::{violations, Validators, Violation};
use crate::engine::{CompiledConstraint, Constraint, EngineClient, EngineRequest, FinishReason, RequestMetrics};
use crate::engine::{StructuredOutputs, SubmitError};
use crate::sampling::{ContrastParams, DryParams, SampledToken, SamplingParams};
use crate::service::ErrorKind;
use crate::tokenizer::{Tokenizer, TokenizerError};

/// The engine and what turns a schema and a document into a request for it.
pub struct Extractor {
    pub client: EngineClient,
    pub tokenizer: Arc<Tokenizer>,
    pub structured: StructuredOutputs,
    pub validators: Validators,
}

/// What to extract, and how.
#[derive(Debug, Clone)]
pub struct Task {
    pub schema: Value,
    pub document: String,
    pub instructions: Option<String>,
    pub max_tokens: usize,
    /// 0 is greedy.
    pub temperature: f32,
    pub seed: Option<u64>,
    pub whitespace: Whitespace,
    pub priority: i32,
    /// Refuse schemas with keywords that cannot be enforced.
    pub strict: bool,
    /// Locate each string of the record in the document.
    pub grounding: bool,
    /// Objects that do not mention `additionalProperties` take any other key, as JSON Schema
    /// reads them (default: only their declared properties; see `SchemaOptions`).
    pub open_objects: bool,
    /// Declared properties are written in schema order.
    pub ordered_properties: bool,
    /// Where the schema and the document sit in the prompt.
    pub layout: PromptLayout,
    /// The DRY penalty on repeats inside the record (see `DryParams`).
    pub dry: Option<DryParams>,
    /// Free strings (no `enum`, `const`, `format`, `pattern` or `minLength`) are copied from the
    /// document: each is one of its substrings.
    pub verbatim: bool,
    /// Logit bonus for tokens that continue a run copied from the document (see
    /// `SamplingParams::copy_bias`); 0 turns it off.
    pub copy_bias: f32,
    /// Context-aware decoding's weight (`engine::contrast`): each token is drawn from `1 + w`
    /// times the model's logits minus `w` times its logits without the document, so that what
    /// the document says outweighs what the model would say anyway; 0 turns it off (it costs
    /// a second row of the model per token).
    pub contrast: f32,
    /// Let a speculating engine guess this extraction's tokens ahead (the record is the same).
    pub speculate: bool,
    /// A record that fails validation is sampled again this many times at most, each time
    /// with another seed (and at `RETRY_TEMPERATURE` when the request is greedy).
    pub retries: usize,
    /// Log-probabilities of every sampled token and of this many alternatives, in
    /// `Extraction::sampled` (for tools and tests that judge how close a choice was).
    pub logprobs: Option<usize>,
    /// Score each leaf of the record by the probabilities of the tokens that wrote it
    /// (`Extraction::fields`).
    pub confidence: bool,
}

/// Sampling temperature of a retry of a greedy request: greedy again would repeat the answer.
pub const RETRY_TEMPERATURE: f32 = 0.7;

/// The whitespace policy `pretty`: runs of up to 8 whitespace characters between tokens.
pub const PRETTY: Whitespace = Whitespace::Flexible { max_run: 8 };

impl Task {
    /// The extraction defaults, each chosen by `quarry bench quality` on the development set
    /// (see the issue notes): greedy, 512 tokens at most, lenient; properties in schema order,
    /// pretty whitespace, objects closed, DRY at llama.cpp's suggested 0.8, a copy bias of 1,
    /// contrast at 0.5 (the weight Shi et al. use; mean field accuracy per case 23.1% without
    /// it, 29.9% with it, for a quarter more time on one CPU).
    pub fn new(schema: Value, document: String) -> Task {
        Task {
            schema,
            document,
            instructions: None,
            max_tokens: 512,
            temperature: 0.0,
            seed: None,
            whitespace: PRETTY,
            priority: 0,
            strict: false,
            grounding: false,
            open_objects: false,
            ordered_properties: true,
            layout: PromptLayout::default(),
            dry: Some(DryParams::default()),
            verbatim: false,
            copy_bias: 1.0,
            contrast: 0.5,
            speculate: true,
            retries: 0,
            logprobs: None,
            confidence: true,
        }
    }

    /// The constraint the answer is held to.
    pub fn constraint(&self) -> Constraint {
        Constraint::Json {
            schema: self.schema.clone(),
            whitespace: self.whitespace,
            strict: self.strict,
            close_objects: !self.open_objects,
            ordered_properties: self.ordered_properties,
        }
    }

    /// Contrast's twin (`engine::contrast`): the same prompt with the document left out, what
    /// the model says without it; `None` where contrast is off.
    pub fn contrast_params(&self, tokenizer: &Tokenizer) -> Result<Option<ContrastParams>, TokenizerError> {
        if self.contrast <= 0.0 {
            return Ok(None);
        }
        let prompt = super::prompt(tokenizer, self.layout, &self.schema, "", self.instructions.as_deref())?;
        Ok(Some(ContrastParams {
            prompt,
            weight: self.contrast,
        }))
    }

    /// Sampling of attempt `attempt` (0 is the first; later ones are retries).
    pub fn sampling(&self, attempt: usize) -> SamplingParams {
        let (temperature, seed) = match attempt {
            0 => (self.temperature, self.seed),
            n => (
                if self.temperature == 0.0 {
                    RETRY_TEMPERATURE
                } else {
                    self.temperature
                },
                Some(self.seed.unwrap_or(0).wrapping_add(n as u64)),
            ),
        };
        SamplingParams {
            temperature,
            seed,
            dry: self.dry.clone(),
            copy_bias: self.copy_bias,
            speculate: self.speculate,
            logprobs: self.logprobs,
            confidence: self.confidence,
            ..SamplingParams::greedy(self.max_tokens)
        }
    }
}

/// How an extraction ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// `data` validates against the schema.
    Ok,
    /// The answer did not close within `max_tokens`: `data` is null, `partial` holds the text.
    Truncated,
    /// The record closed but fails the schema where the grammar could not enforce it (a
    /// keyword the report calls approximated or rejected): `data` is null, `partial` holds
    /// the record and `violations` what the validator found.
    SchemaViolation,
    /// The request was cancelled before it finished.
    Cancelled,
    /// The engine failed; nothing is returned.
    Internal,
}

impl Outcome {
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Truncated => "truncated",
            Outcome::SchemaViolation => "schema_violation",
            Outcome::Cancelled => "cancelled",
            Outcome::Internal => "internal",
        }
    }
}

pub struct Extraction {
    pub outcome: Outcome,
    /// The record, when the outcome is `ok`.
    pub data: Option<Value>,
    /// Everything generated (the partial answer when not `ok`).
    pub text: String,
    /// With `schema_violation`: every way the record fails the schema.
    pub violations: Vec<Violation>,
    /// Output tokens over every attempt.
    pub completion_tokens: usize,
    /// Attempts made (1 unless retries re-sampled a violating record).
    pub attempts: usize,
    pub metrics: RequestMetrics,
    /// The compiled schema, whose report says what was enforced.
    pub compiled: CompiledConstraint,
    pub grounding: Option<Vec<Grounding>>,
    /// The last attempt's tokens, with log-probabilities where `Task::logprobs` asked for them.
    pub sampled: Vec<SampledToken>,
    /// Each leaf of the record (or of the partial record that closed but fails the schema) with
    /// its confidence, where `Task::confidence` asked for them.
    pub fields: Vec<FieldConfidence>,
}

/// One leaf of the record and how sure the model was of it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FieldConfidence {
    /// The leaf's JSON pointer in the record.
    pub pointer: String,
    /// `None` where a token of it was drawn where no confidence is computed.
    pub candidates: Option<Candidates>,
    /// For a string: where the document says it (`grounding`), if it does.
    pub span: Option<Span>,
}

impl FieldConfidence {
    /// The confidence reported for the field (`field_confidence` of its candidates).
    pub fn confidence(&self) -> Option<f64> {
        self.candidates.as_ref().map(field_confidence)
    }

    pub fn report(&self) -> FieldReport {
        FieldReport {
            pointer: self.pointer.clone(),
            confidence: self.confidence(),
            span: self.span.clone(),
        }
    }
}

/// One leaf of the record as every output reports it.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize, ToSchema)]
pub struct FieldReport {
    /// The leaf's JSON pointer in `data`.
    pub pointer: String,
    /// From 0 to 1: the probability the model gave the value's tokens where it had a choice
    /// (tokens the schema alone decided do not count); a value the schema fixed is 1. Null
    /// where the tokens were drawn where it is not computed.
    pub confidence: Option<f64>,
    /// For a string or a number: its character span in the document (strings matched
    /// ignoring case and line breaks, numbers and dates in the document's spelling), or null
    /// where the document does not contain it.
    pub span: Option<Span>,
}

impl Extraction {
    /// Every leaf's report where the record stands (outcome `ok`), else none.
    pub fn field_reports(&self) -> Vec<FieldReport> {
        match self.outcome {
            Outcome::Ok => self.fields.iter().map(FieldConfidence::report).collect(),
            _ => Vec::new(),
        }
    }
}

/// Why there was no extraction at all.
#[derive(Debug, thiserror::Error)]
pub enum ExtractError {
    #[error("{0}")]
    SchemaRejected(GrammarError),
    #[error("{0}")]
    Refused(SubmitError),
    #[error("verbatim strings take documents of at most {MAX_DOCUMENT_CHARS} characters")]
    DocumentTooLong,
    #[error("{0}")]
    Internal(String),
}

impl ExtractError {
    /// The error's kind, as results and the API name it.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ExtractError::SchemaRejected(_) => ErrorKind::SchemaRejected,
            ExtractError::Refused(e) => ErrorKind::of_refusal(e),
            ExtractError::DocumentTooLong => ErrorKind::InputTooLong,
            ExtractError::Internal(_) => ErrorKind::Internal,
        }
    }
}

impl Extractor {
    /// Each leaf of the record in `text` with the confidence of the tokens that wrote it and
    /// its span in `grounded`; none where `text` is no JSON value or the tokens do not spell it
    /// byte for byte.
    fn fields(&self, text: &str, sampled: &[SampledToken], grounded: &[Grounding]) -> Vec<FieldConfidence> {
        let vocab = self.structured.vocab();
        // The end-of-generation token that closes the answer is not in its text.
        let eog = self.tokenizer.end_of_generation_ids();
        let sampled = match sampled.split_last() {
            Some((last, rest)) if eog.contains(&last.token) => rest,
            _ => sampled,
        };
        let ranges = token_ranges(sampled.iter().map(|t| vocab.token_bytes(t.token).len()));
        if ranges.last().map_or(0, |r| r.end) != text.len() {
            return Vec::new();
        }
        let Some(leaves) = leaves(text) else {
            return Vec::new();
        };
        let tokens: Vec<_> = sampled.iter().map(|t| t.confidence).collect();
        let scored = score_leaves(&leaves, &ranges, &tokens);
        leaves
            .into_iter()
            .zip(scored)
            .map(|(l, candidates)| FieldConfidence {
                span: grounded
                    .iter()
                    .find(|g| g.pointer == l.pointer)
                    .and_then(|g| g.span.clone()),
                pointer: l.pointer,
                candidates,
            })
            .collect()
    }

    pub fn new(client: EngineClient, tokenizer: Arc<Tokenizer>) -> Extractor {
        Extractor {
            client,
            structured: StructuredOutputs::new(&tokenizer),
            tokenizer,
            validators: Validators::default(),
        }
    }

    pub async fn run(self: &Arc<Self>, task: Task) -> Result<Extraction, ExtractError> {
        // Compiling and tokenizing are CPU work: off the async threads.
        let work = self.clone();
        let task = Arc::new(task);
        let t = task.clone();
        let (compiled, constraint, validator, prompt, contrast) = tokio::task::spawn_blocking(move || {
            let compiled = work
                .structured
                .compile(&t.constraint())
                .map_err(ExtractError::SchemaRejected)?;
            let validator = work.validators.get(&t.schema).map_err(|e| {
                let (pointer, keyword) = e.pointer.rsplit_once('/').unwrap_or(("", ""));
                ExtractError::SchemaRejected(GrammarError::InvalidSchema {
                    pointer: pointer.to_string(),
                    keyword: keyword.replace("~1", "/").replace("~0", "~"),
                    reason: e.message,
                })
            })?;
            let prompt = super::prompt(
                &work.tokenizer,
                t.layout,
                &t.schema,
                &t.document,
                t.instructions.as_deref(),
            )
            .map_err(|e| ExtractError::Internal(e.to_string()))?;
            let contrast = t
                .contrast_params(&work.tokenizer)
                .map_err(|e| ExtractError::Internal(e.to_string()))?;
            // The document, for copies: verbatim free strings, and the copy bias (a prior,
            // which a document too long for the copy automaton simply goes without).
            let constraint = match t.verbatim || t.copy_bias > 0.0 {
                true => match compiled.with_document(&t.document, t.verbatim) {
                    Some(c) => c,
                    None if t.verbatim => return Err(ExtractError::DocumentTooLong),
                    None => compiled.clone(),
                },
                false => compiled.clone(),
            };
            Ok::<_, ExtractError>((compiled, constraint, validator, prompt, contrast))
        })
        .await
        .map_err(|e| ExtractError::Internal(e.to_string()))??;

        let mut completion_tokens = 0;
        let mut attempt = 0;
        let (c, outcome, data, found) = loop {
            let request = EngineRequest {
                id: 0,
                prompt: prompt.clone(),
                params: SamplingParams {
                    contrast: contrast.clone(),
                    ..task.sampling(attempt)
                },
                priority: task.priority,
                constraint: Some(constraint.clone()),
            };
            // Dropping the stream (the caller went away) aborts the request in the engine.
            let stream = self.client.submit(request).await.map_err(ExtractError::Refused)?;
            let c = stream
                .collect()
                .await
                .ok_or_else(|| ExtractError::Internal("the engine stopped before the request finished".into()))?;
            completion_tokens += c.tokens.len();
            attempt += 1;
            let (outcome, data, found) = match c.finish {
                FinishReason::Stop => match serde_json::from_str::<Value>(&c.text) {
                    Ok(v) => match violations(&validator, &v) {
                        found if found.is_empty() => (Outcome::Ok, Some(v), found),
                        found => (Outcome::SchemaViolation, None, found),
                    },
                    Err(_) => (Outcome::Internal, None, Vec::new()),
                },
                FinishReason::Length => (Outcome::Truncated, None, Vec::new()),
                FinishReason::Aborted => (Outcome::Cancelled, None, Vec::new()),
                FinishReason::Internal => (Outcome::Internal, None, Vec::new()),
            };
            if outcome != Outcome::SchemaViolation || attempt > task.retries {
                break (c, outcome, data, found);
            }
        };
        // Grounding serves both the `grounding` list and the fields' spans: searched once.
        let grounded = match &data {
            Some(d) if task.grounding || task.confidence => {
                let (d, task) = (d.clone(), task.clone());
                let spans = tokio::task::spawn_blocking(move || ground(&task.document, &d));
                Some(spans.await.map_err(|e| ExtractError::Internal(e.to_string()))?)
            }
            _ => None,
        };
        let fields = match task.confidence {
            true => self.fields(&c.text, &c.sampled, grounded.as_deref().unwrap_or_default()),
            false => Vec::new(),
        };
        let grounding = grounded.filter(|_| task.grounding);
        Ok(Extraction {
            fields,
            outcome,
            data,
            violations: found,
            completion_tokens,
            attempts: attempt,
            text: c.text,
            metrics: c.metrics,
            compiled,
            grounding,
            sampled: c.sampled,
        })
    }
}
