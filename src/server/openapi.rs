//! The OpenAPI document, generated from the handlers and types (utoipa). openapi/openapi.json
//! is this document, written by `quarry openapi`; a test fails when the two drift apart.

use utoipa::OpenApi;

use super::api::{
    ExtractOptions, ExtractRequest, ExtractResponse, Grounding, Health, KeywordEntry, Outcome, ProposerUsage, Span,
    SpeculationUsage, Timings, Usage, WhitespaceOption,
};
use super::batches::{BatchList, BatchObject, CreateBatch, FileDeleted, FileObject, RequestCounts};
use super::error::{ErrorBody, ErrorDetail};
use super::jobs::{BatchFormat, JobDeleted, JobStatus, RetryRequest};
use super::openai::types::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatLogprobs, CompletionUsage,
    Delta, Model, ModelList, PromptTokensDetails, TextChoice, TextCompletion, TextLogprobs, TokenLogprob, TopLogprob,
};
use super::openai::{
    ChatCompletionRequest, ChatMessageIn, CompletionRequest, JsonSchemaFormat, ResponseFormat, StreamOptions,
};
use super::schemas::{RegisterSchema, SchemaInfo, SchemaList};
use crate::service::ErrorKind;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Quarry",
        description = "Schema-first structured extraction: JSON that always validates, from an LLM constrained by a token mask."
    ),
    paths(
        super::extract::extract,
        super::schemas::register,
        super::schemas::list,
        super::schemas::get_one,
        super::health,
        super::metrics::metrics,
        super::jobs::create,
        super::jobs::status,
        super::jobs::delete,
        super::jobs::results,
        super::jobs::retry,
        super::openai::chat_completions,
        super::openai::completions,
        super::openai::models,
        super::batches::upload,
        super::batches::file_info,
        super::batches::delete_file,
        super::batches::file_bytes,
        super::batches::create,
        super::batches::retrieve,
        super::batches::list,
        super::batches::cancel
    ),
    components(schemas(
        ExtractRequest,
        ExtractOptions,
        WhitespaceOption,
        ExtractResponse,
        Outcome,
        Usage,
        SpeculationUsage,
        ProposerUsage,
        FileObject,
        CreateBatch,
        BatchObject,
        BatchList,
        RequestCounts,
        Timings,
        KeywordEntry,
        Health,
        ErrorBody,
        ErrorDetail,
        ErrorKind,
        RegisterSchema,
        SchemaInfo,
        SchemaList,
        ChatCompletionRequest,
        ChatMessageIn,
        StreamOptions,
        ResponseFormat,
        JsonSchemaFormat,
        CompletionRequest,
        ChatCompletion,
        ChatChoice,
        AssistantMessage,
        ChatCompletionChunk,
        ChatChunkChoice,
        Delta,
        TextCompletion,
        TextChoice,
        CompletionUsage,
        PromptTokensDetails,
        ChatLogprobs,
        TokenLogprob,
        TopLogprob,
        TextLogprobs,
        ModelList,
        Model,
        JobStatus,
        JobDeleted,
        FileDeleted,
        BatchFormat,
        RetryRequest,
        Grounding,
        Span
    ))
)]
struct ApiDoc;

pub fn spec() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

/// The document as committed in openapi/openapi.json.
pub fn spec_json() -> String {
    spec().to_pretty_json().expect("the spec serializes") + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The spec lists every error kind of the service's table and nothing else, and error
    /// bodies refer to that list.
    #[test]
    fn the_spec_lists_every_error_kind() {
        let spec: serde_json::Value = serde_json::from_str(&spec_json()).unwrap();
        let listed: Vec<&str> = spec["components"]["schemas"]["ErrorKind"]["enum"]
            .as_array()
            .expect("ErrorKind is an enum in the spec")
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        let table: Vec<&str> = ErrorKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(listed, table);
        let kind = &spec["components"]["schemas"]["ErrorDetail"]["properties"]["type"];
        assert_eq!(kind["$ref"], "#/components/schemas/ErrorKind", "{kind}");
    }
}
