//! A streamed completion over server-sent events: a role delta per choice (chat), content as
//! it comes, a finish chunk per choice, the usage chunk where asked for, then `[DONE]`; where
//! the engine fails, an `{"error": ...}` event instead, as OpenAI ends a failed stream.

use std::collections::VecDeque;
use std::sync::Arc;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use tokio::sync::mpsc;

use super::types::{ChatChunkChoice, ChatCompletionChunk, CompletionUsage, Delta, TextChoice, TextCompletion};
use crate::engine::{FinishReason, RequestOutput, RequestStream};
use crate::server::error::ApiError;
use crate::server::error::ErrorBody;
use crate::server::AppState;
use crate::service::openai::{
    chat_logprobs, engine_failure, finish_reason, outcome_of, text_logprobs, violations_of, Api, Head,
};

/// Dropping the response (the client left) drops the streams, which aborts the requests.
pub(super) fn respond(state: Arc<AppState>, head: Head, streams: Vec<RequestStream>, include_usage: bool) -> Response {
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
    let progress = Progress {
        state,
        rx,
        head,
        include_usage,
        started: vec![false; n],
        texts: vec![String::new(); n],
        finishes: Vec::with_capacity(n),
        tokens: vec![0; n],
        completion_tokens: 0,
        cached: 0,
        pending: VecDeque::new(),
        done: false,
    };
    let events = futures_util::stream::unfold(progress, |mut p| async move {
        let event = p.next().await?;
        Some((Ok::<_, std::convert::Infallible>(event), p))
    });
    // Comments every 15 s keep proxies from closing a long stream that is still thinking.
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}

struct Progress {
    state: Arc<AppState>,
    rx: mpsc::Receiver<(usize, RequestOutput)>,
    head: Head,
    include_usage: bool,
    started: Vec<bool>,
    /// Each choice's text so far, for its validation when it ends.
    texts: Vec<String>,
    /// How each finished choice ended, and whether its answer fails its schema.
    finishes: Vec<(FinishReason, bool)>,
    /// Each choice's output tokens so far.
    tokens: Vec<usize>,
    completion_tokens: usize,
    cached: usize,
    pending: VecDeque<Event>,
    done: bool,
}

impl Progress {
    /// The next event, or `None` after the last.
    async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Some(e);
            }
            if self.done {
                return None;
            }
            match self.rx.recv().await {
                Some((index, out)) => self.output(index, out),
                None if self.finishes.len() < self.started.len() => {
                    // A choice's stream ended without its end: the engine stopped under it.
                    let e = ApiError::internal("the engine stopped before the request finished");
                    self.state
                        .service
                        .count(self.head.api.endpoint(), e.detail.kind.as_str());
                    self.pending.push_back(event(&ErrorBody { error: e.detail }));
                    self.done = true;
                }
                None => {
                    let endpoint = self.head.api.endpoint();
                    self.state
                        .service
                        .count(endpoint, outcome_of(self.finishes.iter().copied()));
                    if self.include_usage {
                        let usage = CompletionUsage::new(self.head.prompt_tokens, self.completion_tokens, self.cached);
                        self.push_chunk(Vec::new(), Some(usage));
                    }
                    self.pending.push_back(Event::default().data("[DONE]"));
                    self.done = true;
                }
            }
        }
    }

    /// One choice's new output: its chunks, queued.
    fn output(&mut self, index: usize, out: RequestOutput) {
        let chat = self.head.api == Api::Chat;
        if chat && !self.started[index] {
            self.started[index] = true;
            let role = Delta {
                role: Some("assistant".into()),
                content: Some(String::new()),
            };
            self.push_chunk(vec![Choice::delta(index, role)], None);
        }
        self.completion_tokens += out.tokens.len();
        self.tokens[index] += out.tokens.len();
        if self.head.validator.is_some() {
            self.texts[index].push_str(&out.text);
        }
        if !out.text.is_empty() || (self.head.logprobs && !out.tokens.is_empty()) {
            let tokenizer = self.state.service.tokenizer();
            let mut choice = match chat {
                true => Choice::delta(
                    index,
                    Delta {
                        role: None,
                        content: Some(out.text.clone()),
                    },
                ),
                false => Choice::text(index, out.text.clone()),
            };
            if self.head.logprobs {
                match &mut choice {
                    Choice::Chat(c) => c.logprobs = Some(chat_logprobs(tokenizer, &out.tokens)),
                    Choice::Text(c) => c.logprobs = Some(text_logprobs(tokenizer, &out.tokens)),
                }
            }
            self.push_chunk(vec![choice], None);
        }
        let Some(finish) = out.finished else { return };
        if let Some(metrics) = &out.metrics {
            self.state.service.observe(metrics, self.tokens[index]);
        }
        if let Some(e) = engine_failure(finish).map(ApiError::from) {
            self.state
                .service
                .count(self.head.api.endpoint(), e.detail.kind.as_str());
            let body = ErrorBody { error: e.detail };
            self.pending.push_back(event(&body));
            self.done = true;
            return;
        }
        let violations = violations_of(self.head.validator.as_deref(), &self.texts[index], finish);
        self.finishes.push((finish, violations.is_some()));
        self.cached = self.cached.max(out.metrics.map_or(0, |m| m.cached_tokens));
        let mut choice = match chat {
            true => Choice::delta(index, Delta::default()),
            false => Choice::text(index, String::new()),
        };
        match &mut choice {
            Choice::Chat(c) => {
                c.finish_reason = Some(finish_reason(finish).into());
                c.violations = violations;
            }
            Choice::Text(c) => c.finish_reason = Some(finish_reason(finish).into()),
        }
        self.push_chunk(vec![choice], None);
    }

    fn push_chunk(&mut self, choices: Vec<Choice>, usage: Option<CompletionUsage>) {
        let h = &self.head;
        let e = match h.api {
            Api::Chat => event(&ChatCompletionChunk {
                id: h.id.clone(),
                object: "chat.completion.chunk".into(),
                created: h.created,
                model: h.model.clone(),
                choices: choices.into_iter().filter_map(Choice::into_chat).collect(),
                usage,
            }),
            Api::Text => event(&TextCompletion {
                id: h.id.clone(),
                object: "text_completion".into(),
                created: h.created,
                model: h.model.clone(),
                choices: choices.into_iter().filter_map(Choice::into_text).collect(),
                usage,
            }),
        };
        self.pending.push_back(e);
    }
}

/// A chunk's choice, of either API.
enum Choice {
    Chat(ChatChunkChoice),
    Text(TextChoice),
}

impl Choice {
    fn delta(index: usize, delta: Delta) -> Choice {
        Choice::Chat(ChatChunkChoice {
            index,
            delta,
            logprobs: None,
            finish_reason: None,
            violations: None,
        })
    }

    fn text(index: usize, text: String) -> Choice {
        Choice::Text(TextChoice {
            index,
            text,
            logprobs: None,
            finish_reason: None,
        })
    }

    fn into_chat(self) -> Option<ChatChunkChoice> {
        match self {
            Choice::Chat(c) => Some(c),
            Choice::Text(_) => None,
        }
    }

    fn into_text(self) -> Option<TextChoice> {
        match self {
            Choice::Text(c) => Some(c),
            Choice::Chat(_) => None,
        }
    }
}

fn event(body: &impl Serialize) -> Event {
    Event::default().data(serde_json::to_string(body).unwrap_or_default())
}
