//! `quarry-grammar`: constraints (JSON Schema, regex, choice lists, CFGs) compiled to
//! token-level automata that fill a token bitmask per decoding step.
//!
//! The crate knows nothing of models or HTTP (shared/design.md). Its parts:
//! - `vocab`, `trie`: the tokenizer's byte vocabulary and its pre-order byte trie.
//! - `dfa`: byte-level DFAs (built by regex-automata, copied into a compact pruned table).
//! - `regex`: the regex constraint and its matcher.
//! - `cfg`: context-free grammars in a GBNF subset, and their matcher.
//! - `json`: JSON Schema compiled to a resolved graph with a per-keyword report.
//! - `lexeme`: regexes for constrained JSON lexemes (integer ranges, string formats).
//! - `matcher`: the interface every constraint's matcher offers the engine.
//! - `stacks`: the matcher core of the grammars run as stack sets (JSON Schema, CFG).
//! - `document`: a document's substrings, for outputs that copy from it.
//! - `bitmask`: the mask layout shared with the runtime.

pub mod bitmask;
mod cache;
pub mod cfg;
mod dedup;
pub mod dfa;
pub mod document;
pub mod error;
mod history;
pub mod json;
pub mod lexeme;
pub mod matcher;
pub mod regex;
mod stacks;
pub mod trie;
pub mod vocab;

pub use bitmask::{allowed_tokens, bitmask_words, is_allowed};
pub use cfg::{CfgGrammar, CfgMatcher};
pub use document::DocumentSpans;
pub use error::GrammarError;
pub use matcher::Matcher;
pub use regex::{RegexGrammar, RegexMatcher};
pub use vocab::{TokenId, TokenVocab};
