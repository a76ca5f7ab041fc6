//! Structured outputs: a request's constraint compiled once (cached by its text) against the
//! model's vocabulary, and a fresh grammar matcher per request.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use quarry_grammar::json::{CompileReport, JsonGrammar, JsonMatcher, SchemaOptions, Whitespace};
use quarry_grammar::{CfgGrammar, CfgMatcher, GrammarError, Matcher, RegexGrammar, RegexMatcher, TokenVocab};
use serde_json::Value;

use crate::tokenizer::Tokenizer;

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// A JSON Schema. `strict` refuses schemas with keywords that cannot be enforced; lenient
    /// compiles enforce the rest and report what they left out.
    Json {
        schema: Value,
        whitespace: Whitespace,
        strict: bool,
        /// Objects that declare properties but not `additionalProperties` take no other keys.
        close_objects: bool,
        /// Declared properties come in schema order.
        ordered_properties: bool,
    },
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in the GBNF subset of `quarry-grammar`.
    Grammar(String),
}

/// A constraint compiled against the vocabulary: shared by every request that uses it.
#[derive(Clone)]
pub enum CompiledConstraint {
    Json(Arc<JsonGrammar>),
    Regex(Arc<RegexGrammar>),
    Cfg(Arc<CfgGrammar>),
    /// Matchers the caller makes: a constraint of its own (or, in tests, a faulty one).
    Custom(Arc<dyn Fn() -> Box<dyn Matcher + Send> + Send + Sync>),
}

impl CompiledConstraint {
    pub fn matcher(&self) -> Box<dyn Matcher + Send> {
        match self {
            CompiledConstraint::Json(g) => Box::new(JsonMatcher::new(g.clone())),
            CompiledConstraint::Regex(g) => Box::new(RegexMatcher::new(g.clone())),
            CompiledConstraint::Cfg(g) => Box::new(CfgMatcher::new(g.clone())),
            CompiledConstraint::Custom(make) => make(),
        }
    }

    /// For one request with a document (see `JsonGrammar::with_document`): the matcher tells
    /// which tokens continue a copy from it, and with `verbatim` the free strings of a JSON
    /// Schema constraint must be its substrings. Other constraints are unchanged.
    /// `None` for a document too long for the copy automaton (`MAX_DOCUMENT_CHARS`).
    pub fn with_document(&self, document: &str, verbatim: bool) -> Option<CompiledConstraint> {
        match self {
            CompiledConstraint::Json(g) => g.with_document(document, verbatim).map(CompiledConstraint::Json),
            other => Some(other.clone()),
        }
    }

    /// For a JSON Schema, what each keyword became.
    pub fn report(&self) -> Option<&CompileReport> {
        match self {
            CompiledConstraint::Json(g) => Some(g.report()),
            _ => None,
        }
    }
}

/// Most compiled constraints kept; past it the cache starts over.
const MAX_CACHED: usize = 1024;

pub struct StructuredOutputs {
    vocab: Arc<TokenVocab>,
    cache: Mutex<HashMap<String, CompiledConstraint>>,
}

impl StructuredOutputs {
    pub fn new(tokenizer: &Tokenizer) -> Self {
        StructuredOutputs {
            vocab: grammar_vocab(tokenizer),
            cache: Mutex::new(HashMap::new()),
        }
    }

    pub fn vocab(&self) -> &Arc<TokenVocab> {
        &self.vocab
    }

    /// Compiles `c`, or finds it compiled already. Safe to call from any thread: compiling
    /// happens off the engine thread, before a request is queued.
    pub fn compile(&self, c: &Constraint) -> Result<CompiledConstraint, GrammarError> {
        let key = format!("{c:?}");
        if let Some(hit) = self.cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(hit.clone());
        }
        let vocab = self.vocab.clone();
        let compiled = match c {
            Constraint::Json {
                schema,
                whitespace,
                strict,
                close_objects,
                ordered_properties,
            } => {
                let options = SchemaOptions {
                    strict: *strict,
                    close_objects: *close_objects,
                    ordered_properties: *ordered_properties,
                    ..Default::default()
                };
                CompiledConstraint::Json(JsonGrammar::compile(schema, &options, *whitespace, vocab)?)
            }
            Constraint::Regex(r) => CompiledConstraint::Regex(RegexGrammar::compile(r, vocab)?),
            Constraint::Choice(options) => CompiledConstraint::Regex(RegexGrammar::choice(options, vocab)?),
            Constraint::Grammar(text) => CompiledConstraint::Cfg(CfgGrammar::compile(text, vocab)?),
        };
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() >= MAX_CACHED {
            cache.clear();
        }
        cache.insert(key, compiled.clone());
        Ok(compiled)
    }
}

/// The model's vocabulary as bytes per token; control tokens are special, and the
/// end-of-generation ones end a constrained output.
pub fn grammar_vocab(tokenizer: &Tokenizer) -> Arc<TokenVocab> {
    let spellings: Vec<Option<&str>> = (0..tokenizer.vocab_size() as u32)
        .map(|id| tokenizer.token_text(id))
        .collect();
    TokenVocab::from_byte_level(&spellings, tokenizer.control_ids(), tokenizer.end_of_generation_ids())
}
