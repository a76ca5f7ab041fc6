//! The model's tokenizer, built from the GGUF file it ships in, with its special tokens,
//! end-of-generation ids and chat template.

mod chat;
mod gguf_vocab;
mod hf_dir;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;

pub use chat::{ChatMessage, ChatTemplate};

use crate::runtime::gguf::GgufFile;
use crate::runtime::RuntimeError;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Model(#[from] RuntimeError),
    #[error("tokenizer metadata: {0}")]
    Metadata(String),
    #[error("unsupported tokenizer: {0}")]
    Unsupported(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error("the model has no chat template")]
    NoChatTemplate,
    #[error("tokenization failed: {0}")]
    Encode(String),
}

/// Names llama.cpp also treats as ending a generation when they are control tokens.
const END_OF_GENERATION_NAMES: &[&str] = &[
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<end_of_turn>",
    "<|end|>",
    "</s>",
];

pub struct Tokenizer {
    /// Parses special-token text (`<|im_start|>`) into its id: for templates we render.
    with_special: tokenizers::Tokenizer,
    /// Encodes special-token text as plain text: for user content, so a document cannot
    /// inject a turn boundary.
    plain: tokenizers::Tokenizer,
    tokens: Vec<String>,
    bos_id: Option<u32>,
    add_bos: bool,
    end_of_generation: Vec<u32>,
    /// Control tokens (turn markers and the like): never text a grammar can produce.
    control_ids: Vec<u32>,
    chat_template: Option<ChatTemplate>,
    after: AfterMemo,
}

/// `encode_after`'s answers so far. Jump-forward asks for the grammar's forced text after a
/// request's last token every step the grammar forces any, and the same (token, text) pairs (a
/// schema's keys and punctuation after common value endings) recur across requests and steps:
/// 93% of the asks in a CPU run of 64 extraction requests were repeats. Jump-forward's work,
/// tokenizing included, had taken 1.3-2.1 ms of the engine thread a step at 256 requests.
#[derive(Default)]
struct AfterMemo(Mutex<AfterAnswers>);

/// The answers by token, then text: a lookup borrows the text, so a hit allocates nothing.
#[derive(Default)]
struct AfterAnswers {
    by_last: HashMap<u32, HashMap<String, Vec<u32>>>,
    entries: usize,
}

/// Answers kept at most; past it the memo starts again (a few schemas' worth of forced texts).
const AFTER_MEMO_ENTRIES: usize = 16_384;

impl Tokenizer {
    /// The tokenizer of a GGUF file or of a Hugging Face model directory.
    pub fn from_model_file(path: &Path) -> Result<Self, TokenizerError> {
        if path.is_dir() {
            return hf_dir::load(path);
        }
        Self::from_gguf(&GgufFile::open(path)?)
    }

    /// Writes this tokenizer into a model directory as Hugging Face files, with the chat
    /// template given (the GGUF's, for a model made to match it).
    pub fn save_to_dir(&self, dir: &Path, chat_template: Option<&str>) -> Result<(), TokenizerError> {
        hf_dir::save(self, dir, chat_template)
    }

    pub fn from_gguf(gguf: &GgufFile) -> Result<Self, TokenizerError> {
        let vocab = gguf_vocab::build(gguf)?;
        let id = |key: &str| {
            gguf.usize(key)
                .ok()
                .map(|v| v as u32)
                .filter(|&v| (v as usize) < vocab.tokens.len())
        };
        let bos_id = id("tokenizer.ggml.bos_token_id");
        let eos_id = id("tokenizer.ggml.eos_token_id");
        let add_bos = gguf
            .value("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(false);
        let mut end_of_generation: Vec<u32> = [
            eos_id,
            id("tokenizer.ggml.eot_token_id"),
            id("tokenizer.ggml.eom_token_id"),
        ]
        .into_iter()
        .flatten()
        .collect();
        for &s in &vocab.control_ids {
            if END_OF_GENERATION_NAMES.contains(&vocab.tokens[s as usize].as_str()) && !end_of_generation.contains(&s) {
                end_of_generation.push(s);
            }
        }
        let token_text = |id: Option<u32>| id.map(|i| vocab.tokens[i as usize].clone()).unwrap_or_default();
        let chat_template = match gguf.string("tokenizer.chat_template") {
            Ok(src) => Some(ChatTemplate::new(&src, &token_text(bos_id), &token_text(eos_id))?),
            Err(_) => None,
        };
        let mut plain = vocab.tokenizer.clone();
        plain.set_encode_special_tokens(true);
        Ok(Tokenizer {
            with_special: vocab.tokenizer,
            plain,
            tokens: vocab.tokens,
            bos_id,
            add_bos,
            end_of_generation,
            control_ids: vocab.control_ids,
            chat_template,
            after: AfterMemo::default(),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// Token ids of `text`; `parse_special` turns special-token text into the special id.
    /// Adds BOS when the model asks for it.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let tok = if parse_special { &self.with_special } else { &self.plain };
        let enc = tok
            .encode(text, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if self.add_bos {
            ids.extend(self.bos_id);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Token ids of a piece of a longer text: as `encode`, without BOS.
    pub fn encode_fragment(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let tok = if parse_special { &self.with_special } else { &self.plain };
        let enc = tok
            .encode(text, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The tokens of `text` as they follow token `last` in a longer text, where `last` stays a
    /// token of its own: `text` is tokenized together with `last`'s text, and the answer is empty
    /// unless that tokenization starts with `last` (or where `last` has no text, or ends inside
    /// a character). Remembered, since the same few (token, text) pairs recur.
    pub fn encode_after(&self, last: u32, text: &str) -> Vec<u32> {
        if let Some(known) = self.after_memo().by_last.get(&last).and_then(|m| m.get(text)) {
            return known.clone();
        }
        let tokens = self.encode_after_uncached(last, text);
        let mut memo = self.after_memo();
        if memo.entries >= AFTER_MEMO_ENTRIES {
            *memo = AfterAnswers::default();
        }
        let fresh = memo
            .by_last
            .entry(last)
            .or_default()
            .insert(text.to_string(), tokens.clone())
            .is_none();
        memo.entries += fresh as usize;
        tokens
    }

    fn after_memo(&self) -> std::sync::MutexGuard<'_, AfterAnswers> {
        // The memo holds only finished answers, so one left by a panicking thread is sound.
        self.after.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn encode_after_uncached(&self, last: u32, text: &str) -> Vec<u32> {
        let before = match self.decode(&[last], false) {
            Ok(b) if !b.is_empty() && !b.ends_with('\u{FFFD}') => b,
            _ => return Vec::new(),
        };
        match self.encode_fragment(&format!("{before}{text}"), false) {
            Ok(mut t) if t.first() == Some(&last) => {
                t.remove(0);
                t
            }
            _ => Vec::new(),
        }
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.with_special
            .decode(ids, skip_special)
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }

    /// The prompt for a conversation, rendered with the model's template and tokenized with
    /// special tokens parsed.
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<String, TokenizerError> {
        self.chat_template
            .as_ref()
            .ok_or(TokenizerError::NoChatTemplate)?
            .render(messages)
    }

    /// The token ids of a chat prompt: the template's own text with its special tokens parsed,
    /// each message's content as plain text, so a message can never open a turn of its own by
    /// spelling a control token.
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, TokenizerError> {
        // Private-use markers stand in for the contents while the template renders.
        let marker = |i: usize| format!("\u{E000}{i}\u{E001}");
        let marked: Vec<ChatMessage> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| ChatMessage::new(&m.role, &marker(i)))
            .collect();
        let mut rest = self.chat_prompt(&marked)?;
        let mut ids = Vec::new();
        let mut first = true;
        for (i, m) in messages.iter().enumerate() {
            let (before, after) = rest
                .split_once(&marker(i))
                .ok_or_else(|| TokenizerError::ChatTemplate(format!("the template dropped or altered message {i}")))?;
            ids.extend(if first {
                self.encode(before, true)?
            } else {
                self.encode_fragment(before, true)?
            });
            ids.extend(self.encode_fragment(&m.content, false)?);
            first = false;
            rest = after.to_string();
        }
        ids.extend(if first {
            self.encode(&rest, true)?
        } else {
            self.encode_fragment(&rest, true)?
        });
        Ok(ids)
    }

    pub fn end_of_generation_ids(&self) -> &[u32] {
        &self.end_of_generation
    }

    pub fn control_ids(&self) -> &[u32] {
        &self.control_ids
    }

    /// The vocabulary entry of `id` in its byte-level spelling (`Ġ` for a space).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(|s| s.as_str())
    }
}
