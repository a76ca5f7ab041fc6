//! The JSON shapes of the HTTP API; utoipa derives the OpenAPI schemas from them.

use quarry_grammar::json::{CompileReport, KeywordStatus};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

pub use crate::extract::grounding::{Grounding, Span};
pub use crate::extract::validate::Violation;
pub use crate::extract::{FieldReport, Outcome};

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExtractRequest {
    /// A JSON Schema the output must validate against (or `schema_id`).
    #[schema(value_type = Option<Object>)]
    pub schema: Option<Value>,
    /// The id of a ready-made schema (a file name in schemas/ without `.json`).
    pub schema_id: Option<String>,
    /// The text to extract from.
    pub document: String,
    /// Extra instructions for the model.
    pub instructions: Option<String>,
    #[serde(default)]
    pub options: ExtractOptions,
    /// Also return where each string of the record occurs in the document.
    #[serde(default)]
    pub grounding: bool,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ExtractOptions {
    /// Most output tokens (default 512, at most 4096).
    pub max_tokens: Option<usize>,
    /// 0 (the default) is greedy.
    pub temperature: Option<f32>,
    pub seed: Option<u64>,
    /// `pretty` (default: runs of up to 8 whitespace characters between the JSON's tokens,
    /// as the model likes to write them; measured better than `compact` by `quarry bench
    /// quality`) or `compact` (none). Only the output's tokens differ: `data` is parsed JSON.
    pub whitespace: Option<WhitespaceOption>,
    /// Lower runs first when the server schedules by priority.
    pub priority: Option<i32>,
    /// Refuse a schema with keywords that cannot be enforced (default: enforce the rest and
    /// list them in `notes`).
    pub strict: Option<bool>,
    /// Let objects that do not mention `additionalProperties` take keys they do not declare,
    /// as JSON Schema literally reads them (default false: such objects are closed to their
    /// declared properties, and `notes` says where).
    pub open_objects: Option<bool>,
    /// Write declared properties in the schema's order (default true), as OpenAI's structured
    /// outputs do: the model then chooses values, not keys.
    pub ordered_properties: Option<bool>,
    /// Every free string (no `enum`, `const`, `format`, `pattern` or `minLength`) must be a
    /// substring of the document, JSON-escaped, within its `maxLength` (default false).
    pub verbatim: Option<bool>,
    /// Logit bonus for tokens that continue a run copied from the document: a prior for
    /// copying over inventing (default 1.0; 0 turns it off).
    pub copy_bias: Option<f32>,
    /// Context-aware decoding's weight `w`: each token is drawn from `1 + w` times the model's
    /// logits minus `w` times its logits without the document, so that what the document says
    /// outweighs what the model would say anyway (Shi et al., 2023). Default 0.5; 0 turns it
    /// off, sparing the second row of the model it costs per token.
    pub contrast: Option<f32>,
    /// DRY penalty on tokens that extend a repeat inside the record (llama.cpp's
    /// `dry_multiplier`, base 1.75, runs from 2 tokens; default 0.8, 0 turns it off).
    pub dry_multiplier: Option<f32>,
    /// Sample a record that fails validation again (another seed; temperature 0.7 when the
    /// request is greedy), up to this many times (default 0, at most 4).
    pub retries: Option<usize>,
    /// Where the server speculates (`--speculative-tokens`), let it guess this request's
    /// tokens ahead (default true; the record is the same either way, false spares it the
    /// work of checking guesses).
    pub speculate: Option<bool>,
    /// List under `review` the pointers of the fields whose confidence is below this (0 to 1);
    /// nothing is removed from the record.
    pub min_confidence: Option<f64>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum WhitespaceOption {
    Compact,
    Pretty,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ExtractResponse {
    #[schema(value_type = Option<Object>)]
    pub data: Option<Value>,
    pub outcome: Outcome,
    /// The text produced so far, when the outcome is not `ok`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partial: Option<String>,
    /// With outcome `schema_violation`: each way the record fails the schema, as the
    /// validator reports it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub violations: Vec<Violation>,
    pub usage: Usage,
    pub timings: Timings,
    /// Schema keywords that are approximated, narrowed or not enforced, with how they were
    /// handled; and `budget_closed` (keyword `max_tokens`) when the token budget closed the
    /// record early.
    pub notes: Vec<KeywordEntry>,
    /// With `grounding: true` and outcome `ok`: for each non-blank string and each number of
    /// `data`, its character span in the document, or null where the document does not
    /// contain it. Strings match ignoring case and line breaks; numbers and `YYYY-MM-DD` dates
    /// match in the document's spelling (`55.50` for 55.5, `1.234,50` for 1234.5,
    /// `March 14, 2025` or `14/03/2025` for 2025-03-14).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grounding: Option<Vec<Grounding>>,
    /// With outcome `ok`: every leaf of `data` (array elements included; an empty array or
    /// object is one leaf), in the order the record writes them, with the model's confidence
    /// in it and where the document says it.
    pub fields: Vec<FieldReport>,
    /// With `options.min_confidence`: the pointers of the fields below it, in record order.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub review: Option<Vec<String>>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose keys and values came from the prefix cache.
    pub cached_tokens: usize,
    /// Output tokens the schema decided alone, appended without a model step.
    pub forced_tokens: usize,
    /// Where the server speculates (`--speculative-tokens`): the draft tokens the model
    /// checked for this request and those it kept, per proposer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculation: Option<SpeculationUsage>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct SpeculationUsage {
    /// One entry per proposer that made drafts: `ngram` (prompt lookup), `grammar` (the
    /// schema's forced tokens) or `model` (the draft model).
    pub proposers: Vec<ProposerUsage>,
    /// Steps that checked drafts of this request.
    pub checks: usize,
    /// Drafts kept per check: the tokens a step gained over decoding one at a time.
    pub mean_accepted: f64,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ProposerUsage {
    pub proposer: String,
    pub checked: usize,
    pub kept: usize,
}

impl SpeculationUsage {
    /// None where nothing was drafted for the request.
    pub fn from_counts(d: &crate::engine::DraftCounts) -> Option<Self> {
        if d.checks == 0 && d.proposed() == 0 {
            return None;
        }
        let proposers = [
            ("ngram", d.ngram_proposed, d.ngram_accepted),
            ("grammar", d.grammar_proposed, d.grammar_accepted),
            ("model", d.model_proposed, d.model_accepted),
        ]
        .into_iter()
        .filter(|&(_, checked, _)| checked > 0)
        .map(|(proposer, checked, kept)| ProposerUsage {
            proposer: proposer.into(),
            checked,
            kept,
        })
        .collect();
        Some(SpeculationUsage {
            proposers,
            checks: d.checks,
            mean_accepted: d.accepted() as f64 / d.checks.max(1) as f64,
        })
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Timings {
    pub queue_ms: f64,
    pub ttft_ms: f64,
    pub total_ms: f64,
}

/// One keyword of a schema, at its JSON pointer, and what the grammar makes of it.
#[derive(Debug, Serialize, ToSchema)]
pub struct KeywordEntry {
    pub keyword: String,
    pub pointer: String,
    /// `enforced`, `approximated`, `narrowed` (enforced more strictly than written, e.g. an
    /// object closed to its declared properties), `rejected` (not enforced) or `annotation`.
    pub status: String,
    /// How it is approximated, or why it is not enforced.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

impl KeywordEntry {
    /// Every keyword of a compile report.
    pub fn from_report(report: &CompileReport) -> Vec<KeywordEntry> {
        report
            .keywords
            .iter()
            .map(|k| {
                let (status, detail) = match &k.status {
                    KeywordStatus::Enforced => ("enforced", None),
                    KeywordStatus::Approximated(how) => ("approximated", Some(how.clone())),
                    KeywordStatus::Rejected(why) => ("rejected", Some(why.clone())),
                    KeywordStatus::Narrowed(how) => ("narrowed", Some(how.clone())),
                    KeywordStatus::Annotation => ("annotation", None),
                };
                KeywordEntry {
                    keyword: k.keyword.clone(),
                    pointer: k.pointer.clone(),
                    status: status.into(),
                    detail,
                }
            })
            .collect()
    }

    /// The note of a record the token budget closed: the model would have run past
    /// `max_tokens`, so a string or an array may be cut short.
    pub fn budget_closed(max_tokens: usize) -> KeywordEntry {
        KeywordEntry {
            keyword: "max_tokens".into(),
            pointer: String::new(),
            status: "budget_closed".into(),
            detail: Some(format!(
                "the record was closed within the budget of {max_tokens} tokens: a string or array may be cut short (raise max_tokens)"
            )),
        }
    }

    /// Approximated, narrowed or not enforced.
    pub fn is_caveat(&self) -> bool {
        self.detail.is_some()
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    pub status: String,
    pub model: String,
    /// Where the model runs, e.g. `cpu (16 threads)` or `cuda:0 (NVIDIA H100 80GB HBM3)`.
    pub device: String,
    /// A request's record is the same whatever else runs beside it (`--batch-invariant` on the
    /// GPU; always on the CPU).
    pub batch_invariant: bool,
    pub waiting: usize,
    pub running: usize,
    pub kv_blocks_free: usize,
    pub kv_blocks_total: usize,
}
