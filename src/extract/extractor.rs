//! One extraction over the engine: compile the schema, build the prompt, run the constrained
//! request and say how it ended. `/extract`, batch jobs and `quarry extract` all go through
//! here, so they cannot disagree about what counts as success.

use std::sync::Arc;

use quarry_grammar::json::Whitespace;
use quarry_grammar::GrammarError;
use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

use super::grounding::{ground, Grounding};
use crate::engine::{AddError, AdmitError, StructuredOutputs, SubmitError};
use crate::engine::{CompiledConstraint, Constraint, EngineClient, EngineRequest, FinishReason, RequestMetrics};
use crate::sampling::SamplingParams;
use crate::tokenizer::Tokenizer;

/// The engine and what turns a schema and a document into a request for it.
pub struct Extractor {
    pub client: EngineClient,
    pub tokenizer: Arc<Tokenizer>,
    pub structured: StructuredOutputs,
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
}

impl Task {
    /// Greedy, compact, lenient, 512 tokens at most.
    pub fn new(schema: Value, document: String) -> Task {
        Task {
            schema,
            document,
            instructions: None,
            max_tokens: 512,
            temperature: 0.0,
            seed: None,
            whitespace: Whitespace::Compact,
            priority: 0,
            strict: false,
            grounding: false,
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
    pub completion_tokens: usize,
    pub metrics: RequestMetrics,
    /// The compiled schema, whose report says what was enforced.
    pub compiled: CompiledConstraint,
    pub grounding: Option<Vec<Grounding>>,
}

/// Why there was no extraction at all.
#[derive(Debug, thiserror::Error)]
pub enum ExtractError {
    #[error("{0}")]
    SchemaRejected(GrammarError),
    #[error("{0}")]
    Refused(SubmitError),
    #[error("{0}")]
    Internal(String),
}

impl ExtractError {
    /// The error's type, as results and the API name it.
    pub fn kind(&self) -> &'static str {
        match self {
            ExtractError::SchemaRejected(_) => "schema_rejected",
            ExtractError::Refused(SubmitError::Refused(AddError::Admit(AdmitError::InputTooLong { .. }))) => {
                "input_too_long"
            }
            ExtractError::Refused(SubmitError::Refused(_)) => "refused",
            ExtractError::Refused(SubmitError::Stopped) => "unavailable",
            ExtractError::Internal(_) => "internal",
        }
    }
}

impl Extractor {
    pub async fn run(self: &Arc<Self>, task: Task) -> Result<Extraction, ExtractError> {
        // Compiling and tokenizing are CPU work: off the async threads.
        let work = self.clone();
        let Task {
            schema,
            document,
            instructions,
            max_tokens,
            temperature,
            seed,
            whitespace,
            priority,
            strict,
            grounding,
        } = task;
        let (compiled, prompt, document) = tokio::task::spawn_blocking(move || {
            let compiled = work
                .structured
                .compile(&Constraint::Json {
                    schema: schema.clone(),
                    whitespace,
                    strict,
                })
                .map_err(ExtractError::SchemaRejected)?;
            let prompt = super::prompt(&work.tokenizer, &schema, &document, instructions.as_deref())
                .map_err(|e| ExtractError::Internal(e.to_string()))?;
            Ok::<_, ExtractError>((compiled, prompt, document))
        })
        .await
        .map_err(|e| ExtractError::Internal(e.to_string()))??;

        let request = EngineRequest {
            id: 0,
            prompt,
            params: SamplingParams {
                temperature,
                seed,
                ..SamplingParams::greedy(max_tokens)
            },
            priority,
            constraint: Some(compiled.clone()),
        };
        // Dropping the stream (the caller went away) aborts the request in the engine.
        let stream = self.client.submit(request).await.map_err(ExtractError::Refused)?;
        let c = stream
            .collect()
            .await
            .ok_or_else(|| ExtractError::Internal("the engine stopped before the request finished".into()))?;
        let (outcome, data) = match c.finish {
            FinishReason::Stop => match serde_json::from_str::<Value>(&c.text) {
                Ok(v) => (Outcome::Ok, Some(v)),
                Err(_) => (Outcome::Internal, None),
            },
            FinishReason::Length => (Outcome::Truncated, None),
            FinishReason::Aborted => (Outcome::Cancelled, None),
            FinishReason::Internal => (Outcome::Internal, None),
        };
        let grounding = match (&data, grounding) {
            (Some(d), true) => {
                let d = d.clone();
                let spans = tokio::task::spawn_blocking(move || ground(&document, &d));
                Some(spans.await.map_err(|e| ExtractError::Internal(e.to_string()))?)
            }
            _ => None,
        };
        Ok(Extraction {
            outcome,
            data,
            completion_tokens: c.tokens.len(),
            text: c.text,
            metrics: c.metrics,
            compiled,
            grounding,
        })
    }
}
