//! The JSON Schema matcher: every output it allows validates (checked by the independent
//! `jsonschema` crate), real schemas' valid instances go through and invalid ones are refused.

mod common;

use std::sync::Arc;

use common::Rng;

use quarry_grammar::json::{JsonGrammar, JsonMatcher, KeywordStatus, SchemaOptions, Whitespace};
use quarry_grammar::{allowed_tokens, bitmask_words, is_allowed, TokenVocab};
use serde_json::{json, Value};

const EOS: u32 = 0;

/// Every byte as a token, plus JSON-shaped multi-byte tokens as a BPE vocabulary has them.
fn vocab() -> Arc<TokenVocab> {
    let mut toks: Vec<Vec<u8>> = vec![b"<|eos|>".to_vec()];
    toks.extend((0..=255u8).map(|b| vec![b]));
    let words = [
        "{\"", "\":", "\": ", "\", \"", "\",\"", "\"}", "\"]", "},", "}]", "[{", "[\"", "\"name", "name", "\"id", "id",
        "true", "false", "null", "12", "345", "-1", "0.", "e+", ", ", ": ", "  ", "\n", "\\n", "\\\"", "\\u00", "abc",
        " the", "é", "日本", "2024", "-01-", "T12:", ":00Z", "@", ".com", "\"type\"", "children", "value", "tags",
    ];
    toks.extend(words.iter().map(|w| w.as_bytes().to_vec()));
    TokenVocab::new(toks, &[], &[EOS])
}

fn byte_token(b: u8) -> u32 {
    1 + b as u32
}

fn hard_cases() -> Vec<Value> {
    vec![
        json!({"type": "object", "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "日本"]}, "minItems": 1, "maxItems": 3}
        }, "required": ["name", "age"], "additionalProperties": false}),
        json!({"$defs": {"node": {"type": "object", "properties": {
            "value": {"type": "integer"},
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}
        }, "required": ["value"], "additionalProperties": false}}, "$ref": "#/$defs/node"}),
        json!({"anyOf": [
            {"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}}, "required": ["kind", "x"], "additionalProperties": false},
            {"type": "object", "properties": {"kind": {"const": "b"}, "y": {"type": "boolean"}}, "required": ["kind"], "additionalProperties": false}
        ]}),
        json!({"type": "array", "items": {"type": "array", "items": {"type": ["number", "null"]}, "minItems": 1, "maxItems": 2}, "maxItems": 3}),
        json!({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{2}$"}, "city": {"type": "string", "pattern": "\\p{L}+"}}, "required": ["code", "city"], "additionalProperties": false}),
        json!({"type": "object", "patternProperties": {"^x-": {"type": "integer"}}, "additionalProperties": {"type": "string", "format": "date"}, "maxProperties": 2}),
        json!({"type": "object", "properties": {"email": {"type": "string", "format": "email"}, "n": {"type": "integer", "exclusiveMinimum": -3, "maximum": 3}}, "required": ["email", "n"], "additionalProperties": false}),
        json!({"enum": [1, "x", null, {"a": [true]}, [1, 2]]}),
        json!({"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"}}, "patternProperties": {"^[a-z]{1,3}$": {"type": ["boolean", "integer"]}}, "additionalProperties": false, "required": ["id"]}),
        json!({"type": "array", "items": {"anyOf": [
            {"type": "number", "exclusiveMinimum": -1.25, "maximum": 0.5},
            {"type": "integer", "minimum": -40, "maximum": 90, "multipleOf": 15},
            {"type": "number", "minimum": 1000.05, "multipleOf": 3},
            {"type": "number", "multipleOf": 1, "maximum": -7},
            {"type": "string", "pattern": "^[0-9]{4}$"}, {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}$"}
        ]}, "maxItems": 4}),
    ]
}

fn random_output(matcher: &mut JsonMatcher, vocab: &TokenVocab, rng: &mut Rng) -> Option<String> {
    let mut out = Vec::new();
    let mut mask = vec![0u32; bitmask_words(vocab.vocab_size())];
    let mut reference = mask.clone();
    while !matcher.is_finished() {
        matcher.fill_bitmask(&mut mask);
        matcher.fill_bitmask_exhaustive(&mut reference);
        assert_eq!(
            mask,
            reference,
            "shortcut mask differs after {:?}",
            String::from_utf8_lossy(&out)
        );
        let allowed: Vec<u32> = allowed_tokens(&mask).collect();
        assert!(
            !allowed.is_empty(),
            "dead end after {:?}",
            String::from_utf8_lossy(&out)
        );
        if out.len() > 1500 {
            return None; // a walk that keeps nesting is abandoned, not judged
        }
        // Closing tokens (and quotes, which end strings) get a boost once the output is long,
        // so walks tend to end.
        let closers: Vec<u32> = allowed
            .iter()
            .copied()
            .filter(|&t| t == EOS || [b'}', b']', b'"'].contains(&vocab.token_bytes(t).first().copied().unwrap_or(0)))
            .collect();
        let t = if out.len() > 60 && !closers.is_empty() && rng.next(2) == 0 {
            closers[rng.next(closers.len())]
        } else {
            allowed[rng.next(allowed.len())]
        };
        matcher
            .accept(t)
            .unwrap_or_else(|e| panic!("allowed token {t} refused: {e}"));
        if t != EOS {
            out.extend_from_slice(vocab.token_bytes(t));
        }
    }
    Some(String::from_utf8(out).expect("outputs are valid UTF-8"))
}

#[test]
fn random_walks_always_produce_valid_json() {
    let vocab = vocab();
    let mut rng = Rng(0x2545F4914F6CDD1D);
    for (i, schema) in hard_cases().into_iter().enumerate() {
        let validator = jsonschema::validator_for(&schema).unwrap();
        for ws in [Whitespace::Compact, Whitespace::Flexible { max_run: 2 }] {
            let grammar = JsonGrammar::compile(&schema, &SchemaOptions::default(), ws, vocab.clone()).unwrap();
            let mut finished = 0;
            for _ in 0..60 {
                let mut m = JsonMatcher::new(grammar.clone());
                let Some(text) = random_output(&mut m, &vocab, &mut rng) else {
                    continue;
                };
                let value: Value = match serde_json::from_str(&text) {
                    Ok(v) => v,
                    // Valid JSON (RFC 8259 lets parsers bound number ranges), but serde_json
                    // cannot hold it as an f64, so the validator cannot judge it.
                    Err(e) if e.to_string().starts_with("number out of range") => continue,
                    Err(e) => panic!("case {i}: {text:?} is not JSON: {e}"),
                };
                assert!(validator.is_valid(&value), "case {i}: {text} does not validate");
                if ws == Whitespace::Compact {
                    assert!(
                        !text.contains([' ', '\n']) || text.contains('"'),
                        "case {i}: whitespace in compact output {text}"
                    );
                }
                finished += 1;
            }
            assert!(finished >= 20, "case {i}: only {finished} walks finished");
        }
    }
}

fn accepts(grammar: &Arc<JsonGrammar>, text: &str) -> bool {
    let mut m = JsonMatcher::new(grammar.clone());
    text.bytes().all(|b| m.accept(byte_token(b)).is_ok()) && m.can_finish()
}

#[test]
fn hand_written_instances() {
    let vocab = vocab();
    let schema = &hard_cases()[0];
    let g = JsonGrammar::compile(
        schema,
        &SchemaOptions::default(),
        Whitespace::Flexible { max_run: 1 },
        vocab.clone(),
    )
    .unwrap();
    for ok in [
        r#"{"name": "Ada", "age": 36}"#,
        r#"{"age": 0, "name": "é", "tags": ["日本"]}"#,
    ] {
        assert!(accepts(&g, ok), "{ok}");
    }
    for bad in [
        r#"{"name": "Ada"}"#,
        r#"{"name": "", "age": 1}"#,
        r#"{"name": "Ada", "age": 121}"#,
        r#"{"name": "Ada", "age": 1, "x": 1}"#,
        r#"{"name": "Ada", "name": "Bob", "age": 1}"#,
        r#"{"name": "Ada", "age": 1, "tags": []}"#,
        r#"{"name": "Ada",  "age": 1}"#,
        r#"{"name": "\ud83d", "age": 1}"#,
        r#"{"name": "\ude00x", "age": 1}"#,
    ] {
        assert!(!accepts(&g, bad), "{bad}");
    }
    // The mask allows a duplicate key's prefix only while another key can still follow from it.
    let mut m = JsonMatcher::new(g.clone());
    for b in br#"{"name": "A", "age": 1, ""#.iter() {
        m.accept(byte_token(*b)).unwrap();
    }
    let mut mask = vec![0u32; bitmask_words(vocab.vocab_size())];
    m.fill_bitmask(&mut mask);
    assert!(is_allowed(&mask, byte_token(b't')), "tags is still possible");
    // Rolling back restores the mask, the arena included; EOS counts as one step.
    let before = mask.clone();
    for b in br#"tags": ["a"]}"#.iter() {
        m.accept(byte_token(*b)).unwrap();
    }
    m.accept(EOS).unwrap();
    assert!(m.is_finished());
    m.rollback(14).unwrap();
    m.fill_bitmask(&mut mask);
    assert_eq!(mask, before, "back where the key began");
    assert!(m.rollback(100).is_err(), "cannot roll back past the start");
    assert!(
        !is_allowed(&mask, byte_token(b'n')) && !is_allowed(&mask, byte_token(b'a')),
        "name and age are taken"
    );
}

#[test]
fn decimal_bounds_and_whole_steps() {
    let g = JsonGrammar::compile(
        &hard_cases()[9],
        &SchemaOptions::default(),
        Whitespace::Compact,
        vocab(),
    )
    .unwrap();
    assert!(g.report().fully_enforced(), "{:?}", g.report());
    for ok in [
        "[0.5]",
        "[-1.2499]",
        "[0]",
        "[-0.0]",
        "[0.50000]",
        "[-30,90,0]",
        "[-8]",
        "[1002,\"2024\"]",
        "[\"2024-01\"]",
    ] {
        assert!(accepts(&g, ok), "{ok}");
    }
    for bad in [
        "[0.51]",
        "[-1.25]",
        "[-6]",
        "[91]",
        "[1000.05]",
        "[1001]",
        "[\"202\"]",
        "[1e-5]",
        "[9007199254740994]",
        "[-7.5]",
    ] {
        assert!(!accepts(&g, bad), "{bad}");
    }
}

/// A reference met again while its target is still being compiled (recursion) has no content
/// yet; an `allOf` around it must keep the reference, not intersect with a placeholder.
#[test]
fn all_of_around_a_recursive_reference_keeps_its_constraints() {
    let schema = json!({"$defs": {"n": {"type": "object", "properties": {
        "v": {"type": "string"},
        "c": {"type": "array", "items": {"allOf": [{"$ref": "#/$defs/n"}]}}
    }, "required": ["v", "c"], "additionalProperties": false}}, "$ref": "#/$defs/n"});
    let g = JsonGrammar::compile(&schema, &SchemaOptions::default(), Whitespace::Compact, vocab()).unwrap();
    assert!(g.report().fully_enforced(), "{:?}", g.report());
    assert!(accepts(&g, r#"{"v":"a","c":[{"v":"b","c":[]}]}"#));
    assert!(
        !accepts(&g, r#"{"v":"a","c":[{"v":"b"}]}"#),
        "the nested object lacks c"
    );
    assert!(
        !accepts(&g, r#"{"v":"a","c":[{"v":"b","c":[],"x":1}]}"#),
        "no other keys, nested too"
    );
}

/// `patternProperties` apply beside `properties`: a declared name a pattern also matches is
/// held to both schemas.
#[test]
fn a_declared_name_that_a_pattern_matches_satisfies_both() {
    let schema = &hard_cases()[8];
    let g = JsonGrammar::compile(schema, &SchemaOptions::default(), Whitespace::Compact, vocab()).unwrap();
    assert!(g.report().fully_enforced(), "{:?}", g.report());
    assert!(accepts(&g, r#"{"id":1,"ab":true,"cd":2}"#));
    assert!(
        !accepts(&g, r#"{"id":true}"#),
        "id is an integer, whatever the pattern allows"
    );
    assert!(!accepts(&g, r#"{"id":1,"ab":"x"}"#), "ab matches the pattern only");
    let overlapping = json!({"patternProperties": {"^a": {"type": "integer"}, "b$": {"type": "string"}}});
    let g = JsonGrammar::compile(&overlapping, &SchemaOptions::default(), Whitespace::Compact, vocab()).unwrap();
    assert!(
        matches!(
            g.report().status_of("", "patternProperties"),
            Some(KeywordStatus::Approximated(_))
        ),
        "{:?}",
        g.report()
    );
}

/// The corpus, sampled: each valid instance is accepted and each invalid one refused; where
/// the report says every keyword is enforced, no invalid instance may get through.
#[test]
fn maskbench_sample_instances() {
    let Some(corpus) = common::corpus() else { return };
    let vocab = vocab();
    let options = SchemaOptions {
        strict: false,
        ..Default::default()
    };
    let (mut schemas, mut compiled, mut passing, mut valid_rejected, mut invalid_accepted, mut enforced_leaks) =
        (0, 0, 0, 0, 0, 0);
    for (i, entry) in corpus.enumerate() {
        if i % 40 != 0 {
            continue;
        }
        schemas += 1;
        let Ok(g) = JsonGrammar::compile(
            &entry["schema"],
            &options,
            Whitespace::Flexible { max_run: 1 },
            vocab.clone(),
        ) else {
            continue;
        };
        compiled += 1;
        let mut ok = true;
        for test in entry["tests"].as_array().unwrap() {
            let accepted = accepts(&g, &common::python_dumps(&test["data"]));
            let valid = test["valid"].as_bool().unwrap();
            if valid && !accepted {
                valid_rejected += 1;
                ok = false;
            }
            if !valid && accepted {
                invalid_accepted += 1;
                ok = false;
                if g.report().fully_enforced() {
                    enforced_leaks += 1;
                    eprintln!("LEAK {}: {}", entry["name"], common::python_dumps(&test["data"]));
                }
            }
        }
        passing += ok as usize;
    }
    eprintln!("sample: schemas={schemas} compiled={compiled} passing={passing} valid_rejected={valid_rejected} invalid_accepted={invalid_accepted} (fully enforced: {enforced_leaks})");
    assert_eq!(
        enforced_leaks, 0,
        "invalid instances accepted by schemas reported as fully enforced"
    );
}

/// Random walks through the matchers of a fixed corpus sample: wherever the report says every
/// keyword is enforced, whatever the mask lets through validates.
#[test]
fn random_walks_over_a_corpus_sample_validate() {
    let Some(corpus) = common::corpus() else { return };
    let vocab = vocab();
    let options = SchemaOptions {
        strict: false,
        ..Default::default()
    };
    let mut rng = Rng(0x9E3779B97F4A7C15);
    let (mut checked, mut walks) = (0, 0);
    for (i, entry) in corpus.enumerate() {
        if i % 40 != 7 {
            continue;
        }
        let schema = &entry["schema"];
        let Ok(validator) = jsonschema::validator_for(schema) else {
            continue;
        };
        let Ok(g) = JsonGrammar::compile(schema, &options, Whitespace::Flexible { max_run: 1 }, vocab.clone()) else {
            continue;
        };
        if !g.report().fully_enforced() {
            continue;
        }
        checked += 1;
        for _ in 0..3 {
            let mut m = JsonMatcher::new(g.clone());
            let Some(text) = random_output(&mut m, &vocab, &mut rng) else {
                continue;
            };
            let value: Value = match serde_json::from_str(&text) {
                Ok(v) => v,
                Err(e) if e.to_string().starts_with("number out of range") => continue,
                Err(e) => panic!("{}: {text:?} is not JSON: {e}", entry["name"]),
            };
            assert!(
                validator.is_valid(&value),
                "{}: {text} does not validate",
                entry["name"]
            );
            walks += 1;
        }
    }
    eprintln!("{checked} fully enforced schemas, {walks} finished walks");
    assert!(checked >= 80 && walks >= 150, "{checked} schemas, {walks} walks");
}

/// Greedy longest-match over the test vocabulary: a stand-in tokenizer.
fn greedy_tokenize(vocab: &TokenVocab, text: &str) -> Vec<u32> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let (id, len) = (1..vocab.vocab_size() as u32)
            .map(|t| (t, vocab.token_bytes(t)))
            .filter(|(_, b)| !b.is_empty() && bytes[at..].starts_with(b))
            .map(|(t, b)| (t, b.len()))
            .max_by_key(|&(_, l)| l)
            .expect("every byte is a token");
        out.push(id);
        at += len;
    }
    out
}

#[test]
fn forced_bytes_and_tokens_jump_over_what_the_schema_decides() {
    use quarry_grammar::Matcher;
    let vocab = vocab();
    let schema = json!({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"], "additionalProperties": false});
    let compile = |s: &Value, ws| JsonGrammar::compile(s, &SchemaOptions::default(), ws, vocab.clone()).unwrap();
    let mut m = JsonMatcher::new(compile(&schema, Whitespace::Compact));
    assert_eq!(m.forced_bytes(), br#"{"name":""#);
    let mut before = vec![0u32; bitmask_words(vocab.vocab_size())];
    m.fill_bitmask(&mut before);
    let tokenize = |t: &str| greedy_tokenize(&vocab, t);
    let forced = m.forced_tokens(&tokenize);
    let spelled: Vec<&[u8]> = forced.iter().map(|&t| vocab.token_bytes(t)).collect();
    assert_eq!(
        spelled,
        [&b"{\""[..], b"name", b"\":"],
        "the last token is left to the model"
    );
    let mut after = before.clone();
    m.fill_bitmask(&mut after);
    assert_eq!(
        before, after,
        "asking for forced tokens leaves the matcher where it was"
    );
    for &t in &forced {
        m.accept(t).unwrap();
    }
    assert_eq!(m.forced_bytes(), b"\"", "the value's opening quote is still forced");
    for b in br#""Ada""# {
        m.accept(byte_token(*b)).unwrap();
    }
    assert_eq!(m.forced_bytes(), b"}");
    m.accept(byte_token(b'}')).unwrap();
    assert!(m.forced_bytes().is_empty(), "complete: EOS is the model's choice");

    let mut flexible = JsonMatcher::new(compile(&schema, Whitespace::Flexible { max_run: 2 }));
    assert_eq!(flexible.forced_bytes(), b"{", "whitespace may follow the brace");
    let mut constant = JsonMatcher::new(compile(&json!({"const": "abc"}), Whitespace::Compact));
    assert_eq!(constant.forced_bytes(), br#""abc""#);
}
