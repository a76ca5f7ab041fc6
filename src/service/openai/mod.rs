//! The OpenAI-compatible completions below HTTP: a chat or text request checked, its
//! constraint compiled and its prompt encoded, its `n` choices admitted and submitted together
//! (`start_*`), then either run to their end here (`complete`) or streamed by the server.

pub mod types;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use quarry_grammar::json::Whitespace;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use utoipa::ToSchema;

use super::{until_admitted, Endpoint, ErrorKind, Service, ServiceError};
use crate::engine::{Constraint, EngineRequest, FinishReason, RequestStream};
use crate::extract::validate::{violations, Violation};
use crate::sampling::{SampledToken, SamplingParams};
use crate::tokenizer::{ChatMessage, Tokenizer};
use types::{
    AssistantMessage, ChatChoice, ChatCompletion, ChatLogprobs, CompletionUsage, TextChoice, TextCompletion,
    TextLogprobs, TokenLogprob, TopLogprob,
};

/// Most choices (`n`) a request may ask for.
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

/// A request admitted and submitted: what its chunks repeat, and its choices' streams.
pub struct Started {
    pub head: Head,
    pub streams: Vec<RequestStream>,
}

/// A finished completion, as the endpoint that asked for it answers.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Completion {
    Chat(ChatCompletion),
    Text(TextCompletion),
}

impl Service {
    /// A chat completion's choices, submitted (uncounted: the caller counts a failure, and
    /// `complete` or the stream counts the outcome).
    pub async fn start_chat(&self, req: &ChatCompletionRequest) -> Result<Started, ServiceError> {
        self.check_model(&req.model)?;
        let n = check_n(req.n)?;
        let messages = req
            .messages
            .iter()
            .map(|m| Ok(ChatMessage::new(&m.role, &text_of(&m.content)?)))
            .collect::<Result<Vec<_>, ServiceError>>()?;
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
        let extractor = self.extractor.clone();
        let schema = match &req.response_format {
            Some(ResponseFormat::JsonSchema { json_schema }) => json_schema.schema.clone(),
            _ => None,
        };
        let (compiled, validator, prompt) = tokio::task::spawn_blocking(move || {
            let compiled = constraint
                .map(|c| extractor.structured.compile(&c))
                .transpose()
                .map_err(ServiceError::schema_rejected)?;
            let validator = schema
                .map(|s| extractor.validators.get(&s))
                .transpose()
                .map_err(|e| ServiceError::bad_request(e.to_string()))?;
            let prompt = extractor
                .tokenizer
                .encode_chat(&messages)
                .map_err(|e| ServiceError::bad_request(e.to_string()))?;
            Ok::<_, ServiceError>((compiled, validator, prompt))
        })
        .await
        .map_err(|e| ServiceError::internal(e.to_string()))??;
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
        let streams = self.submit_n(&prompt, n, &params, compiled).await?;
        let head = Head {
            validator,
            ..Head::new(Api::Chat, &streams, &self.model, prompt_tokens, req.logprobs)
        };
        Ok(Started { head, streams })
    }

    /// A chat completion run to its end for a batch line (never streamed): a full queue is
    /// waited out, not reported, and a failure counted once.
    pub async fn chat_waiting(&self, req: &ChatCompletionRequest) -> Result<Completion, ServiceError> {
        let result = match until_admitted(|| self.start_chat(req)).await {
            Ok(started) => self.complete(started).await,
            Err(e) => Err(e),
        };
        if let Err(e) = &result {
            self.count(Endpoint::ChatCompletions, e.kind.as_str());
        }
        result
    }

    /// A text completion's choices, submitted (counted as `start_chat`'s).
    pub async fn start_text(&self, req: &CompletionRequest) -> Result<Started, ServiceError> {
        self.check_model(&req.model)?;
        let n = check_n(req.n)?;
        if req.echo {
            return Err(ServiceError::bad_request("`echo` is not supported"));
        }
        let text = match &req.prompt {
            Value::String(s) => s.clone(),
            Value::Array(a) if a.len() == 1 && a[0].is_string() => a[0].as_str().unwrap_or_default().to_string(),
            _ => {
                return Err(ServiceError::bad_request(
                    "`prompt` must be a string (or a list of one string)",
                ))
            }
        };
        let extractor = self.extractor.clone();
        let prompt = tokio::task::spawn_blocking(move || extractor.tokenizer.encode(&text, false))
            .await
            .map_err(|e| ServiceError::internal(e.to_string()))?
            .map_err(|e| ServiceError::bad_request(e.to_string()))?;
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
        let streams = self.submit_n(&prompt, n, &params, None).await?;
        let head = Head::new(Api::Text, &streams, &self.model, prompt.len(), req.logprobs.is_some());
        Ok(Started { head, streams })
    }

    /// Every choice to its end, each observed in the metrics as it ends, counted by its outcome;
    /// the whole completion. The choices are awaited together, so each gives back its admission as
    /// it ends.
    pub async fn complete(&self, started: Started) -> Result<Completion, ServiceError> {
        let Started { head, streams } = started;
        let head = &head;
        let choices = streams.into_iter().map(|stream| async move {
            let c = stream.collect().await;
            let c = c.ok_or_else(|| ServiceError::internal("the engine stopped before the request finished"))?;
            self.observe(&c.metrics, c.tokens.len());
            // An answer the engine could not finish is an error, never a normal stop; the first
            // error drops the other choices' streams, which aborts them.
            match engine_failure(c.finish) {
                Some(e) => Err(e),
                None => Ok(c),
            }
        });
        let done = futures_util::future::try_join_all(choices).await?;
        let found: Vec<Option<Vec<Violation>>> = done
            .iter()
            .map(|c| violations_of(head.validator.as_deref(), &c.text, c.finish))
            .collect();
        let ends = done.iter().zip(&found).map(|(c, v)| (c.finish, v.is_some()));
        self.count(head.api.endpoint(), outcome_of(ends));
        let completion_tokens = done.iter().map(|c| c.tokens.len()).sum();
        let cached = done.iter().map(|c| c.metrics.cached_tokens).max().unwrap_or(0);
        let usage = CompletionUsage::new(head.prompt_tokens, completion_tokens, cached);
        let tokenizer = &self.extractor.tokenizer;
        let completion = match head.api {
            Api::Chat => Completion::Chat(ChatCompletion {
                id: head.id.clone(),
                object: "chat.completion".into(),
                created: head.created,
                model: head.model.clone(),
                choices: done
                    .into_iter()
                    .zip(found)
                    .enumerate()
                    .map(|(index, (c, violations))| ChatChoice {
                        index,
                        logprobs: head.logprobs.then(|| chat_logprobs(tokenizer, &c.sampled)),
                        finish_reason: finish_reason(c.finish).into(),
                        violations,
                        message: AssistantMessage {
                            role: "assistant".into(),
                            content: c.text,
                        },
                    })
                    .collect(),
                usage,
            }),
            Api::Text => Completion::Text(TextCompletion {
                id: head.id.clone(),
                object: "text_completion".into(),
                created: head.created,
                model: head.model.clone(),
                choices: done
                    .into_iter()
                    .enumerate()
                    .map(|(index, c)| TextChoice {
                        index,
                        logprobs: head.logprobs.then(|| text_logprobs(tokenizer, &c.sampled)),
                        finish_reason: Some(finish_reason(c.finish).into()),
                        text: c.text,
                    })
                    .collect(),
                usage: Some(usage),
            }),
        };
        Ok(completion)
    }

    /// `n` requests of the same prompt, the i-th with seed `seed + i`, through the door together.
    async fn submit_n(
        &self,
        prompt: &[u32],
        n: usize,
        params: &SamplingParams,
        constraint: Option<crate::engine::CompiledConstraint>,
    ) -> Result<Vec<RequestStream>, ServiceError> {
        let requests = (0..n)
            .map(|i| EngineRequest {
                id: 0,
                prompt: prompt.to_vec(),
                params: SamplingParams {
                    seed: params.seed.map(|s| s.wrapping_add(i as u64)),
                    ..params.clone()
                },
                priority: 0,
                constraint: constraint.clone(),
            })
            .collect();
        self.submit(requests).await
    }

    fn check_model(&self, model: &str) -> Result<(), ServiceError> {
        if model == self.model {
            return Ok(());
        }
        Err(ServiceError::new(
            ErrorKind::ModelNotFound,
            format!("this server serves `{}`, not `{model}`", self.model),
        ))
    }
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

fn check_n(n: Option<usize>) -> Result<usize, ServiceError> {
    match n.unwrap_or(1) {
        n @ 1..=MAX_N => Ok(n),
        _ => Err(ServiceError::bad_request(format!("`n` must be 1 to {MAX_N}"))),
    }
}

fn parse_stop(stop: &Option<Value>) -> Result<Vec<String>, ServiceError> {
    match stop {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(a)) if a.iter().all(Value::is_string) && a.len() <= 4 => {
            Ok(a.iter().filter_map(|v| v.as_str().map(String::from)).collect())
        }
        Some(_) => Err(ServiceError::bad_request(
            "`stop` must be a string or a list of up to 4 strings",
        )),
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    Text,
}

impl Api {
    pub fn endpoint(self) -> Endpoint {
        match self {
            Api::Chat => Endpoint::ChatCompletions,
            Api::Text => Endpoint::Completions,
        }
    }
}

/// What a request whose choices all ended on their own ended as, for the metrics, as
/// `/extract` names it: `schema_violation` where an answer fails its schema, else `truncated`
/// where one ran out of tokens, else `ok`. (One the engine failed is counted by its error.)
pub fn outcome_of(ends: impl IntoIterator<Item = (FinishReason, bool)>) -> &'static str {
    let (mut truncated, mut violated) = (false, false);
    for (finish, violation) in ends {
        truncated |= finish == FinishReason::Length;
        violated |= violation;
    }
    match (violated, truncated) {
        (true, _) => "schema_violation",
        (false, true) => "truncated",
        (false, false) => "ok",
    }
}

/// What every chunk of one completion repeats.
pub struct Head {
    pub api: Api,
    pub id: String,
    pub created: u64,
    pub model: String,
    pub prompt_tokens: usize,
    pub logprobs: bool,
    /// For a `json_schema` response format: the schema's validator. A finished answer that
    /// fails it (where the schema has keywords the grammar only approximates, or cannot
    /// enforce) carries the validator's errors in its choice, as `violations`.
    pub validator: Option<Arc<jsonschema::Validator>>,
}

/// The choice field that reports an answer failing its schema, when it does.
pub fn violations_of(
    validator: Option<&jsonschema::Validator>,
    text: &str,
    finish: FinishReason,
) -> Option<Vec<Violation>> {
    let v = validator.filter(|_| finish == FinishReason::Stop)?;
    let found = match serde_json::from_str::<Value>(text) {
        Ok(record) => violations(v, &record),
        Err(_) => return None,
    };
    (!found.is_empty()).then_some(found)
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
}

/// The error a request that did not end on its own gets: the engine failed under it
/// (`internal`), or it was cancelled (the server is shutting down, or it was aborted).
pub fn engine_failure(f: FinishReason) -> Option<ServiceError> {
    match f {
        FinishReason::Internal => Some(ServiceError::internal("the engine failed on this request")),
        FinishReason::Aborted => Some(ServiceError::new(
            ErrorKind::Cancelled,
            "the request was cancelled before it finished",
        )),
        _ => None,
    }
}

pub fn finish_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Length => "length",
        _ => "stop",
    }
}

/// Chat log-probabilities: each token with its bytes and its alternatives.
pub fn chat_logprobs(tokenizer: &Tokenizer, tokens: &[SampledToken]) -> ChatLogprobs {
    let text = |id: u32| tokenizer.decode(&[id], false).unwrap_or_default();
    ChatLogprobs {
        content: tokens
            .iter()
            .map(|t| {
                let token = text(t.token);
                TokenLogprob {
                    bytes: token.as_bytes().to_vec(),
                    token,
                    logprob: t.logprob.unwrap_or(0.0),
                    top_logprobs: t
                        .top
                        .iter()
                        .map(|a| {
                            let token = text(a.token);
                            TopLogprob {
                                bytes: token.as_bytes().to_vec(),
                                token,
                                logprob: a.logprob,
                            }
                        })
                        .collect(),
                }
            })
            .collect(),
    }
}

/// Completions' legacy log-probabilities: parallel lists and each token's text offset.
pub fn text_logprobs(tokenizer: &Tokenizer, tokens: &[SampledToken]) -> TextLogprobs {
    let text = |id: u32| tokenizer.decode(&[id], false).unwrap_or_default();
    let texts: Vec<String> = tokens.iter().map(|t| text(t.token)).collect();
    let text_offset = texts
        .iter()
        .scan(0, |offset, t| {
            let at = *offset;
            *offset += t.len();
            Some(at)
        })
        .collect();
    TextLogprobs {
        token_logprobs: tokens.iter().map(|t| t.logprob.unwrap_or(0.0)).collect(),
        top_logprobs: tokens
            .iter()
            .map(|t| t.top.iter().map(|a| (text(a.token), Value::from(a.logprob))).collect())
            .collect(),
        tokens: texts,
        text_offset,
    }
}

/// A message's text: a string, or the text parts of a list.
fn text_of(content: &Value) -> Result<String, ServiceError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => parts
            .iter()
            .map(|p| match (p["type"].as_str(), p["text"].as_str()) {
                (Some("text"), Some(t)) => Ok(t.to_string()),
                _ => Err(ServiceError::bad_request("only text content parts are supported")),
            })
            .collect(),
        Value::Null => Ok(String::new()),
        _ => Err(ServiceError::bad_request(
            "`content` must be a string or a list of text parts",
        )),
    }
}
