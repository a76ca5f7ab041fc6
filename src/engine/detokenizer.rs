//! Incremental detokenization: text appears as soon as its bytes are complete. A token that
//! ends inside a multi-byte character (U+FFFD when decoded alone) waits for the next one.

use crate::tokenizer::{Tokenizer, TokenizerError};

#[derive(Default)]
pub struct Detokenizer {
    ids: Vec<u32>,
    /// Start of the window decoded for context (byte-level merges depend on neighbours).
    prefix_offset: usize,
    /// End of the text already emitted.
    read_offset: usize,
}

impl Detokenizer {
    /// Tokens pushed so far.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Adds one token; returns the newly completed text, possibly empty.
    pub fn push(&mut self, tokenizer: &Tokenizer, token: u32) -> Result<String, TokenizerError> {
        self.ids.push(token);
        let prefix = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], true)?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..], true)?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.is_char_boundary(prefix.len()) {
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            return Ok(full[prefix.len()..].to_string());
        }
        Ok(String::new())
    }
}
