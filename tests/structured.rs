//! Constrained requests through the engine with the real model: every output of a
//! schema-constrained request parses and validates (checked by the independent `jsonschema`
//! crate), constrained and unconstrained requests share batches, and a schema that fails to
//! compile is a typed error that leaves the other requests alone.

mod common;

use std::sync::Arc;

use quarry::engine::{Constraint, EngineConfig, EngineCore, EngineRequest, FinishReason, StructuredOutputs};
use quarry::sampling::SamplingParams;
use quarry::tokenizer::{ChatMessage, Tokenizer};
use quarry_grammar::json::Whitespace;
use quarry_grammar::GrammarError;
use serde_json::{json, Value};

fn prompt(tok: &Tokenizer, schema: &Value, document: &str) -> Vec<u32> {
    let messages = [
        ChatMessage::new(
            "system",
            &format!("Extract the data from the user's document as JSON matching this JSON Schema:\n{schema}"),
        ),
        ChatMessage::new("user", document),
    ];
    tok.encode(&tok.chat_prompt(&messages).unwrap(), true).unwrap()
}

#[test]
fn constrained_outputs_validate_and_bad_schemas_are_typed_errors() {
    let Some((backend, tok)) = common::load(8192) else {
        return;
    };
    let cases: Vec<Value> = serde_json::from_str(include_str!("data/structured_cases.json")).expect("cases are JSON");
    let tok = Arc::new(tok);
    let structured = StructuredOutputs::new(&tok);
    let mut engine = EngineCore::new(Box::new(backend), tok.clone(), EngineConfig::default());

    let broken = Constraint::Json {
        schema: json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
        whitespace: Whitespace::Compact,
        strict: false,
        close_objects: false,
        ordered_properties: false,
    };
    assert!(
        matches!(structured.compile(&broken), Err(GrammarError::InvalidSchema { ref keyword, .. }) if keyword == "$ref")
    );

    for (i, case) in cases.iter().enumerate() {
        let constraint = structured
            .compile(&Constraint::Json {
                schema: case["schema"].clone(),
                whitespace: Whitespace::Compact,
                strict: false,
                close_objects: false,
                ordered_properties: false,
            })
            .unwrap_or_else(|e| panic!("{}: {e}", case["name"]));
        engine
            .add_request(EngineRequest {
                id: i as u64,
                prompt: prompt(&tok, &case["schema"], case["document"].as_str().unwrap()),
                params: SamplingParams::greedy(256),
                priority: 0,
                constraint: Some(constraint),
            })
            .unwrap();
    }
    // An unconstrained request in the same batches.
    let free = cases.len() as u64;
    engine
        .add_request(EngineRequest {
            id: free,
            prompt: tok.encode("The three primary colors are", false).unwrap(),
            params: SamplingParams::greedy(16),
            priority: 0,
            constraint: None,
        })
        .unwrap();

    let done = engine.run_until_idle(|_| {}).unwrap();
    assert_eq!(done.len(), cases.len() + 1);
    // Required keys in a fixed order are the grammar's to write: they are appended unsampled.
    let forced: usize = done.iter().map(|c| c.metrics.forced_tokens).sum();
    let total: usize = done.iter().map(|c| c.tokens.len()).sum();
    eprintln!("jump-forward: {forced} of {total} output tokens forced");
    assert!(forced > 0, "no token was forced");
    for c in &done {
        if c.id == free {
            assert!(!c.tokens.is_empty());
            continue;
        }
        let case = &cases[c.id as usize];
        assert_eq!(c.finish, FinishReason::Stop, "{}: {:?}", case["name"], c.text);
        let value: Value =
            serde_json::from_str(&c.text).unwrap_or_else(|e| panic!("{}: {e}: {}", case["name"], c.text));
        let validator = jsonschema::validator_for(&case["schema"]).unwrap();
        assert!(validator.is_valid(&value), "{}: {value}", case["name"]);
        eprintln!("{}: {value}", case["name"]);
    }
    let kv = engine.kv();
    assert_eq!(kv.num_free_blocks(), kv.pool().total());
}
