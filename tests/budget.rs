//! Token budgets with the real model: a constrained request whose `max_tokens` covers its
//! schema's minimal document always ends with a record that validates, never `Length`;
//! a smaller `max_tokens` is refused when the request is added; and a grammar that fails under
//! one request ends that request alone as internal, the others going on as if it were not there.

mod common;

use std::sync::Arc;

use quarry::engine::{
    AddError, CompiledConstraint, Constraint, EngineConfig, EngineCore, EngineRequest, FinishReason, StructuredOutputs,
};
use quarry::sampling::SamplingParams;
use quarry::tokenizer::{ChatMessage, Tokenizer};
use quarry_grammar::json::Whitespace;
use quarry_grammar::{GrammarError, Matcher, TokenId};
use serde_json::{json, Value};

fn prompt(tok: &Tokenizer, schema: &Value, document: &str) -> Vec<u32> {
    let system = format!("Extract the data from the user's document as JSON matching this JSON Schema:\n{schema}");
    tok.encode_chat(&[ChatMessage::new("system", &system), ChatMessage::new("user", document)])
        .unwrap()
}

fn compile(
    structured: &StructuredOutputs,
    schema: &Value,
    whitespace: Whitespace,
    ordered: bool,
) -> CompiledConstraint {
    structured
        .compile(&Constraint::Json {
            schema: schema.clone(),
            whitespace,
            strict: false,
            close_objects: true,
            ordered_properties: ordered,
        })
        .unwrap_or_else(|e| panic!("{schema}: {e}"))
}

fn minimal(c: &CompiledConstraint) -> usize {
    c.matcher().completion_cost().expect("JSON constraints know their cost")
}

/// Schemas whose records the model tends to write long (arrays, free text), and the
/// development set's schemas when ../shared is there.
fn schemas() -> Vec<(Value, String)> {
    let mut out = vec![
        (
            json!({"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object",
                "properties": {"name": {"type": "string"}, "qty": {"type": "integer"}}, "required": ["name", "qty"]}, "minItems": 2},
                "note": {"type": "string"}}, "required": ["items", "note"]}),
            "Order: 3 apples, 2 pears, 7 plums, 1 melon, 12 figs, 4 limes and a note saying thanks.".to_string(),
        ),
        (
            json!({"type": "array", "items": {"type": "string"}, "minItems": 5}),
            "Name every color you know.".to_string(),
        ),
        (
            json!({"$defs": {"node": {"type": "object", "properties": {"label": {"type": "string"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["label", "children"]}},
                "$ref": "#/$defs/node"}),
            "A family tree: Ann has Bo and Cy; Bo has Di.".to_string(),
        ),
    ];
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/data/extract-dev.jsonl");
    match std::fs::read_to_string(path) {
        Ok(text) => {
            for line in text.lines().step_by(4) {
                let case: Value = serde_json::from_str(line).unwrap();
                out.push((case["schema"].clone(), case["document"].as_str().unwrap().to_string()));
            }
        }
        Err(_) => eprintln!("note: {path} not found; the development set's schemas are left out"),
    }
    out
}

#[test]
fn a_budget_that_covers_the_minimal_document_always_ends_with_a_valid_record() {
    // On the GPU (QUARRY_TEST_DEVICE=cuda) steps are pipelined, and a row drawn again under
    // the budget's mask is drawn beside the pass queued after it.
    let Some((backend, tok)) = common::load_backend(32768) else {
        return;
    };
    let tok = Arc::new(tok);
    let structured = StructuredOutputs::new(&tok);
    let mut engine = EngineCore::new(backend, tok.clone(), EngineConfig::default());
    let mut expect = Vec::new();
    let mut id = 0u64;
    for (i, (schema, document)) in schemas().into_iter().enumerate() {
        let ws = [Whitespace::Compact, Whitespace::Flexible { max_run: 4 }][i % 2];
        let constraint = compile(&structured, &schema, ws, i % 3 != 0);
        let least = minimal(&constraint);
        // The minimal document exactly, a little more, and a sampled request at a budget
        // between (seeded, so the test is repeatable).
        for (budget, temperature) in [(least, 0.0), (least + 3, 0.0), (least + 1 + i % 7, 1.0)] {
            engine
                .add_request(EngineRequest {
                    id,
                    prompt: prompt(&tok, &schema, &document),
                    params: SamplingParams {
                        temperature,
                        seed: Some(id),
                        ..SamplingParams::greedy(budget)
                    },
                    priority: 0,
                    constraint: Some(constraint.clone()),
                })
                .unwrap();
            expect.push((id, schema.clone(), budget));
            id += 1;
        }
    }
    let done = engine.run_until_idle(|_| {}).unwrap();
    let mut closed = 0;
    for ((id, schema, budget), c) in expect.iter().zip(&done) {
        assert_eq!(c.id, *id);
        assert_eq!(c.finish, FinishReason::Stop, "{schema} in {budget} tokens: {}", c.text);
        assert!(c.tokens.len() <= *budget, "{} tokens of {budget}", c.tokens.len());
        let v: Value = serde_json::from_str(&c.text).unwrap_or_else(|e| panic!("{e}: {}", c.text));
        let validator = jsonschema::validator_for(schema).unwrap();
        assert!(validator.is_valid(&v), "{schema}: {v}");
        closed += c.metrics.budget_closed as usize;
    }
    eprintln!("{} requests, {closed} closed by their budget", done.len());
    assert!(
        closed > 0,
        "no request was closed by its budget: the test does not test it"
    );
    assert_eq!(engine.stats().kv_blocks_free, engine.stats().kv_blocks_total);
}

#[test]
fn max_tokens_below_the_minimal_document_is_refused() {
    let Some((backend, tok)) = common::load(4096) else {
        return;
    };
    let tok = Arc::new(tok);
    let structured = StructuredOutputs::new(&tok);
    let mut engine = EngineCore::new(Box::new(backend), tok.clone(), EngineConfig::default());
    let schema = json!({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"]});
    let constraint = compile(&structured, &schema, Whitespace::Compact, true);
    // {"name":"","age":0}
    assert_eq!(minimal(&constraint), 19);
    let request = |max_tokens| EngineRequest {
        id: max_tokens as u64,
        prompt: prompt(&tok, &schema, "Ada, 36."),
        params: SamplingParams::greedy(max_tokens),
        priority: 0,
        constraint: Some(constraint.clone()),
    };
    match engine.add_request(request(18)) {
        Err(AddError::MaxTokensTooSmall {
            max_tokens: 18,
            minimum: 19,
        }) => {}
        other => panic!("{:?}", other.err()),
    }
    engine.add_request(request(19)).unwrap();
    // A schema no value satisfies has no shortest output at all.
    let none = json!({"type": "object", "properties": {"a": false}, "required": ["a"]});
    let refused = engine.add_request(EngineRequest {
        constraint: Some(compile(&structured, &none, Whitespace::Compact, true)),
        ..request(100)
    });
    assert!(matches!(refused, Err(AddError::NoValidOutput)), "{:?}", refused.err());
    let done = engine.run_until_idle(|_| {}).unwrap();
    assert_eq!(done[0].finish, FinishReason::Stop, "{}", done[0].text);
}

/// A matcher with a bug: it allows everything and panics on the third token it is asked to
/// take.
struct Faulty(usize);

impl Matcher for Faulty {
    fn fill_bitmask(&mut self, mask: &mut [u32]) {
        mask.fill(u32::MAX);
    }
    fn accept(&mut self, _token: TokenId) -> Result<(), GrammarError> {
        self.0 += 1;
        assert!(self.0 < 3, "index out of bounds in a grammar frame");
        Ok(())
    }
    fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        self.0 -= n;
        Ok(())
    }
    fn is_finished(&self) -> bool {
        false
    }
    fn can_finish(&self) -> bool {
        false
    }
    fn forced_bytes(&mut self) -> Vec<u8> {
        Vec::new()
    }
}

#[test]
fn a_grammar_that_panics_fails_its_request_alone() {
    let Some((backend, tok)) = common::load(4096) else {
        return;
    };
    let tok = Arc::new(tok);
    let structured = StructuredOutputs::new(&tok);
    let schema = json!({"type": "object", "properties": {"color": {"type": "string"}}, "required": ["color"]});
    let constraint = compile(&structured, &schema, Whitespace::Compact, true);
    let requests = |faulty: bool| {
        let mut r = vec![
            EngineRequest {
                id: 0,
                prompt: prompt(&tok, &schema, "The car is red."),
                params: SamplingParams::greedy(40),
                priority: 0,
                constraint: Some(constraint.clone()),
            },
            EngineRequest {
                id: 1,
                prompt: tok.encode("The three primary colors are", false).unwrap(),
                params: SamplingParams::greedy(16),
                priority: 0,
                constraint: None,
            },
        ];
        if faulty {
            r.push(EngineRequest {
                id: 2,
                prompt: tok.encode("Count: one, two,", false).unwrap(),
                params: SamplingParams::greedy(16),
                priority: 0,
                constraint: Some(CompiledConstraint::Custom(Arc::new(|| Box::new(Faulty(0))))),
            });
        }
        r
    };
    let (backend, alone) = {
        let mut engine = EngineCore::new(Box::new(backend), tok.clone(), EngineConfig::default());
        for r in requests(false) {
            engine.add_request(r).unwrap();
        }
        let done = engine.run_until_idle(|_| {}).unwrap();
        (engine.into_backend(), done)
    };
    let mut engine = EngineCore::new(backend, tok.clone(), EngineConfig::default());
    for r in requests(true) {
        engine.add_request(r).unwrap();
    }
    let done = engine.run_until_idle(|_| {}).unwrap();
    assert_eq!(done.len(), 3);
    assert_eq!(done[2].finish, FinishReason::Internal);
    assert_eq!(
        done[2].metrics.grammar_failure.as_deref(),
        Some("index out of bounds in a grammar frame")
    );
    assert_eq!(done[0].finish, FinishReason::Stop, "{}", done[0].text);
    for (with, without) in done[..2].iter().zip(&alone) {
        assert_eq!(with.finish, without.finish);
        assert_eq!(with.tokens, without.tokens, "the other requests are untouched");
    }
    assert_eq!(engine.stats().kv_blocks_free, engine.stats().kv_blocks_total);
}
