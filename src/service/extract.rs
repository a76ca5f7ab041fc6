//! One extraction: the request's options checked, its schema resolved, admitted, run, its
//! fields scored and reported.

use quarry_grammar::json::Whitespace;
use serde_json::Value;

use super::api::{
    ExtractOptions, ExtractRequest, ExtractResponse, KeywordEntry, SpeculationUsage, Timings, Usage, WhitespaceOption,
};
use super::{schemas, until_admitted, Endpoint, ErrorKind, Service, ServiceError};
use crate::extract::{ExtractError, Outcome, Task, PRETTY};
use crate::sampling::DryParams;

const DEFAULT_MAX_TOKENS: usize = 512;
pub const MAX_MAX_TOKENS: usize = 4096;
const MAX_RETRIES: usize = 4;

impl Service {
    /// One extraction, counted in the metrics by its outcome or error kind.
    pub async fn extract(&self, req: ExtractRequest) -> Result<ExtractResponse, ServiceError> {
        let result = self.run_extract(req).await;
        self.count_extraction(&result);
        result
    }

    /// One extraction for a job item or a batch line: a full queue (other traffic) is waited
    /// out, not reported, and the extraction is counted once, when it has run.
    pub async fn extract_waiting(&self, req: ExtractRequest) -> Result<ExtractResponse, ServiceError> {
        let result = until_admitted(|| self.run_extract(req.clone())).await;
        self.count_extraction(&result);
        result
    }

    fn count_extraction(&self, result: &Result<ExtractResponse, ServiceError>) {
        match result {
            Ok(out) => self.count(Endpoint::Extract, out.outcome.name()),
            Err(e) => self.count(Endpoint::Extract, e.kind.as_str()),
        }
    }

    /// The extraction a request asks for, its options checked; and its `min_confidence`.
    fn task_of(&self, req: ExtractRequest) -> Result<(Task, Option<f64>), ServiceError> {
        let schema = match (req.schema, &req.schema_id) {
            (Some(s), None) => s,
            (None, Some(id)) => self.schemas.get(id).ok_or_else(|| schemas::unknown(id))?,
            _ => {
                return Err(ServiceError::bad_request(
                    "give exactly one of `schema` and `schema_id`",
                ))
            }
        };
        let o = &req.options;
        let max_tokens = o.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
        if max_tokens == 0 || max_tokens > MAX_MAX_TOKENS {
            return Err(ServiceError::bad_request(format!(
                "`options.max_tokens` must be 1 to {MAX_MAX_TOKENS}"
            )));
        }
        let retries = o.retries.unwrap_or(0);
        if retries > MAX_RETRIES {
            return Err(ServiceError::bad_request(format!(
                "`options.retries` must be 0 to {MAX_RETRIES}"
            )));
        }
        let base = Task::new(schema, req.document);
        let dry = match o.dry_multiplier {
            Some(m) if !(m.is_finite() && m >= 0.0) => {
                return Err(ServiceError::bad_request(
                    "`options.dry_multiplier` must be a number >= 0",
                ))
            }
            Some(0.0) => None,
            Some(multiplier) => Some(DryParams {
                multiplier,
                ..Default::default()
            }),
            None => base.dry.clone(),
        };
        if o.min_confidence.is_some_and(|c| !(0.0..=1.0).contains(&c)) {
            return Err(ServiceError::bad_request(
                "`options.min_confidence` must be a number from 0 to 1",
            ));
        }
        if o.contrast.is_some_and(|w| !(w.is_finite() && w >= 0.0)) {
            return Err(ServiceError::bad_request("`options.contrast` must be a number >= 0"));
        }
        let min_confidence = o.min_confidence;
        let task = Task {
            contrast: o.contrast.unwrap_or(base.contrast),
            instructions: req.instructions,
            open_objects: o.open_objects.unwrap_or(base.open_objects),
            ordered_properties: o.ordered_properties.unwrap_or(base.ordered_properties),
            verbatim: o.verbatim.unwrap_or(base.verbatim),
            copy_bias: o.copy_bias.unwrap_or(base.copy_bias),
            speculate: o.speculate.unwrap_or(base.speculate),
            dry,
            retries,
            max_tokens,
            temperature: o.temperature.unwrap_or(0.0),
            seed: o.seed,
            whitespace: match o.whitespace {
                None => base.whitespace,
                Some(WhitespaceOption::Compact) => Whitespace::Compact,
                Some(WhitespaceOption::Pretty) => PRETTY,
            },
            priority: o.priority.unwrap_or(0),
            strict: o.strict.unwrap_or(false),
            grounding: req.grounding,
            ..base
        };
        Ok((task, min_confidence))
    }

    /// The keyword report of `schema` compiled as an extraction with the default options (and
    /// `strict`) compiles it, so that the first such extraction finds it cached.
    pub async fn preflight(&self, schema: &Value, strict: bool) -> Result<Vec<KeywordEntry>, ServiceError> {
        let req = ExtractRequest {
            schema: Some(schema.clone()),
            schema_id: None,
            document: String::new(),
            instructions: None,
            options: ExtractOptions {
                strict: Some(strict),
                ..Default::default()
            },
            grounding: false,
        };
        self.compile_report(&req).await
    }

    /// Compiles the schema as this request's extraction would, off the async threads (cached,
    /// so the extraction finds it); every keyword's status.
    pub async fn compile_report(&self, req: &ExtractRequest) -> Result<Vec<KeywordEntry>, ServiceError> {
        let (task, _) = self.task_of(req.clone())?;
        let extractor = self.extractor.clone();
        let compiled = tokio::task::spawn_blocking(move || extractor.structured.compile(&task.constraint()))
            .await
            .map_err(|e| ServiceError::internal(e.to_string()))?
            .map_err(ServiceError::schema_rejected)?;
        Ok(compiled.report().map(KeywordEntry::from_report).unwrap_or_default())
    }

    async fn run_extract(&self, req: ExtractRequest) -> Result<ExtractResponse, ServiceError> {
        let (task, min_confidence) = self.task_of(req)?;
        let max_tokens = task.max_tokens;
        // The extractor submits its own engine requests (one, or one per retry, in turn): they
        // pass this door's admission once, as one request, and hold it until they end.
        let _admitted = self.admission.admit(1)?;
        let x = self.extractor.run(task).await.map_err(|e| match e {
            ExtractError::SchemaRejected(e) => ServiceError::schema_rejected(e),
            ExtractError::Refused(e) => ServiceError::refusal(e),
            e @ ExtractError::DocumentTooLong => ServiceError::new(ErrorKind::InputTooLong, e.to_string()),
            ExtractError::Internal(m) => ServiceError::internal(m),
        })?;
        let m = &x.metrics;
        self.observe(m, x.completion_tokens);
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let mut notes = x.compiled.report().map(KeywordEntry::from_report).unwrap_or_default();
        notes.retain(KeywordEntry::is_caveat);
        if m.budget_closed {
            notes.push(KeywordEntry::budget_closed(max_tokens));
        }
        let fields = x.field_reports();
        let review = min_confidence.map(|min| {
            fields
                .iter()
                .filter(|f| f.confidence.is_some_and(|c| c < min))
                .map(|f| f.pointer.clone())
                .collect()
        });
        Ok(ExtractResponse {
            fields,
            review,
            partial: (x.outcome != Outcome::Ok).then_some(x.text),
            violations: x.violations,
            data: x.data,
            outcome: x.outcome,
            usage: Usage {
                prompt_tokens: m.prompt_tokens,
                completion_tokens: x.completion_tokens,
                cached_tokens: m.cached_tokens,
                forced_tokens: m.forced_tokens,
                speculation: SpeculationUsage::from_counts(&m.drafts),
            },
            timings: Timings {
                queue_ms: ms(m.queue),
                ttft_ms: ms(m.ttft),
                total_ms: ms(m.e2e),
            },
            notes,
            grounding: x.grounding,
        })
    }
}
