//! Verbatim strings: with a document, every free string of a record is a substring of it,
//! JSON-escaped as it must be (quotes, backslashes, newlines, multi-byte characters) and
//! within its `maxLength`, while strings with an `enum`, `format`, `pattern` or `minLength`
//! keep their own constraint.

mod common;

use std::sync::Arc;

use common::Rng;
use quarry_grammar::json::{JsonGrammar, JsonMatcher, SchemaOptions, Whitespace};
use quarry_grammar::{allowed_tokens, bitmask_words, TokenVocab};
use serde_json::{json, Value};

const EOS: u32 = 0;

fn vocab() -> Arc<TokenVocab> {
    let mut toks: Vec<Vec<u8>> = vec![b"<|eos|>".to_vec()];
    toks.extend((0..=255u8).map(|b| vec![b]));
    let words = [
        "{\"", "\":", "\",\"", "\"}", "\"]", "},", "[\"", "name", " the", "Ann", " O", "'Ne", "il", "\\\"", "\\n",
        "\\\\", "é", "日本", "2024", "-01-", "true", "null", "Bo", "St", "reet", " Street", "\":\"", "ab", "abc", "x",
    ];
    toks.extend(words.iter().map(|w| w.as_bytes().to_vec()));
    TokenVocab::new(toks, &[], &[EOS])
}

const DOCUMENT: &str = "Contact: Ann \"Bo\" O'Neil, 12 Elm Street\nPath C:\\data\\new, café 日本 2024-01-05.";

fn schema() -> Value {
    json!({"type": "object", "properties": {
        "name": {"type": "string"},
        "street": {"type": ["string", "null"]},
        "notes": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "kind": {"enum": ["person", "company"]},
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "when": {"type": "string", "format": "date"},
        "short": {"type": "string", "maxLength": 6},
        "long": {"type": "string", "minLength": 2, "maxLength": 4}
    }, "required": ["name", "street", "notes", "kind", "code", "when", "short", "long"], "additionalProperties": false})
}

fn is_substring(s: &str) -> bool {
    DOCUMENT.contains(s)
}

/// Random walks through the masks: every record that completes validates, and its free
/// strings are substrings of the document while the others follow their own keywords.
#[test]
fn free_strings_are_copied_from_the_document() {
    let options = SchemaOptions {
        strict: false,
        ..Default::default()
    };
    let base = JsonGrammar::compile(&schema(), &options, Whitespace::Compact, vocab()).unwrap();
    let g = base.with_document(DOCUMENT, true).unwrap();
    let vocab = g.vocab().clone();
    let mut mask = vec![0u32; bitmask_words(vocab.vocab_size())];
    let (mut quick, mut full) = (mask.clone(), mask.clone());
    let mut rng = Rng(99);
    let mut finished = 0;
    let mut invented_long = false;
    for _ in 0..200 {
        let mut m = JsonMatcher::new(g.clone());
        let mut out = Vec::new();
        for _ in 0..400 {
            // The string shortcut (inner masks, a bounded copy's pair of them) allows what
            // walking every token does.
            m.fill_bitmask(&mut quick);
            m.fill_bitmask_exhaustive(&mut full);
            assert_eq!(quick, full, "after {:?}", String::from_utf8_lossy(&out));
            let room = 400usize.saturating_sub(out.len() + 1).min(300);
            m.fill_bitmask_within(&mut mask, room);
            let tokens: Vec<u32> = allowed_tokens(&mask).collect();
            assert!(
                !tokens.is_empty(),
                "empty mask after {:?}",
                String::from_utf8_lossy(&out)
            );
            // Prefer ending a string or the record now and then, so walks finish.
            let t = tokens[rng.next(tokens.len())];
            m.accept(t).unwrap();
            if m.is_finished() {
                break;
            }
            out.extend_from_slice(vocab.token_bytes(t));
        }
        if !m.is_finished() && !m.can_finish() {
            continue;
        }
        finished += 1;
        let text = String::from_utf8(out).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert!(jsonschema::is_valid(&schema(), &v), "{text}");
        assert!(is_substring(v["name"].as_str().unwrap()), "{text}");
        if let Some(s) = v["street"].as_str() {
            assert!(is_substring(s), "{text}");
        }
        for n in v["notes"].as_array().unwrap() {
            assert!(is_substring(n.as_str().unwrap()), "{text}");
        }
        let short = v["short"].as_str().unwrap();
        assert!(is_substring(short) && short.chars().count() <= 6, "{text}");
        invented_long |= !is_substring(v["long"].as_str().unwrap());
    }
    assert!(finished > 100, "{finished} walks finished");
    assert!(invented_long, "a string with a minLength keeps its own constraint");
}

/// A length-bounded free string is a copy within its bound: the longest copies and text
/// the document does not hold are refused; an empty copy is fine.
#[test]
fn a_length_bounded_string_is_a_copy_within_its_bound() {
    let options = SchemaOptions {
        strict: false,
        ..Default::default()
    };
    let schema = json!({"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}},
        "required": ["s"], "additionalProperties": false});
    let base = JsonGrammar::compile(&schema, &options, Whitespace::Compact, vocab()).unwrap();
    let g = base.with_document(DOCUMENT, true).unwrap();
    let accepts = |g: &Arc<JsonGrammar>, text: &str| {
        let mut m = JsonMatcher::new(g.clone());
        text.bytes().all(|b| m.accept(1 + b as u32).is_ok()) && m.can_finish()
    };
    // Characters, not bytes: "café 日" is 6 characters, "é 日本" 4 (10 bytes).
    for copied in ["", "Ann", "O'Nei", "\"", "é 日本", "C:\\"] {
        let record = json!({ "s": copied }).to_string();
        assert!(accepts(&g, &record), "{record}");
    }
    for refused in ["Ann \"B", "café 日", "Anne", "Bo O"] {
        let record = json!({ "s": refused }).to_string();
        assert!(!accepts(&g, &record), "{record}");
    }
    // Without verbatim the bound alone applies.
    let plain = base.with_document(DOCUMENT, false).unwrap();
    assert!(accepts(&plain, &json!({"s": "Anne"}).to_string()));
    assert!(!accepts(&plain, &json!({"s": "Anne B"}).to_string()));
}

/// A long document and a long bound: the copy is stepped as a pair of states, never built
/// as a product (which would have millions of states), so it holds at any size.
#[test]
fn a_long_document_with_a_long_bound_is_still_copied_within_it() {
    let options = SchemaOptions {
        strict: false,
        ..Default::default()
    };
    let schema = json!({"type": "object", "properties": {"s": {"type": "string", "maxLength": 200}},
        "required": ["s"], "additionalProperties": false});
    let base = JsonGrammar::compile(&schema, &options, Whitespace::Compact, vocab()).unwrap();
    let mut rng = Rng(7);
    let long: String = (0..20_000).map(|_| (b'a' + rng.next(26) as u8) as char).collect();
    let g = base.with_document(&long, true).unwrap();
    let accepts = |text: &str| {
        let mut m = JsonMatcher::new(g.clone());
        text.bytes().all(|b| m.accept(1 + b as u32).is_ok()) && m.can_finish()
    };
    assert!(accepts(&json!({"s": &long[5000..5200]}).to_string()));
    assert!(!accepts(&json!({"s": &long[5000..5201]}).to_string()), "201 characters");
    assert!(!accepts(&json!({"s": "0123456789"}).to_string()), "invented");
}

/// The document's quotes, backslashes, newline and multi-byte characters come out as their
/// escapes; a copy never starts inside an escape, and invented text is refused.
#[test]
fn copies_are_escaped_and_invented_text_is_refused() {
    let options = SchemaOptions {
        strict: false,
        ..Default::default()
    };
    let g = JsonGrammar::compile(
        &json!({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"], "additionalProperties": false}),
        &options,
        Whitespace::Compact,
        vocab(),
    )
    .unwrap()
    .with_document(DOCUMENT, true)
    .unwrap();
    let accepts = |text: &str| {
        let mut m = JsonMatcher::new(g.clone());
        text.bytes().all(|b| m.accept(1 + b as u32).is_ok()) && m.can_finish()
    };
    for copied in [
        "Ann \"Bo\" O'Neil",
        "Street\nPath C:\\data\\new",
        "café 日本",
        "",
        "\"",
        "C:\\",
    ] {
        let record = json!({ "s": copied }).to_string();
        assert!(accepts(&record), "{record}");
    }
    for invented in [
        r#"{"s":"Anne"}"#,
        r#"{"s":"Ann Bo"}"#,
        // `\n` after the document's backslash would be a newline: the document says `\new`.
        r#"{"s":"data\new"}"#,
        r#"{"s":"caf\u00e9"}"#,
        r#"{"s":"日"#,
    ] {
        assert!(!accepts(invented), "{invented}");
    }
}

/// Without verbatim the document is a prior only: the matcher tells which tokens continue a
/// run copied from it (any run, after JSON punctuation), and invented text stays allowed.
#[test]
fn the_copy_mask_follows_the_run_being_copied() {
    let options = SchemaOptions {
        strict: false,
        ..Default::default()
    };
    let schema = json!({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"], "additionalProperties": false});
    let g = JsonGrammar::compile(&schema, &options, Whitespace::Compact, vocab())
        .unwrap()
        .with_document(DOCUMENT, false)
        .unwrap();
    let vocab = g.vocab().clone();
    let token = |w: &str| {
        (0..vocab.vocab_size() as u32)
            .find(|&t| vocab.token_bytes(t) == w.as_bytes())
            .unwrap()
    };
    let mut m = JsonMatcher::new(g.clone());
    for b in br#"{"s":""# {
        m.accept(1 + *b as u32).unwrap();
    }
    let allowed = |m: &JsonMatcher, w: &str| quarry_grammar::is_allowed(m.copy_mask().unwrap(), token(w));
    assert!(allowed(&m, "Ann") && allowed(&m, "日本") && allowed(&m, "\\\""));
    assert!(!allowed(&m, "abc"), "not in the document");
    m.accept(token("t")).unwrap();
    assert!(m.copy_mask().is_some(), "`t` is in the document");
    m.accept(token("t")).unwrap();
    assert!(m.copy_mask().is_none(), "`tt` is not: the run has left the document");
    m.rollback(2).unwrap();
    m.accept(1 + b'O' as u32).unwrap();
    assert!(allowed(&m, "'Ne") && !allowed(&m, "Ann"));
    m.accept(token("'Ne")).unwrap();
    assert!(allowed(&m, "il"));
    // Invented text is still allowed: this is a prior, not a constraint.
    let mut mask = vec![0u32; quarry_grammar::bitmask_words(vocab.vocab_size())];
    m.fill_bitmask(&mut mask);
    assert!(quarry_grammar::is_allowed(&mask, token("abc")));
}

/// Inside a closed choice of strings (`enum`, `const`) the matcher says so, so the sampler can
/// weigh the copy prior more there; free strings, numbers and the JSON around are not choices.
#[test]
fn a_closed_choice_of_strings_is_told_apart() {
    let options = SchemaOptions {
        strict: false,
        ..Default::default()
    };
    let schema = json!({"type": "object", "properties": {
        "c": {"enum": ["USD", "EUR"]}, "n": {"enum": [1, 2]}, "s": {"type": "string"}},
        "required": ["c", "n", "s"], "additionalProperties": false});
    let g = JsonGrammar::compile(&schema, &options, Whitespace::Compact, vocab()).unwrap();
    let mut m = JsonMatcher::new(g);
    let mut seen = Vec::new();
    for b in br#"{"c":"EUR","n":1,"s":"x"}"# {
        seen.push(m.in_choice());
        m.accept(1 + *b as u32).unwrap();
    }
    let text = br#"{"c":"EUR","n":1,"s":"x"}"#;
    let inside: Vec<char> = text
        .iter()
        .zip(&seen)
        .filter(|(_, &c)| c)
        .map(|(&b, _)| b as char)
        .collect();
    // Before each of `EUR"` the output is inside the choice (the opening quote starts it).
    assert_eq!(inside.iter().collect::<String>(), "EUR\"");
}
