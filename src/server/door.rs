//! The one way into the engine, for every endpoint and every job item or batch line:
//! admission against `--max-pending`, the engine's refusals as API errors, and each request's
//! outcome and times in the metrics when it ends. Handlers decide what to ask; only this
//! module submits and counts.

use crate::service::ErrorKind;
use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::error::ApiError;
use super::AppState;
use crate::engine::{AddError, AdmitError, EngineRequest, RequestMetrics, RequestStream, SubmitError};

/// Which API a request came through, as the metrics label it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Endpoint {
    Extract,
    ChatCompletions,
    Completions,
}

impl Endpoint {
    pub fn label(self) -> &'static str {
        match self {
            Endpoint::Extract => "extract",
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Completions => "completions",
        }
    }
}

/// The bound on engine requests admitted and not finished (`--max-pending`): a permit per
/// engine request, taken before it is submitted and held as long as it runs, so requests
/// arriving together cannot all pass a check of the engine's queue made before any of them
/// is in it.
pub struct Admission {
    permits: Arc<Semaphore>,
    max: usize,
}

impl Admission {
    pub fn new(max_pending: usize) -> Self {
        let max = max_pending.min(u32::MAX as usize);
        Admission {
            permits: Arc::new(Semaphore::new(max)),
            max,
        }
    }

    /// Engine requests admitted and not finished.
    pub fn pending(&self) -> usize {
        self.max - self.permits.available_permits()
    }
}

/// Permits for `adding` more engine requests, within `--max-pending`, else a 429
/// `queue_full` with Retry-After. A request that needs more than the whole bound could never
/// be admitted: a 400 `too_many_choices`, since retrying it is pointless (and job items retry
/// `queue_full` until it passes). The permits go back when the value is dropped.
pub(super) fn admit(state: &AppState, adding: usize) -> Result<OwnedSemaphorePermit, ApiError> {
    let max = state.admission.max;
    if adding > max {
        return Err(ApiError::new(ErrorKind::TooManyChoices, format!(
                "this request needs {adding} engine requests at once and the server admits at most {max} (--max-pending); ask for fewer choices (`n`)"
            ),
        ));
    }
    state
        .admission
        .permits
        .clone()
        .try_acquire_many_owned(adding as u32)
        .map_err(|_| {
            let pending = state.admission.pending();
            let mut err = ApiError::new(
                ErrorKind::QueueFull,
                format!("{pending} requests are pending already; retry later"),
            );
            err.retry_after = Some(1);
            err
        })
}

/// Admits the requests together (all or none), then hands them to the engine; each stream
/// holds its request's permit.
pub(super) async fn submit(state: &AppState, requests: Vec<EngineRequest>) -> Result<Vec<RequestStream>, ApiError> {
    let mut permits = admit(state, requests.len())?;
    let mut streams = Vec::with_capacity(requests.len());
    for request in requests {
        let stream = state.extractor.client.submit(request).await.map_err(submit_error)?;
        let permit = permits.split(1).expect("a permit was taken for each request");
        streams.push(stream.hold(permit));
    }
    Ok(streams)
}

/// One engine request that ended: its times and tokens.
pub(super) fn observe(state: &AppState, metrics: &RequestMetrics, completion_tokens: usize) {
    state.metrics.observe(metrics, completion_tokens);
}

/// One API request that ended: `ok`, another outcome, or the error kind it was refused with.
pub(super) fn count(state: &AppState, endpoint: Endpoint, outcome: &str) {
    state.metrics.outcome(endpoint.label(), outcome);
}

/// Counts a handler's result: its error kind where it failed (a success counts itself, when
/// its outcome is known).
pub(super) fn count_error<T>(state: &AppState, endpoint: Endpoint, result: &Result<T, ApiError>) {
    if let Err(e) = result {
        count(state, endpoint, e.detail.kind.as_str());
    }
}

/// The engine's refusal as an API error: the kind from the service's table, the message here.
pub(super) fn submit_error(e: SubmitError) -> ApiError {
    let kind = ErrorKind::of_refusal(&e);
    let message = match &e {
        SubmitError::Refused(AddError::Admit(AdmitError::InputTooLong { tokens, limit })) => {
            format!("the prompt is {tokens} tokens; this model and cache take at most {limit}")
        }
        SubmitError::Refused(AddError::MaxTokensTooSmall { max_tokens, minimum }) => format!(
            "at most {max_tokens} tokens fit (max_tokens, and the context after the prompt), but the schema's shortest record is {minimum} bytes; ask for at least {minimum} tokens"
        ),
        SubmitError::Refused(e @ AddError::NoValidOutput) => format!("{e}: no value satisfies the schema"),
        SubmitError::Refused(e) => e.to_string(),
        SubmitError::Stopped => "the engine is shutting down".into(),
    };
    let mut err = ApiError::new(kind, message);
    if let SubmitError::Refused(AddError::MaxTokensTooSmall { minimum, .. }) = e {
        err.detail.minimum = Some(minimum.min(u32::MAX as usize) as u32);
    }
    err
}
