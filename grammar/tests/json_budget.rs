//! Completion costs and token budgets: a schema's minimal document is as long as the cost of
//! the start state says, every state has a byte that brings its cost down by one, and a
//! matcher held to a budget that covers the minimal document always ends with a complete,
//! valid value, whatever the model picks (here: a stand-in that always takes the longest
//! token it is allowed).

mod common;

use std::sync::Arc;

use common::Rng;
use quarry_grammar::json::{JsonGrammar, JsonMatcher, SchemaOptions, Whitespace};
use quarry_grammar::{allowed_tokens, bitmask_words, TokenVocab};
use serde_json::{json, Value};

const EOS: u32 = 0;

/// Every byte as a token, plus multi-byte tokens as a BPE vocabulary has them, so that a
/// token may cost several bytes of the budget at once.
fn vocab() -> Arc<TokenVocab> {
    let mut toks: Vec<Vec<u8>> = vec![b"<|eos|>".to_vec()];
    toks.extend((0..=255u8).map(|b| vec![b]));
    let words = [
        "{\"",
        "\":",
        "\": ",
        "\",\"",
        "\"}",
        "\"]",
        "},",
        "}]",
        "[{",
        "[\"",
        "name",
        "true",
        "false",
        "null",
        "12",
        "345",
        "-1",
        "0.",
        "e+",
        ", ",
        "\n",
        "\\n",
        "\\\"",
        "\\u00",
        "abc",
        " the",
        "é",
        "2024",
        "-01-",
        "aaaaaaaa",
        "aaaaaaaaaaaaaaaa",
        "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
        "99999999",
        "\"}]}",
        "null,",
        "\":\"",
    ];
    toks.extend(words.iter().map(|w| w.as_bytes().to_vec()));
    TokenVocab::new(toks, &[], &[EOS])
}

fn compile(schema: &Value, ordered: bool) -> Arc<JsonGrammar> {
    let options = SchemaOptions {
        strict: false,
        ordered_properties: ordered,
        ..Default::default()
    };
    JsonGrammar::compile(schema, &options, Whitespace::Compact, vocab()).expect("compiles")
}

fn feed(m: &mut JsonMatcher, text: &str) {
    for &b in text.as_bytes() {
        m.accept(1 + b as u32)
            .unwrap_or_else(|e| panic!("{text:?} at {:?}: {e}", b as char));
    }
}

#[test]
fn the_start_costs_the_minimal_document() {
    let cases = [
        (json!({"type": "integer"}), "0"),
        (json!({"type": "string", "minLength": 3}), r#""   ""#),
        (json!({"enum": ["long one", "ab", 12345]}), r#""ab""#),
        (json!({"type": ["object", "null"]}), "{}"),
        (
            json!({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"}},
                   "required": ["a", "b"], "additionalProperties": false}),
            r#"{"a":0,"b":""}"#,
        ),
        (
            json!({"type": "array", "items": {"type": "string", "format": "date"}, "minItems": 2}),
            r#"["0000-01-01","0000-01-01"]"#,
        ),
        (
            json!({"type": "object", "properties": {"xs": {"type": "array", "prefixItems": [{"const": "first"}], "items": {"type": "null"}, "minItems": 3}},
                   "required": ["xs"]}),
            r#"{"xs":["first",null,null]}"#,
        ),
        (
            json!({"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                   "required": ["v", "kids"], "additionalProperties": false}}, "$ref": "#/$defs/node"}),
            r#"{"v":0,"kids":[]}"#,
        ),
        (
            json!({"type": "object", "minProperties": 2, "properties": {"long_name": {"type": "null"}}, "patternProperties": {"^x[0-9]$": {"type": "integer"}}, "additionalProperties": false}),
            r#"{"x0":0,"x0":0}"#,
        ),
    ];
    for (schema, minimal) in cases {
        let g = compile(&schema, false);
        let m = JsonMatcher::new(g.clone());
        assert_eq!(m.completion_cost(), minimal.len() as u64, "{schema}");
        let mut m = JsonMatcher::new(g);
        feed(&mut m, minimal);
        assert!(m.can_finish(), "{minimal} is complete");
        assert_eq!(m.completion_cost(), 0);
    }
}

#[test]
fn costs_follow_the_position_inside_a_document() {
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": ["integer", "null"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1}
    }, "required": ["name", "tags"], "additionalProperties": false});
    let g = compile(&schema, false);
    let at = |text: &str| {
        let mut m = JsonMatcher::new(g.clone());
        feed(&mut m, text);
        m.completion_cost()
    };
    // {"name":"","tags":[""]} is the shortest document: 23 bytes.
    assert_eq!(at(""), 23);
    assert_eq!(at(r#"{"name":"Ada"#), 1 + r#","tags":[""]}"#.len() as u64);
    assert_eq!(at(r#"{"name":"Ada","#), r#""tags":[""]}"#.len() as u64);
    assert_eq!(at(r#"{"name":"Ada","a"#), r#"ge":0,"tags":[""]}"#.len() as u64);
    assert_eq!(at(r#"{"name":"Ada","age":1234"#), r#","tags":[""]}"#.len() as u64);
    assert_eq!(at(r#"{"tags":["x","#), r#"""],"name":""}"#.len() as u64);
    assert_eq!(at(r#"{"tags":["x"],"name":"\u00"#), r#"00"}"#.len() as u64);
}

/// With properties in schema order, every key is the next declared one or a later optional
/// one; a required property is never skipped, and a schema of required properties alone
/// forces each key.
#[test]
fn ordered_properties_come_in_schema_order() {
    let schema = json!({"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}, "d": {"type": "integer"}
    }, "required": ["a", "c"], "additionalProperties": false});
    let g = compile(&schema, true);
    let accepts = |text: &str| {
        let mut m = JsonMatcher::new(g.clone());
        text.bytes().all(|b| m.accept(1 + b as u32).is_ok()) && m.can_finish()
    };
    for ok in [
        r#"{"a":1,"c":2}"#,
        r#"{"a":1,"b":2,"c":3,"d":4}"#,
        r#"{"a":1,"c":2,"d":3}"#,
    ] {
        assert!(accepts(ok), "{ok}");
    }
    for bad in [
        r#"{"c":2,"a":1}"#,
        r#"{"a":1,"d":4,"c":3}"#,
        r#"{"b":1,"a":2,"c":3}"#,
        r#"{"a":1,"c":2,"b":3}"#,
    ] {
        assert!(!accepts(bad), "{bad}");
    }
    // `minProperties` past the required ones: an optional property after a missing required
    // one can still make up the count.
    let counted = json!({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}},
        "required": ["b"], "minProperties": 2, "additionalProperties": false});
    let g = compile(&counted, true);
    assert_eq!(
        JsonMatcher::new(g.clone()).completion_cost(),
        r#"{"a":0,"b":0}"#.len() as u64
    );
    let mut m = JsonMatcher::new(g);
    feed(&mut m, r#"{"b":1"#);
    assert_eq!(m.completion_cost(), r#","c":0}"#.len() as u64);

    let all_required = json!({"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"}},
        "required": ["id", "name"], "additionalProperties": false});
    let mut m = JsonMatcher::new(compile(&all_required, true));
    assert_eq!(m.forced_bytes(), br#"{"id":"#.to_vec());
    feed(&mut m, r#"{"id":7,"#);
    assert_eq!(m.forced_bytes(), br#""name":""#.to_vec());
    assert_eq!(m.completion_cost(), r#""name":""}"#.len() as u64);
}

/// The stand-in's output as JSON; `None` for a number too large for a double (the grammar
/// allows integers of any length, serde_json does not read them), which is still checked to be
/// the only reason.
fn parse(out: &str) -> Option<Value> {
    match serde_json::from_str(out) {
        Ok(v) => Some(v),
        Err(e) if e.to_string().contains("number out of range") => None,
        Err(e) => panic!("{out}: {e}"),
    }
}

/// A stand-in model that always takes the longest token it is allowed, held to `budget`
/// tokens the way the engine holds a request: the plain mask first, and only when the token
/// it picked would leave too little room, the mask that keeps room. Returns the output, or
/// why it failed.
fn run_greedy_longest(g: &Arc<JsonGrammar>, budget: usize) -> Result<String, String> {
    let vocab = g.vocab().clone();
    let mut m = JsonMatcher::new(g.clone());
    let mut mask = vec![0u32; bitmask_words(vocab.vocab_size())];
    let longest = |mask: &[u32]| {
        let tokens: Vec<u32> = allowed_tokens(mask).collect();
        let content = tokens.iter().copied().filter(|&t| t != EOS);
        content
            .max_by_key(|&t| (vocab.token_bytes(t).len(), std::cmp::Reverse(t)))
            .or(tokens.first().copied())
    };
    let mut out = Vec::new();
    for used in 0..budget {
        let room = budget - used - 1;
        m.fill_bitmask(&mut mask);
        let Some(mut t) = longest(&mask) else {
            return Err(format!("empty mask after {:?}", String::from_utf8_lossy(&out)));
        };
        m.accept(t).map_err(|e| e.to_string())?;
        if m.completion_cost() > room as u64 {
            m.rollback(1).map_err(|e| e.to_string())?;
            m.fill_bitmask_within(&mut mask, room);
            t = longest(&mask).ok_or_else(|| format!("no token fits after {:?}", String::from_utf8_lossy(&out)))?;
            m.accept(t).map_err(|e| e.to_string())?;
        }
        if m.is_finished() {
            break;
        }
        out.extend_from_slice(vocab.token_bytes(t));
    }
    if !(m.is_finished() || m.can_finish()) {
        return Err(format!("not complete: {:?}", String::from_utf8_lossy(&out)));
    }
    String::from_utf8(out).map_err(|e| e.to_string())
}

#[test]
fn a_budget_that_covers_the_minimal_document_always_closes() {
    let schemas = [
        json!({"type": "object", "properties": {"name": {"type": "string"}, "notes": {"type": "array", "items": {"type": "string"}}},
               "required": ["name", "notes"], "additionalProperties": false}),
        json!({"$defs": {"node": {"type": "object", "properties": {"value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
               "required": ["value"], "additionalProperties": false}}, "$ref": "#/$defs/node"}),
        json!({"type": "object", "additionalProperties": {"type": "array", "items": {"type": "object"}}}),
        json!({"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 2, "maxItems": 50}),
    ];
    for schema in &schemas {
        for ordered in [false, true] {
            let g = compile(schema, ordered);
            let minimal = JsonMatcher::new(g.clone()).completion_cost() as usize;
            for budget in [minimal, minimal + 1, minimal + 7, minimal + 40] {
                let out = run_greedy_longest(&g, budget).unwrap_or_else(|e| panic!("{schema} budget {budget}: {e}"));
                if let Some(v) = parse(&out) {
                    assert!(jsonschema::is_valid(schema, &v), "{schema}: {out}");
                }
            }
        }
    }
}

/// The corpus, sampled, with random budgets from the minimal document up: the stand-in always
/// ends with a complete value; where every keyword is enforced, it validates.
#[test]
fn corpus_schemas_close_within_random_budgets() {
    let Some(corpus) = common::corpus() else { return };
    let mut rng = Rng(0x5DEECE66D);
    let (mut runs, mut validated) = (0, 0);
    for (i, entry) in corpus.enumerate() {
        if i % 40 != 11 {
            continue;
        }
        let schema = &entry["schema"];
        let ordered = i % 80 == 11;
        let options = SchemaOptions {
            strict: false,
            ordered_properties: ordered,
            ..Default::default()
        };
        let Ok(g) = JsonGrammar::compile(schema, &options, Whitespace::Compact, vocab()) else {
            continue;
        };
        let minimal = JsonMatcher::new(g.clone()).completion_cost();
        if minimal > 2000 {
            continue;
        }
        let budget = minimal as usize + [0, 1, 3, rng.next(64)][rng.next(4)];
        let out = run_greedy_longest(&g, budget).unwrap_or_else(|e| panic!("{}: budget {budget}: {e}", entry["name"]));
        assert!(out.len() <= budget * 64);
        runs += 1;
        if g.report().fully_enforced() {
            let Some(v) = parse(&out) else { continue };
            if let Ok(validator) = jsonschema::validator_for(schema) {
                assert!(validator.is_valid(&v), "{}: {out}", entry["name"]);
                validated += 1;
            }
        }
    }
    eprintln!("{runs} corpus schemas closed within their budgets, {validated} of them validated");
    assert!(runs > 100, "the sample holds most of the corpus's schemas");
}

/// From every state a walk reaches, some single byte lowers the cost by exactly one: the
/// cost is the length of a completion the matcher itself accepts.
#[test]
fn some_byte_always_brings_the_end_one_closer() {
    let schema = json!({"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "when": {"type": ["string", "null"], "format": "date-time"},
        "n": {"type": "number", "minimum": 1.5},
        "kind": {"enum": ["alpha", "beta"]},
        "items": {"type": "array", "items": {"type": "object", "properties": {"q": {"type": "integer"}}, "required": ["q"]}, "minItems": 1}
    }, "required": ["id", "items", "kind"], "patternProperties": {"^z": {"type": "boolean"}}, "additionalProperties": false});
    let g = compile(&schema, false);
    let vocab = g.vocab().clone();
    let mut rng = Rng(7);
    let mut mask = vec![0u32; bitmask_words(vocab.vocab_size())];
    for _ in 0..30 {
        let mut m = JsonMatcher::new(g.clone());
        for _ in 0..200 {
            let cost = m.completion_cost();
            if cost == 0 {
                break;
            }
            let closer = (0..=255u8).any(|b| {
                let ok = m.accept(1 + b as u32).is_ok();
                let fits = ok && m.completion_cost() == cost - 1;
                if ok {
                    m.rollback(1).unwrap();
                }
                fits
            });
            assert!(closer, "cost {cost} and no byte lowers it");
            m.fill_bitmask(&mut mask);
            let tokens: Vec<u32> = allowed_tokens(&mask).filter(|&t| t != EOS).collect();
            m.accept(tokens[rng.next(tokens.len())]).unwrap();
        }
    }
}
