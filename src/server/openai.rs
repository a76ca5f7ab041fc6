//! The OpenAI-compatible surface: `POST /v1/chat/completions` (with `response_format`
//! `json_schema` or `json_object` constrained by the grammar, streaming over SSE, `n`, `stop`,
//! `logprobs`) and `GET /v1/models`, so OpenAI clients work unchanged.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use quarry_grammar::json::Whitespace;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use utoipa::ToSchema;

use super::error::{ApiError, ErrorBody};
use super::{ApiJson, AppState};
use crate::engine::{Constraint, EngineRequest, FinishReason, RequestOutput, RequestStream};
use crate::extract::validate::violations;
use crate::sampling::{SampledToken, SamplingParams};
use crate::tokenizer::{ChatMessage, Tokenizer};

const MAX_N: usize = 8;

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChatCompletionRequest {
    pub model: String,
    pub messages: Vec<ChatMessageIn>,
    pub max_tokens: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    /// Default 1, as in the OpenAI API; 0 is greedy.
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<u64>,
    #[schema(value_type = Option<Object>)]
    pub stop: Option<Value>,
    /// Choices to generate (at most 8).
    pub n: Option<usize>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub response_format: Option<ResponseFormat>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<usize>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub user: Option<String>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChatMessageIn {
    pub role: String,
    /// A string, or a list of `{"type": "text", "text": ...}` parts.
    #[schema(value_type = Object)]
    pub content: Value,
    pub name: Option<String>,
}

#[derive(Debug, Deserialize, ToSchema)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON matching `json_schema.schema`; `strict` refuses a schema with keywords that cannot
    /// be enforced.
    JsonSchema {
        json_schema: JsonSchemaFormat,
    },
}

#[derive(Debug, Deserialize, ToSchema)]
pub struct JsonSchemaFormat {
    pub name: String,
    pub description: Option<String>,
    #[schema(value_type = Option<Object>)]
    pub schema: Option<Value>,
    pub strict: Option<bool>,
}

#[utoipa::path(
    post,
    path = "/v1/chat/completions",
    tag = "openai",
    request_body = ChatCompletionRequest,
    responses(
        (status = 200, description = "A chat.completion object, or with `stream` a text/event-stream of chat.completion.chunk objects ending with `data: [DONE]`", body = Object),
        (status = 400, description = "Bad request or schema", body = ErrorBody),
        (status = 404, description = "Unknown model", body = ErrorBody),
    )
)]
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    ApiJson(req): ApiJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    check_model(&state, &req.model)?;
    let n = check_n(req.n)?;
    let messages = req
        .messages
        .iter()
        .map(|m| Ok(ChatMessage::new(&m.role, &text_of(&m.content)?)))
        .collect::<Result<Vec<_>, ApiError>>()?;
    let stop = parse_stop(&req.stop)?;
    let constraint = match &req.response_format {
        None | Some(ResponseFormat::Text) => None,
        Some(ResponseFormat::JsonObject) => Some(Constraint::Json {
            schema: json!({"type": "object"}),
            whitespace: Whitespace::Compact,
            strict: false,
            close_objects: false,
            ordered_properties: false,
        }),
        Some(ResponseFormat::JsonSchema { json_schema }) => Some(Constraint::Json {
            schema: json_schema.schema.clone().unwrap_or_else(|| json!({})),
            whitespace: Whitespace::Compact,
            strict: json_schema.strict.unwrap_or(false),
            close_objects: false,
            ordered_properties: false,
        }),
    };
    let work = state.clone();
    let schema = match &req.response_format {
        Some(ResponseFormat::JsonSchema { json_schema }) => json_schema.schema.clone(),
        _ => None,
    };
    let (compiled, validator, prompt) = tokio::task::spawn_blocking(move || {
        let compiled = constraint
            .map(|c| work.extractor.structured.compile(&c))
            .transpose()
            .map_err(ApiError::schema_rejected)?;
        let validator = schema
            .map(|s| work.extractor.validators.get(&s))
            .transpose()
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        let prompt = work
            .extractor
            .tokenizer
            .encode_chat(&messages)
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        Ok::<_, ApiError>((compiled, validator, prompt))
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))??;
    let max_tokens = req.max_completion_tokens.or(req.max_tokens).unwrap_or(4096).max(1);
    let prompt_tokens = prompt.len();
    let params = SamplingParams {
        logprobs: req.logprobs.then_some(req.top_logprobs.unwrap_or(0)),
        stop,
        ..openai_defaults(
            max_tokens,
            req.temperature,
            req.top_p,
            req.seed,
            req.frequency_penalty,
            req.presence_penalty,
        )
    };
    let streams = submit_n(&state, &prompt, n, &params, compiled).await?;
    let head = Head {
        validator,
        ..Head::new(Api::Chat, &streams, &state.model, prompt_tokens, req.logprobs)
    };
    if req.stream {
        let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
        return Ok(stream_response(state, head, streams, include_usage));
    }
    Ok(Json(complete(&state, &head, streams).await?).into_response())
}

/// `n` requests of the same prompt, the i-th with seed `seed + i`.
async fn submit_n(
    state: &AppState,
    prompt: &[u32],
    n: usize,
    params: &SamplingParams,
    constraint: Option<crate::engine::CompiledConstraint>,
) -> Result<Vec<RequestStream>, ApiError> {
    super::admit(state, n)?;
    let mut streams = Vec::new();
    for i in 0..n {
        let request = EngineRequest {
            id: 0,
            prompt: prompt.to_vec(),
            params: SamplingParams {
                seed: params.seed.map(|s| s.wrapping_add(i as u64)),
                ..params.clone()
            },
            priority: 0,
            constraint: constraint.clone(),
        };
        streams.push(
            state
                .extractor
                .client
                .submit(request)
                .await
                .map_err(super::extract::submit_error)?,
        );
    }
    Ok(streams)
}

/// The sampling fields both endpoints share, with the OpenAI API's defaults (temperature 1).
fn openai_defaults(
    max_tokens: usize,
    temperature: Option<f32>,
    top_p: Option<f32>,
    seed: Option<u64>,
    frequency_penalty: Option<f32>,
    presence_penalty: Option<f32>,
) -> SamplingParams {
    SamplingParams {
        temperature: temperature.unwrap_or(1.0),
        top_p: top_p.unwrap_or(1.0),
        seed,
        frequency_penalty: frequency_penalty.unwrap_or(0.0),
        presence_penalty: presence_penalty.unwrap_or(0.0),
        ..SamplingParams::greedy(max_tokens)
    }
}

fn check_n(n: Option<usize>) -> Result<usize, ApiError> {
    match n.unwrap_or(1) {
        n @ 1..=MAX_N => Ok(n),
        _ => Err(ApiError::bad_request(format!("`n` must be 1 to {MAX_N}"))),
    }
}

fn parse_stop(stop: &Option<Value>) -> Result<Vec<String>, ApiError> {
    match stop {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(a)) if a.iter().all(Value::is_string) && a.len() <= 4 => {
            Ok(a.iter().filter_map(|v| v.as_str().map(String::from)).collect())
        }
        Some(_) => Err(ApiError::bad_request(
            "`stop` must be a string or a list of up to 4 strings",
        )),
    }
}

fn check_model(state: &AppState, model: &str) -> Result<(), ApiError> {
    if model == state.model {
        return Ok(());
    }
    Err(ApiError::new(
        StatusCode::NOT_FOUND,
        "model_not_found",
        format!("this server serves `{}`, not `{model}`", state.model),
    ))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CompletionRequest {
    pub model: String,
    /// The prompt: a string (or a list holding one string).
    #[schema(value_type = Object)]
    pub prompt: Value,
    /// Default 16, as in the OpenAI API.
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<u64>,
    #[schema(value_type = Option<Object>)]
    pub stop: Option<Value>,
    pub n: Option<usize>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    /// Alternatives to report per token (legacy format).
    pub logprobs: Option<usize>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    #[serde(default)]
    pub echo: bool,
    pub user: Option<String>,
}

#[utoipa::path(
    post,
    path = "/v1/completions",
    tag = "openai",
    request_body = CompletionRequest,
    responses(
        (status = 200, description = "A text_completion object, or with `stream` a text/event-stream of them ending with `data: [DONE]`", body = Object),
        (status = 400, description = "Bad request", body = ErrorBody),
        (status = 404, description = "Unknown model", body = ErrorBody),
    )
)]
pub async fn completions(
    State(state): State<Arc<AppState>>,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    check_model(&state, &req.model)?;
    let n = check_n(req.n)?;
    if req.echo {
        return Err(ApiError::bad_request("`echo` is not supported"));
    }
    let text = match &req.prompt {
        Value::String(s) => s.clone(),
        Value::Array(a) if a.len() == 1 && a[0].is_string() => a[0].as_str().unwrap_or_default().to_string(),
        _ => {
            return Err(ApiError::bad_request(
                "`prompt` must be a string (or a list of one string)",
            ))
        }
    };
    let work = state.clone();
    let prompt = tokio::task::spawn_blocking(move || work.extractor.tokenizer.encode(&text, false))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let max_tokens = req.max_tokens.unwrap_or(16).max(1);
    let params = SamplingParams {
        logprobs: req.logprobs,
        stop: parse_stop(&req.stop)?,
        ..openai_defaults(
            max_tokens,
            req.temperature,
            req.top_p,
            req.seed,
            req.frequency_penalty,
            req.presence_penalty,
        )
    };
    let streams = submit_n(&state, &prompt, n, &params, None).await?;
    let head = Head::new(Api::Text, &streams, &state.model, prompt.len(), req.logprobs.is_some());
    if req.stream {
        let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
        return Ok(stream_response(state, head, streams, include_usage));
    }
    Ok(Json(complete(&state, &head, streams).await?).into_response())
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Api {
    Chat,
    Text,
}

/// Every choice to its end; the whole response object.
async fn complete(state: &AppState, head: &Head, streams: Vec<RequestStream>) -> Result<Value, ApiError> {
    let mut done = Vec::new();
    for stream in streams {
        let c = stream.collect().await;
        let c = c.ok_or_else(|| ApiError::internal("the engine stopped before the request finished"))?;
        // An answer the engine could not finish is an error, never a normal stop.
        if let Some(e) = engine_failure(c.finish) {
            return Err(e);
        }
        done.push(c);
    }
    let completion_tokens = done.iter().map(|c| c.tokens.len()).sum();
    let cached = done.iter().map(|c| c.metrics.cached_tokens).max().unwrap_or(0);
    let choices: Vec<Value> = done
        .into_iter()
        .enumerate()
        .map(|(index, c)| {
            let logprobs = head
                .logprobs
                .then(|| logprobs_json(head.api, &state.extractor.tokenizer, &c.sampled));
            let mut choice =
                json!({"index": index, "logprobs": logprobs, "finish_reason": finish_reason(Some(c.finish))});
            if let Some(v) = violations_of(head.validator.as_deref(), &c.text, c.finish) {
                choice["violations"] = v;
            }
            match head.api {
                Api::Chat => choice["message"] = json!({"role": "assistant", "content": c.text}),
                Api::Text => choice["text"] = json!(c.text),
            }
            choice
        })
        .collect();
    Ok(json!({
        "id": head.id, "object": head.object(false), "created": head.created, "model": head.model,
        "choices": choices,
        "usage": usage(head.prompt_tokens, completion_tokens, cached),
    }))
}

/// What every chunk of one completion repeats.
struct Head {
    api: Api,
    id: String,
    created: u64,
    model: String,
    prompt_tokens: usize,
    logprobs: bool,
    /// For a `json_schema` response format: the schema's validator. A finished answer that
    /// fails it (where the schema has keywords the grammar only approximates, or cannot
    /// enforce) carries the validator's errors in its choice, as `violations`.
    validator: Option<Arc<jsonschema::Validator>>,
}

/// The choice field that reports an answer failing its schema, when it does.
fn violations_of(validator: Option<&jsonschema::Validator>, text: &str, finish: FinishReason) -> Option<Value> {
    let v = validator.filter(|_| finish == FinishReason::Stop)?;
    let found = match serde_json::from_str::<Value>(text) {
        Ok(record) => violations(v, &record),
        Err(_) => return None,
    };
    (!found.is_empty()).then(|| json!(found))
}

impl Head {
    fn new(api: Api, streams: &[RequestStream], model: &str, prompt_tokens: usize, logprobs: bool) -> Self {
        let prefix = if api == Api::Chat { "chatcmpl" } else { "cmpl" };
        Head {
            api,
            id: format!("{prefix}-{:x}", streams.first().map_or(0, |s| s.id())),
            created: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            model: model.to_string(),
            prompt_tokens,
            logprobs,
            validator: None,
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.api, chunk) {
            (Api::Chat, false) => "chat.completion",
            (Api::Chat, true) => "chat.completion.chunk",
            (Api::Text, _) => "text_completion",
        }
    }
}

/// Server-sent events: a role delta per choice, content deltas as they come, a finish chunk
/// per choice, the usage chunk when asked for, then `[DONE]`. Dropping the response (the
/// client left) drops the streams, which aborts the requests.
fn stream_response(state: Arc<AppState>, head: Head, streams: Vec<RequestStream>, include_usage: bool) -> Response {
    let (tx, rx) = mpsc::channel::<(usize, RequestOutput)>(64);
    let n = streams.len();
    for (index, mut stream) in streams.into_iter().enumerate() {
        let tx = tx.clone();
        tokio::spawn(async move {
            while let Some(out) = stream.next().await {
                if tx.send((index, out)).await.is_err() {
                    return; // the client left: dropping `stream` aborts the request
                }
            }
        });
    }
    drop(tx);
    let chunk = move |head: &Head, choices: Value, usage: Option<Value>| -> Event {
        let mut c = json!({
            "id": head.id, "object": head.object(true), "created": head.created,
            "model": head.model, "choices": choices,
        });
        if let Some(u) = usage {
            c["usage"] = u;
        }
        Event::default().data(c.to_string())
    };
    struct Progress {
        rx: mpsc::Receiver<(usize, RequestOutput)>,
        head: Head,
        started: Vec<bool>,
        /// Each choice's text so far, for its validation when it ends.
        texts: Vec<String>,
        completion_tokens: usize,
        cached: usize,
        pending: std::collections::VecDeque<Event>,
        done: bool,
    }
    let progress = Progress {
        rx,
        head,
        started: vec![false; n],
        texts: vec![String::new(); n],
        completion_tokens: 0,
        cached: 0,
        pending: Default::default(),
        done: false,
    };
    let events = futures_util::stream::unfold(progress, move |mut p| {
        let state = state.clone();
        async move {
            loop {
                if let Some(e) = p.pending.pop_front() {
                    return Some((Ok::<_, std::convert::Infallible>(e), p));
                }
                if p.done {
                    return None;
                }
                match p.rx.recv().await {
                    Some((index, out)) => {
                        let chat = p.head.api == Api::Chat;
                        if chat && !p.started[index] {
                            p.started[index] = true;
                            let role = json!([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]);
                            p.pending.push_back(chunk(&p.head, role, None));
                        }
                        p.completion_tokens += out.tokens.len();
                        if p.head.validator.is_some() {
                            p.texts[index].push_str(&out.text);
                        }
                        if !out.text.is_empty() || (p.head.logprobs && !out.tokens.is_empty()) {
                            let logprobs = p
                                .head
                                .logprobs
                                .then(|| logprobs_json(p.head.api, &state.extractor.tokenizer, &out.tokens));
                            let mut choice = json!({"index": index, "logprobs": logprobs, "finish_reason": null});
                            match chat {
                                true => choice["delta"] = json!({"content": out.text}),
                                false => choice["text"] = json!(out.text),
                            }
                            let delta = json!([choice]);
                            p.pending.push_back(chunk(&p.head, delta, None));
                        }
                        if let Some(e) = out.finished.and_then(engine_failure) {
                            // OpenAI's way: an `error` object as the stream's last event.
                            let body = json!({"error": {"type": e.detail.kind, "message": e.detail.message}});
                            p.pending.push_back(Event::default().data(body.to_string()));
                            p.done = true;
                            continue;
                        }
                        if let Some(f) = out.finished {
                            p.cached = p.cached.max(out.metrics.map_or(0, |m| m.cached_tokens));
                            let mut choice =
                                json!({"index": index, "logprobs": null, "finish_reason": finish_reason(Some(f))});
                            if let Some(v) = violations_of(p.head.validator.as_deref(), &p.texts[index], f) {
                                choice["violations"] = v;
                            }
                            match chat {
                                true => choice["delta"] = json!({}),
                                false => choice["text"] = json!(""),
                            }
                            let fin = json!([choice]);
                            p.pending.push_back(chunk(&p.head, fin, None));
                        }
                    }
                    None => {
                        if include_usage {
                            let u = usage(p.head.prompt_tokens, p.completion_tokens, p.cached);
                            p.pending.push_back(chunk(&p.head, json!([]), Some(u)));
                        }
                        p.pending.push_back(Event::default().data("[DONE]"));
                        p.done = true;
                    }
                }
            }
        }
    });
    // Comments every 15 s keep proxies from closing a long stream that is still thinking.
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}

/// The error a request that did not end on its own gets: the engine failed under it
/// (`internal`), or it was cancelled (the server is shutting down, or it was aborted).
fn engine_failure(f: FinishReason) -> Option<ApiError> {
    match f {
        FinishReason::Internal => Some(ApiError::internal("the engine failed on this request")),
        FinishReason::Aborted => Some(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "cancelled",
            "the request was cancelled before it finished",
        )),
        _ => None,
    }
}

fn finish_reason(f: Option<FinishReason>) -> &'static str {
    match f {
        Some(FinishReason::Length) => "length",
        _ => "stop",
    }
}

fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// Chat: `{"content": [{token, logprob, bytes, top_logprobs}]}`; completions: the legacy
/// `{tokens, token_logprobs, top_logprobs, text_offset}`.
fn logprobs_json(api: Api, tokenizer: &Tokenizer, tokens: &[SampledToken]) -> Value {
    if api == Api::Chat {
        return json!({"content": token_logprobs(tokenizer, tokens)});
    }
    let text = |id: u32| tokenizer.decode(&[id], false).unwrap_or_default();
    let mut offset = 0;
    let mut offsets = Vec::new();
    for t in tokens {
        offsets.push(offset);
        offset += text(t.token).len();
    }
    json!({
        "tokens": tokens.iter().map(|t| text(t.token)).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| t.logprob.unwrap_or(0.0)).collect::<Vec<_>>(),
        "top_logprobs": tokens.iter().map(|t| {
            t.top.iter().map(|a| (text(a.token), json!(a.logprob))).collect::<serde_json::Map<_, _>>()
        }).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

fn token_logprobs(tokenizer: &Tokenizer, tokens: &[SampledToken]) -> Vec<Value> {
    let entry = |id: u32, logprob: f32| {
        let text = tokenizer.decode(&[id], false).unwrap_or_default();
        json!({"token": text, "logprob": logprob, "bytes": text.as_bytes()})
    };
    tokens
        .iter()
        .map(|t| {
            let mut e = entry(t.token, t.logprob.unwrap_or(0.0));
            e["top_logprobs"] = t.top.iter().map(|a| entry(a.token, a.logprob)).collect();
            e
        })
        .collect()
}

/// A message's text: a string, or the text parts of a list.
fn text_of(content: &Value) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => parts
            .iter()
            .map(|p| match (p["type"].as_str(), p["text"].as_str()) {
                (Some("text"), Some(t)) => Ok(t.to_string()),
                _ => Err(ApiError::bad_request("only text content parts are supported")),
            })
            .collect(),
        Value::Null => Ok(String::new()),
        _ => Err(ApiError::bad_request(
            "`content` must be a string or a list of text parts",
        )),
    }
}

#[utoipa::path(get, path = "/v1/models", tag = "openai", responses((status = 200, body = Object)))]
pub async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{"id": state.model, "object": "model", "created": 0, "owned_by": "quarry"}],
    }))
}
