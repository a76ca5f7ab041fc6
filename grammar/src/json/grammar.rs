//! A compiled JSON Schema constraint: the schema graph plus the automata the matcher steps
//! through (one DFA per distinct scalar lexeme, one key DFA per object).

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::compile::{compile_schema, SchemaOptions};
use super::completion::Costs;
use super::ir::{Node, NodeId, ObjectRules, SchemaGraph, StringRules};
use super::lexemes::{literal_regex, number_lexeme, pattern_body, string_body, NumberLexeme, Whitespace};
use super::report::CompileReport;
use crate::dfa::{ByteDfa, DfaLimits, StateId, DEAD};
use crate::document::DocumentSpans;
use crate::error::GrammarError;
use crate::trie::TokTrie;
use crate::vocab::TokenVocab;

pub type LexId = u32;

/// How a scalar node is matched: a whole lexeme (numbers, literals), or a string body between
/// quotes the matcher handles itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lexeme {
    Whole(LexId),
    StringBody(LexId),
}

/// An object's keys as one DFA of several patterns over the key's body (between the quotes):
/// declared names first, then the pattern properties, then (when allowed) any other string.
pub struct KeyAutomaton {
    pub dfa: ByteDfa,
    pub num_props: u32,
    /// Per declared name, the bytes of its JSON spelling between the quotes.
    pub name_len: Vec<u32>,
    /// The declared indices of the required names, ascending.
    pub required_sorted: Vec<u32>,
    /// Value schema of each pattern, by pattern index.
    pub values: Vec<NodeId>,
    /// Declared property index of each required name.
    pub required: Vec<u32>,
    /// Some key beyond the declared ones can always be added.
    pub open: bool,
    /// Any string may be a key (additional properties allowed): every live state can still
    /// end as such a key, so which keys stay inside depends on the DFA state alone.
    pub any_key: bool,
    /// Per state, whether every state reachable from it can still end as a pattern property
    /// or other key: then which tokens stay inside the key does not depend on the properties
    /// already seen, and the DFA's own inner mask (`inner`) is exact.
    pub seen_free: Vec<bool>,
    /// Per state, the tokens the key DFA takes whole without ending, for `seen_free` states.
    pub inner: Vec<OnceLock<Arc<[u32]>>>,
}

/// A compiled JSON Schema constraint, and for one request the document its free strings are
/// copied from (see `with_document`). What the schema compiled to is shared by every request.
pub struct JsonGrammar {
    compiled: Arc<Compiled>,
    /// The document of the request, if it has one.
    pub(crate) document: Option<Arc<DocumentSpans>>,
    /// Free strings are copies from the document.
    verbatim: bool,
    /// With verbatim, the lexemes of length-bounded free strings: entry `i` (a string body
    /// with its bound) gives lexeme `DOCUMENT - 1 - i`, the document's copies within that
    /// bound (see `Body::Within`).
    bounded: Vec<LexId>,
}

impl std::ops::Deref for JsonGrammar {
    type Target = Compiled;
    fn deref(&self) -> &Compiled {
        &self.compiled
    }
}

/// The lexeme id of the document's substrings (see `JsonGrammar::with_document`).
pub(crate) const DOCUMENT: LexId = LexId::MAX - 1;

/// What a schema compiled to: the graph, the automata, the report.
pub struct Compiled {
    pub(crate) graph: SchemaGraph,
    pub(crate) whitespace: Whitespace,
    pub(crate) lexemes: Vec<Arc<ByteDfa>>,
    /// Per node, the lexeme of a scalar node; for an `AnyOf`, the union of its string
    /// alternatives (when it has several), which then stand for all of them.
    pub(crate) node_lexeme: Vec<Option<Lexeme>>,
    /// Per node, the keys of an object node.
    pub(crate) keys: Vec<Option<KeyAutomaton>>,
    /// The plain string body, when some object takes any key: a key's bytes are followed
    /// through it as well (see `Frame::Key`).
    pub(crate) any_string: Option<LexId>,
    pub(crate) vocab: Arc<TokenVocab>,
    /// The tokens containing a quote: the only tokens that can leave a string body.
    pub(crate) quote_trie: Arc<TokTrie>,
    /// Per lexeme and DFA state, the tokens that stay inside that lexeme: they depend on the
    /// state alone, so each is computed once.
    inner: Vec<Vec<OnceLock<Arc<[u32]>>>>,
    /// The regex each lexeme was built from (the key of the vocabulary's shared mask cache).
    lexeme_regex: Vec<String>,
    report: CompileReport,
    /// Declared properties come in schema order (see `SchemaOptions::ordered_properties`).
    pub(crate) ordered: bool,
    /// What values cost at the least, for completion costs; computed on first use.
    pub(crate) costs: OnceLock<Costs>,
    /// Per node, whether it is a free string (no `format`, `pattern` or `minLength`): one
    /// that a document can fill with any of its substrings (within its `maxLength`). A
    /// `minLength` is left out because the fewest bytes that close the record (the token
    /// budget's guarantee) are worked out once per schema, and a copy of at least n
    /// characters may take more bytes than n plain ones.
    free_string: Vec<bool>,
    /// Per lexeme, whether it is a closed choice of strings (`enum`, `const`).
    pub(crate) choice: Vec<bool>,
}

impl JsonGrammar {
    pub fn compile(
        schema: &Value,
        options: &SchemaOptions,
        whitespace: Whitespace,
        vocab: Arc<TokenVocab>,
    ) -> Result<Arc<Self>, GrammarError> {
        let (mut graph, report) = compile_schema(schema, options)?;
        expand_any(&mut graph);
        let mut b = Builder {
            vocab: &vocab,
            lexemes: Vec::new(),
            regexes: Vec::new(),
            by_regex: HashMap::new(),
            limits: Limits::new(options),
            choices: Vec::new(),
        };
        let mut node_lexeme = vec![None; graph.nodes.len()];
        let mut keys: Vec<Option<KeyAutomaton>> = (0..graph.nodes.len()).map(|_| None).collect();
        for id in 0..graph.nodes.len() {
            b.limits.check()?;
            node_lexeme[id] = match &graph.nodes[id] {
                Node::Null => Some(Lexeme::Whole(b.lexeme("null")?)),
                Node::Boolean => Some(Lexeme::Whole(b.lexeme("true|false")?)),
                Node::Integer(r) => Some(Lexeme::Whole(b.number(&number_lexeme(r, true).0)?)),
                Node::Number(r) => Some(Lexeme::Whole(b.number(&number_lexeme(r, false).0)?)),
                Node::String(r) => Some(Lexeme::StringBody(b.lexeme(&string_body(r).0)?)),
                Node::Literals(vs) => Some(Lexeme::Whole(b.literals(vs, whitespace)?)),
                Node::Object(o) => {
                    let k = key_automaton(o, &graph, &vocab)?;
                    b.limits.bytes += k.dfa.heap_bytes();
                    keys[id] = Some(k);
                    None
                }
                Node::AnyOf(alts) => b.string_union(alts, &graph)?,
                _ => None,
            };
        }
        b.limits.check()?;
        let any_string = if keys.iter().flatten().any(|k| k.any_key) {
            Some(b.lexeme(&string_body(&StringRules::default()).0)?)
        } else {
            None
        };
        let inner = b
            .lexemes
            .iter()
            .map(|d| (0..d.num_states()).map(|_| OnceLock::new()).collect())
            .collect();
        let free_string = graph
            .nodes
            .iter()
            .map(|n| matches!(n, Node::String(r) if r.format.is_none() && r.pattern.is_none() && r.min_length == 0))
            .collect();
        let mut choice = vec![false; b.lexemes.len()];
        for &id in &b.choices {
            choice[id as usize] = true;
        }
        let compiled = Compiled {
            choice,
            quote_trie: vocab.trie_with_byte(b'"'),
            inner,
            lexeme_regex: b.regexes,
            graph,
            whitespace,
            lexemes: b.lexemes,
            node_lexeme,
            keys,
            any_string,
            vocab,
            report,
            ordered: options.ordered_properties,
            costs: OnceLock::new(),
            free_string,
        };
        Ok(Arc::new(JsonGrammar {
            compiled: Arc::new(compiled),
            document: None,
            verbatim: false,
            bounded: Vec::new(),
        }))
    }

    /// This grammar for one request with a document: with `verbatim`, its free strings (no
    /// `enum`, `const`, `format`, `pattern` or `minLength`) must be substrings of `document`,
    /// JSON-escaped as they must be, and within their `maxLength`, so the model can copy a
    /// name or an address but not invent one; either way the matcher tells which tokens
    /// continue a copy (`copy_mask`). Everything compiled is shared; the document's automata
    /// and their masks belong to the request. `None` for a document longer than
    /// `MAX_DOCUMENT_CHARS`.
    pub fn with_document(&self, document: &str, verbatim: bool) -> Option<Arc<JsonGrammar>> {
        let spans = DocumentSpans::new(document, self.vocab.clone())?;
        let mut bounded = Vec::new();
        if verbatim {
            let mut seen = Vec::new();
            for (node, n) in self.graph.nodes.iter().enumerate() {
                let Node::String(r) = n else { continue };
                let Some(Lexeme::StringBody(own)) = self.node_lexeme[node] else {
                    continue;
                };
                if !self.free_string[node] || r.max_length.is_none() || seen.contains(&own) {
                    continue;
                }
                seen.push(own);
                // Pair states must fit a state id: they do by a wide margin (a document of
                // `MAX_DOCUMENT_CHARS` has some 10^5 states, a bound of `MAX_COUNTED_LENGTH`
                // some 10^3), but a string that would not keeps its own constraint.
                let width = self.lexemes[own as usize].num_states() as u64;
                if spans.dfa().num_states() as u64 * width < StateId::MAX as u64 {
                    bounded.push(own);
                }
            }
        }
        Some(Arc::new(JsonGrammar {
            compiled: self.compiled.clone(),
            document: Some(Arc::new(spans)),
            verbatim,
            bounded,
        }))
    }

    /// The automaton of lexeme `lex`, which is not a bounded copy (those are string bodies:
    /// see `body`).
    pub(crate) fn lexeme(&self, lex: LexId) -> &ByteDfa {
        match &self.document {
            Some(d) if lex == DOCUMENT => d.dfa(),
            _ => &self.lexemes[lex as usize],
        }
    }

    /// How the string body of lexeme `lex` is stepped.
    pub(crate) fn body(&self, lex: LexId) -> Body<'_> {
        match (self.bounded_lexeme(lex), &self.document) {
            (Some(own), Some(d)) => Body::Within {
                doc: d.dfa(),
                own: &self.lexemes[own as usize],
                width: self.lexemes[own as usize].num_states() as StateId,
            },
            _ => Body::Dfa(self.lexeme(lex)),
        }
    }

    /// The string body whose bound lexeme `lex` copies within, if it is a bounded copy.
    fn bounded_lexeme(&self, lex: LexId) -> Option<LexId> {
        let i = (DOCUMENT - 1).checked_sub(lex)?;
        self.bounded.get(i as usize).copied()
    }

    /// How node `node` is matched: with a document, its free strings are the document's
    /// substrings, and a union of string alternatives that holds a free one is matched
    /// alternative by alternative.
    pub(crate) fn lexeme_of(&self, node: NodeId) -> Option<Lexeme> {
        let plain = self.node_lexeme[node as usize];
        if !self.verbatim {
            return plain;
        }
        match self.graph.node(node) {
            Node::String(r) if self.free_string[node as usize] && r.max_length.is_none() => {
                Some(Lexeme::StringBody(DOCUMENT))
            }
            Node::String(_) if self.free_string[node as usize] => match plain {
                Some(Lexeme::StringBody(own)) => match self.bounded.iter().position(|&l| l == own) {
                    Some(i) => Some(Lexeme::StringBody(DOCUMENT - 1 - i as LexId)),
                    None => plain,
                },
                other => other,
            },
            Node::AnyOf(alts) if plain.is_some() && alts.iter().any(|&a| self.free_string[a as usize]) => None,
            _ => plain,
        }
    }

    /// The tokens the key DFA of object `node` takes whole from `state` (a `seen_free` state).
    pub(crate) fn key_inner_mask<'a>(&'a self, keys: &'a KeyAutomaton, state: StateId) -> &'a [u32] {
        keys.inner[state as usize].get_or_init(|| crate::regex::dfa_token_mask(&keys.dfa, state, &self.vocab).into())
    }

    /// Adds to `mask` the tokens the string body `lex` takes whole from `state` without
    /// ending. A bounded copy takes a token where both of its automata do.
    pub(crate) fn or_body_mask(&self, mask: &mut [u32], lex: LexId, state: StateId) {
        match (self.bounded_lexeme(lex), &self.document) {
            (Some(own), Some(doc)) => {
                let width = self.lexemes[own as usize].num_states() as StateId;
                let (copies, inside) = (doc.continuing(state / width), self.inner_mask(own, state % width));
                for ((m, c), i) in mask.iter_mut().zip(copies).zip(inside) {
                    *m |= c & i;
                }
            }
            _ => {
                for (m, b) in mask.iter_mut().zip(self.inner_mask(lex, state)) {
                    *m |= b;
                }
            }
        }
    }

    /// The tokens lexeme `lex` takes whole from `state` without ending.
    pub(crate) fn inner_mask(&self, lex: LexId, state: StateId) -> &[u32] {
        if let Some(d) = self.document.as_ref().filter(|_| lex == DOCUMENT) {
            return d.continuing(state);
        }
        self.inner[lex as usize][state as usize].get_or_init(|| {
            let dfa = &self.lexemes[lex as usize];
            self.vocab.lexeme_mask(&self.lexeme_regex[lex as usize], state, || {
                crate::regex::dfa_token_mask(dfa, state, &self.vocab)
            })
        })
    }

    pub fn report(&self) -> &CompileReport {
        &self.report
    }

    pub fn vocab(&self) -> &Arc<TokenVocab> {
        &self.vocab
    }
}

/// What one schema may cost to compile, so that a hostile one cannot starve the server:
/// checked between the automata it builds (each of which `DfaLimits` bounds on its own).
struct Limits {
    started: Instant,
    max_time: Duration,
    max_bytes: usize,
    /// Heap bytes of the automata built so far.
    bytes: usize,
}

impl Limits {
    fn new(options: &SchemaOptions) -> Self {
        Limits {
            started: Instant::now(),
            max_time: options.max_compile_time,
            max_bytes: options.max_automata_bytes,
            bytes: 0,
        }
    }

    fn check(&self) -> Result<(), GrammarError> {
        let past = |reason: String| {
            Err(GrammarError::TooLarge {
                what: "schema".into(),
                reason,
            })
        };
        if self.started.elapsed() > self.max_time {
            return past(format!(
                "compiling it takes longer than {:.1} s, the limit per schema",
                self.max_time.as_secs_f64()
            ));
        }
        if self.bytes > self.max_bytes {
            let limit = match self.max_bytes {
                b if b >= 1 << 20 => format!("{} MiB", b >> 20),
                b => format!("{b} bytes"),
            };
            return past(format!("its automata take more than {limit}, the limit per schema"));
        }
        Ok(())
    }
}

struct Builder<'a> {
    limits: Limits,
    /// Lexemes that are a closed choice of strings (`enum`, `const`).
    choices: Vec<LexId>,
    vocab: &'a TokenVocab,
    lexemes: Vec<Arc<ByteDfa>>,
    /// The regex of each lexeme, by id.
    regexes: Vec<String>,
    by_regex: HashMap<String, LexId>,
}

impl Builder<'_> {
    fn lexeme(&mut self, regex: &str) -> Result<LexId, GrammarError> {
        if let Some(&id) = self.by_regex.get(regex) {
            return Ok(id);
        }
        let dfa = self.vocab.dfa(regex)?;
        Ok(self.add(regex, dfa))
    }

    /// A number lexeme: one regex's DFA, or the product of several with the remainder DFA.
    fn number(&mut self, n: &NumberLexeme) -> Result<LexId, GrammarError> {
        if let ([regex], None) = (n.regexes.as_slice(), n.multiple_of) {
            return self.lexeme(regex);
        }
        // NUL keeps these keys apart from any regex's (see `string_union`).
        let key = format!("\0{:?}", n);
        if let Some(&id) = self.by_regex.get(&key) {
            return Ok(id);
        }
        let mut parts = n
            .regexes
            .iter()
            .map(|r| self.vocab.dfa(r))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(k) = n.multiple_of {
            parts.push(Arc::new(ByteDfa::multiples_of(k)));
        }
        let refs: Vec<&ByteDfa> = parts.iter().map(|p| p.as_ref()).collect();
        let dfa = ByteDfa::intersection(&refs, DfaLimits::default().max_states)?;
        Ok(self.add(&key, Arc::new(dfa)))
    }

    /// The lexeme of `enum`/`const` values. Scalars are exact words, put in a trie directly;
    /// objects and arrays admit whitespace, so they go through a regex.
    fn literals(&mut self, values: &[Value], ws: Whitespace) -> Result<LexId, GrammarError> {
        let regex = values
            .iter()
            .map(|v| format!("(?:{})", literal_regex(v, ws)))
            .collect::<Vec<_>>()
            .join("|");
        if let Some(&id) = self.by_regex.get(&regex) {
            return Ok(id);
        }
        if values.iter().any(|v| v.is_object() || v.is_array()) {
            return self.lexeme(&regex);
        }
        let words: Vec<String> = values.iter().map(|v| v.to_string()).collect();
        let refs: Vec<&[u8]> = words.iter().map(|w| w.as_bytes()).collect();
        let id = self.add(&regex, Arc::new(ByteDfa::literals(&refs)));
        if values.iter().all(Value::is_string) {
            self.choices.push(id);
        }
        Ok(id)
    }

    /// One string body for the string alternatives of an `anyOf`: a string takes one walk of
    /// their union instead of one per alternative (seven date patterns cost seven walks of a
    /// 151k vocabulary otherwise). Exact: the alternatives' union is what `anyOf` admits.
    fn string_union(&mut self, alts: &[NodeId], graph: &SchemaGraph) -> Result<Option<Lexeme>, GrammarError> {
        let bodies: Vec<String> = alts
            .iter()
            .filter_map(|&a| match graph.node(a) {
                Node::String(r) => Some(string_body(r).0),
                _ => None,
            })
            .collect();
        if bodies.len() < 2 {
            return Ok(None);
        }
        // A NUL no generated regex contains keeps this product DFA's states apart from those of
        // a regex-automata DFA of the same text in the vocabulary's mask cache.
        let key = "\0".to_string() + &bodies.iter().map(|b| format!("(?:{b})")).collect::<Vec<_>>().join("|");
        if let Some(&id) = self.by_regex.get(&key) {
            return Ok(Some(Lexeme::StringBody(id)));
        }
        let parts = bodies
            .iter()
            .map(|b| self.vocab.dfa(b))
            .collect::<Result<Vec<_>, _>>()?;
        let refs: Vec<&ByteDfa> = parts.iter().map(|p| p.as_ref()).collect();
        // Past the state limit the alternatives are simply matched one by one.
        Ok(ByteDfa::union(&refs, DfaLimits::default().max_states)
            .ok()
            .map(|dfa| Lexeme::StringBody(self.add(&key, Arc::new(dfa)))))
    }

    fn add(&mut self, regex: &str, dfa: Arc<ByteDfa>) -> LexId {
        self.limits.bytes += dfa.heap_bytes();
        let id = self.lexemes.len() as LexId;
        self.lexemes.push(dfa);
        self.regexes.push(regex.to_string());
        self.by_regex.insert(regex.to_string(), id);
        id
    }
}

/// Replaces every `Any` by an alias of one "any JSON value" node: objects and arrays of any
/// values, strings, numbers, booleans and null.
fn expand_any(graph: &mut SchemaGraph) {
    let any = graph.nodes.len() as NodeId;
    let alias = || Node::AnyOf(vec![any]);
    let push = |g: &mut SchemaGraph, n: Node| {
        g.nodes.push(n);
        (g.nodes.len() - 1) as NodeId
    };
    graph.nodes.push(Node::Never); // placeholder for `any`
    let object = push(
        graph,
        Node::Object(ObjectRules {
            properties: Vec::new(),
            required: Vec::new(),
            pattern_properties: Vec::new(),
            additional: any,
            min_properties: 0,
            max_properties: None,
            property_names: None,
        }),
    );
    let array = push(
        graph,
        Node::Array(super::ir::ArrayRules {
            prefix: Vec::new(),
            items: any,
            min_items: 0,
            max_items: None,
        }),
    );
    let string = push(graph, Node::String(StringRules::default()));
    let number = push(graph, Node::Number(Default::default()));
    let boolean = push(graph, Node::Boolean);
    let null = push(graph, Node::Null);
    graph.nodes[any as usize] = Node::AnyOf(vec![object, array, string, number, boolean, null]);
    for n in graph.nodes.iter_mut() {
        if *n == Node::Any {
            *n = alias();
        }
    }
}

fn key_automaton(o: &ObjectRules, graph: &SchemaGraph, vocab: &TokenVocab) -> Result<KeyAutomaton, GrammarError> {
    let mut names: Vec<(String, NodeId)> = o.properties.clone();
    // Required names without a declared schema are still tracked, with the schema an
    // undeclared key would get.
    for r in &o.required {
        if !names.iter().any(|(n, _)| n == r) {
            names.push((r.clone(), o.additional));
        }
    }
    // A key's body: its JSON encoding without the quotes.
    let bodies: Vec<String> = names
        .iter()
        .map(|(n, _)| {
            let quoted = Value::String(n.clone()).to_string();
            quoted[1..quoted.len() - 1].to_string()
        })
        .collect();
    let words: Vec<&[u8]> = bodies.iter().map(|b| b.as_bytes()).collect();
    let mut parts = vec![Arc::new(ByteDfa::literals(&words))];
    let mut values: Vec<NodeId> = names.iter().map(|(_, v)| *v).collect();
    for (p, node) in &o.pattern_properties {
        if let Ok(body) = pattern_body(p) {
            parts.push(vocab.dfa(&body)?);
            values.push(*node);
        }
    }
    let any_key = !matches!(graph.node(o.additional), Node::Never);
    if any_key {
        parts.push(vocab.dfa(&string_body(&StringRules::default()).0)?);
        values.push(o.additional);
    }
    let refs: Vec<&ByteDfa> = parts.iter().map(|p| p.as_ref()).collect();
    let dfa = ByteDfa::union(&refs, DfaLimits::default().max_states)?;
    let required: Vec<u32> = o
        .required
        .iter()
        .filter_map(|r| names.iter().position(|(n, _)| n == r))
        .map(|i| i as u32)
        .collect();
    let mut required_sorted = required.clone();
    required_sorted.sort_unstable();
    let num_props = names.len() as u32;
    Ok(KeyAutomaton {
        name_len: bodies.iter().map(|b| b.len() as u32).collect(),
        required_sorted,
        seen_free: seen_free(&dfa, num_props),
        inner: (0..dfa.num_states()).map(|_| OnceLock::new()).collect(),
        any_key,
        dfa,
        num_props,
        open: values.len() > names.len(),
        values,
        required,
    })
}

/// Per state of a key DFA, whether every state reachable from it (itself included) can still
/// reach a pattern beyond the first `num_props` (the declared names).
fn seen_free(dfa: &ByteDfa, num_props: u32) -> Vec<bool> {
    let n = dfa.num_states();
    let mut free: Vec<bool> = (0..n)
        .map(|s| dfa.reachable(s as StateId).iter().any(|&p| p >= num_props))
        .collect();
    free[crate::dfa::DEAD as usize] = true;
    // Successors mostly have higher ids, so a backward sweep settles most states at once.
    loop {
        let mut changed = false;
        for s in (1..n).rev() {
            if free[s] && dfa.successors(s as StateId).any(|t| !free[t as usize]) {
                free[s] = false;
                changed = true;
            }
        }
        if !changed {
            return free;
        }
    }
}

/// A string body's automaton as the matcher steps it.
#[derive(Clone, Copy)]
pub(crate) enum Body<'a> {
    Dfa(&'a ByteDfa),
    /// The document's copies that `own` (a string body with a length bound) also accepts,
    /// stepped as a pair without building their product (which would take about the
    /// document's length times the bound in states, at every request): state
    /// `doc * width + own`, `DEAD` once either is.
    Within {
        doc: &'a ByteDfa,
        own: &'a ByteDfa,
        width: StateId,
    },
}

impl Body<'_> {
    fn pair(doc: StateId, own: StateId, width: StateId) -> StateId {
        match doc == DEAD || own == DEAD {
            true => DEAD,
            false => doc * width + own,
        }
    }

    pub(crate) fn start(self) -> StateId {
        match self {
            Body::Dfa(d) => d.start(),
            Body::Within { doc, own, width } => Self::pair(doc.start(), own.start(), width),
        }
    }

    pub(crate) fn next(self, s: StateId, b: u8) -> StateId {
        match self {
            Body::Dfa(d) => d.next(s, b),
            Body::Within { doc, own, width } => Self::pair(doc.next(s / width, b), own.next(s % width, b), width),
        }
    }

    pub(crate) fn is_accepting(self, s: StateId) -> bool {
        match self {
            Body::Dfa(d) => d.is_accepting(s),
            Body::Within { doc, own, width } => s != DEAD && doc.is_accepting(s / width) && own.is_accepting(s % width),
        }
    }

    /// Both automata read the same bytes, so both are mid-way through the same character or
    /// escape, and (with no `minLength`) the pair can end once it is complete, the way the
    /// document completes it: the document's distance, which is never below the bound's (a
    /// `\` the document only continues as `\u00XX` is 5 bytes from the end for it, 1 for the
    /// bound). The larger of the two is that.
    pub(crate) fn distance_to_accept(self, s: StateId) -> u32 {
        match self {
            Body::Dfa(d) => d.distance_to_accept(s),
            Body::Within { doc, own, width } => {
                doc.distance_to_accept(s / width).max(own.distance_to_accept(s % width))
            }
        }
    }
}
