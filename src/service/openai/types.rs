//! The OpenAI API's response bodies, as Quarry writes them: typed, so the OpenAPI document
//! describes them and a generated client gets classes instead of `object`.

use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

use crate::extract::validate::Violation;

/// A `chat.completion`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ChatCompletion {
    pub id: String,
    /// `chat.completion`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: CompletionUsage,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ChatChoice {
    pub index: usize,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    /// `stop` (the answer ended, or a stop string) or `length` (`max_tokens` ran out).
    pub finish_reason: String,
    /// Where the answer fails its `json_schema` (keywords the grammar approximates or cannot
    /// enforce): the validator's errors. Absent when it validates.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub violations: Option<Vec<Violation>>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct AssistantMessage {
    /// `assistant`.
    pub role: String,
    pub content: String,
}

/// A `chat.completion.chunk`: one server-sent event of a streamed chat completion.
#[derive(Debug, Serialize, ToSchema)]
pub struct ChatCompletionChunk {
    pub id: String,
    /// `chat.completion.chunk`.
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    /// In the last chunk only, where `stream_options.include_usage` asked for it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<CompletionUsage>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: Delta,
    pub logprobs: Option<ChatLogprobs>,
    /// Set in the choice's last chunk.
    pub finish_reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub violations: Option<Vec<Violation>>,
}

/// What a chunk adds to the message: its role first, then its text.
#[derive(Debug, Default, Serialize, ToSchema)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// A `text_completion`, whole or (streamed) one chunk of it.
#[derive(Debug, Serialize, ToSchema)]
pub struct TextCompletion {
    pub id: String,
    /// `text_completion`.
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<TextChoice>,
    /// Always in a whole completion; in a stream's last chunk where asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<CompletionUsage>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TextChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<TextLogprobs>,
    /// `stop` or `length`; null in a stream's chunks before the choice's last.
    pub finish_reason: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CompletionUsage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct PromptTokensDetails {
    /// Prompt tokens found in the prefix cache.
    pub cached_tokens: usize,
}

impl CompletionUsage {
    pub fn new(prompt: usize, completion: usize, cached: usize) -> Self {
        CompletionUsage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: PromptTokensDetails { cached_tokens: cached },
        }
    }
}

/// Chat log-probabilities: one entry per output token.
#[derive(Debug, Serialize, ToSchema)]
pub struct ChatLogprobs {
    pub content: Vec<TokenLogprob>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    /// The token's UTF-8 bytes.
    pub bytes: Vec<u8>,
    /// The most likely tokens at this position (`top_logprobs` of them).
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// Completions' legacy log-probabilities: parallel lists, one entry per output token.
#[derive(Debug, Serialize, ToSchema)]
pub struct TextLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    /// Per token, the most likely alternatives: token text to log-probability.
    #[schema(value_type = Vec<Object>)]
    pub top_logprobs: Vec<serde_json::Map<String, Value>>,
    /// Each token's byte offset in the text.
    pub text_offset: Vec<usize>,
}

/// `GET /v1/models`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ModelList {
    /// `list`.
    pub object: String,
    pub data: Vec<Model>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Model {
    pub id: String,
    /// `model`.
    pub object: String,
    pub created: u64,
    pub owned_by: String,
}
