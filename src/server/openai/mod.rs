//! The OpenAI-compatible surface over HTTP: `POST /v1/chat/completions` (with `response_format`
//! `json_schema` or `json_object` constrained by the grammar, streaming over SSE, `n`, `stop`,
//! `logprobs`), `POST /v1/completions` and `GET /v1/models`, so OpenAI clients work unchanged.
//! The requests themselves are the service's (`crate::service::openai`).

use std::sync::Arc;

mod stream;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::error::{ApiError, ErrorBody};
use super::{count_error, ApiJson, AppState};
pub use crate::service::openai::types;
use crate::service::openai::Started;
pub use crate::service::openai::{
    ChatCompletionRequest, ChatMessageIn, CompletionRequest, JsonSchemaFormat, ResponseFormat, StreamOptions,
};
use crate::service::Endpoint;
use types::{ChatCompletion, Model, ModelList, TextCompletion};

#[utoipa::path(
    post,
    path = "/v1/chat/completions",
    tag = "openai",
    request_body = ChatCompletionRequest,
    responses(
        (status = 200, description = "A chat.completion object, or with `stream` a text/event-stream of `ChatCompletionChunk` objects ending with `data: [DONE]` (an `ErrorBody` event where the engine fails)", body = ChatCompletion),
        (status = 400, description = "Bad request or schema, or more choices than the server admits (`too_many_choices`)", body = ErrorBody),
        (status = 404, description = "Unknown model", body = ErrorBody),
        (status = 429, description = "Too many pending requests; see `Retry-After`", body = ErrorBody),
        (status = 500, description = "The engine failed on the request (`internal`)", body = ErrorBody),
        (status = 503, description = "The request was cancelled (`cancelled`: the server is shutting down)", body = ErrorBody),
    )
)]
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    ApiJson(req): ApiJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let result = chat(state.clone(), req).await;
    count_error(&state, Endpoint::ChatCompletions, &result);
    result
}

/// A chat completion, uncounted (the handler counts a failure; the rest counts itself).
async fn chat(state: Arc<AppState>, req: ChatCompletionRequest) -> Result<Response, ApiError> {
    let started = state.service.start_chat(&req).await?;
    respond(state, started, req.stream, req.stream_options.as_ref()).await
}

#[utoipa::path(
    post,
    path = "/v1/completions",
    tag = "openai",
    request_body = CompletionRequest,
    responses(
        (status = 200, description = "A text_completion object, or with `stream` a text/event-stream of them ending with `data: [DONE]` (an `ErrorBody` event where the engine fails)", body = TextCompletion),
        (status = 400, description = "Bad request, or more choices than the server admits (`too_many_choices`)", body = ErrorBody),
        (status = 404, description = "Unknown model", body = ErrorBody),
        (status = 429, description = "Too many pending requests; see `Retry-After`", body = ErrorBody),
        (status = 500, description = "The engine failed on the request (`internal`)", body = ErrorBody),
        (status = 503, description = "The request was cancelled (`cancelled`: the server is shutting down)", body = ErrorBody),
    )
)]
pub async fn completions(
    State(state): State<Arc<AppState>>,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let result = text(state.clone(), req).await;
    count_error(&state, Endpoint::Completions, &result);
    result
}

async fn text(state: Arc<AppState>, req: CompletionRequest) -> Result<Response, ApiError> {
    let started = state.service.start_text(&req).await?;
    respond(state, started, req.stream, req.stream_options.as_ref()).await
}

/// The choices as server-sent events, or run to their end as one JSON object.
async fn respond(
    state: Arc<AppState>,
    started: Started,
    stream: bool,
    options: Option<&StreamOptions>,
) -> Result<Response, ApiError> {
    if stream {
        let include_usage = options.is_some_and(|o| o.include_usage);
        return Ok(stream::respond(state, started.head, started.streams, include_usage));
    }
    Ok(Json(state.service.complete(started).await?).into_response())
}

#[utoipa::path(get, path = "/v1/models", tag = "openai", responses((status = 200, body = ModelList)))]
pub async fn models(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list".into(),
        data: vec![Model {
            id: state.service.model.clone(),
            object: "model".into(),
            created: 0,
            owned_by: "quarry".into(),
        }],
    })
}
