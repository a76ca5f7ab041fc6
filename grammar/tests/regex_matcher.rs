//! The regex constraint against brute force and against an independent regex engine.

mod common;

use std::sync::Arc;

use common::Rng;

use quarry_grammar::dfa::DEAD;
use quarry_grammar::{allowed_tokens, bitmask_words, is_allowed, RegexGrammar, RegexMatcher, TokenVocab};

const EOS: u32 = 1;
const SPECIAL: u32 = 0;

/// A vocabulary shaped like a byte-level BPE one: every single byte, common words with and
/// without a leading space, JSON punctuation runs, multi-byte characters, and partial UTF-8
/// sequences that only make sense next to their neighbours.
fn vocab() -> Arc<TokenVocab> {
    let mut toks: Vec<Vec<u8>> = vec![b"<|special|>".to_vec(), b"<|eos|>".to_vec()];
    toks.extend((0..=255u8).map(|b| vec![b]));
    let words = [
        "the", " the", "a", " a", "ab", "abc", "name", " name", "true", "false", "null", "tr", "ue", "fal", "se",
        "2024", "20", "24", "-", "-0", "0.", ".5", "12", "123", "1234", "99", "e+", "E-", "\"", "\":", "\": ", "\", ",
        "\"}", "{\"", "\\n", "\\\"", "\\u00", "@", ".com", "user", "_id", "x_", "Ab", "ABC", "αβ", "γ", "日本", "語",
        "é", "😀", " ", "  ", "\n", "\t", "://", "www", "-01-", "-12-", "T12:", ":00", "Z",
    ];
    toks.extend(words.iter().map(|w| w.as_bytes().to_vec()));
    toks.extend(["α", "日", "😀"].iter().flat_map(|c| {
        let b = c.as_bytes();
        vec![b[..1].to_vec(), b[1..].to_vec()]
    }));
    TokenVocab::new(toks, &[SPECIAL], &[EOS])
}

/// Each pattern with strings it must accept, written independently of the automaton.
const PATTERNS: &[(&str, &[&str])] = &[
    (r"\d{4}-\d{2}-\d{2}", &["2024-01-31", "1999-12-01"]),
    (r"(true|false|null)", &["true", "false", "null"]),
    (r"[a-zA-Z_][a-zA-Z0-9_]{0,15}", &["user_id", "x_", "ABC", "a"]),
    (r"\p{Greek}{1,5}", &["αβγ", "α"]),
    (
        r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",
        &["-0.5", "2024", "1234e+12", "0"],
    ),
    (
        r#""([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4}){0,12}""#,
        &[r#""the name""#, r#""a\"b\u00e9""#, r#""""#],
    ),
    (r"[a-z0-9._]+@[a-z0-9]+\.(com|org)", &["user@www.com", "a.b@x.org"]),
    (r"(日本語|😀|é)+", &["日本語😀", "éé"]),
];

fn mask(m: &RegexMatcher, vocab: &TokenVocab) -> Vec<u32> {
    let mut mask = vec![0u32; bitmask_words(vocab.vocab_size())];
    m.fill_bitmask(&mut mask);
    mask
}

#[test]
fn masks_equal_per_token_simulation_and_random_walks_match_the_regex() {
    let vocab = vocab();
    let mut rng = Rng(0x9e3779b97f4a7c15);
    for (pattern, _) in PATTERNS {
        let grammar = RegexGrammar::compile(pattern, vocab.clone()).unwrap();
        let dfa = grammar.dfa();
        let reference = regex::Regex::new(&format!("^(?:{pattern})$")).unwrap();
        for _walk in 0..30 {
            let mut m = RegexMatcher::new(grammar.clone());
            let mut state = dfa.start();
            let mut out: Vec<u8> = Vec::new();
            let mut masks = Vec::new();
            while !m.is_finished() {
                let mk = mask(&m, &vocab);
                // Without the trie: run every token through the automaton on its own.
                for t in 0..vocab.vocab_size() as u32 {
                    let expected = if t == EOS {
                        dfa.is_accepting(state)
                    } else {
                        t != SPECIAL && dfa.run(state, vocab.token_bytes(t)) != DEAD
                    };
                    assert_eq!(
                        is_allowed(&mk, t),
                        expected,
                        "{pattern}: token {t} after {:?}",
                        String::from_utf8_lossy(&out)
                    );
                }
                let allowed: Vec<u32> = allowed_tokens(&mk).collect();
                assert!(!allowed.is_empty(), "{pattern}: stuck after {out:?}");
                masks.push(mk);
                // Prefer ending once possible, so walks stay short.
                let t = if allowed.contains(&EOS) && (rng.next(3) == 0 || out.len() > 48) {
                    EOS
                } else {
                    allowed[rng.next(allowed.len())]
                };
                let refused = (0..vocab.vocab_size() as u32).find(|&r| !allowed.contains(&r)).unwrap();
                assert!(
                    m.accept(refused).is_err(),
                    "{pattern}: refused token {refused} accepted"
                );
                m.accept(t).unwrap();
                if t != EOS {
                    out.extend_from_slice(vocab.token_bytes(t));
                    state = dfa.run(state, vocab.token_bytes(t));
                }
            }
            let text = String::from_utf8(out).expect("a finished output is valid UTF-8");
            assert!(reference.is_match(&text), "{pattern}: produced {text:?}");
            // Rolling back restores every earlier mask.
            for step in (0..masks.len()).rev() {
                m.rollback(1).unwrap();
                assert_eq!(mask(&m, &vocab), masks[step], "{pattern}: rolled back to step {step}");
            }
            assert!(m.rollback(1).is_err(), "nothing left to roll back");
        }
    }
}

#[test]
fn known_valid_strings_are_accepted_token_by_token() {
    let vocab = vocab();
    for (pattern, examples) in PATTERNS {
        let grammar = RegexGrammar::compile(pattern, vocab.clone()).unwrap();
        let reference = regex::Regex::new(&format!("^(?:{pattern})$")).unwrap();
        for ex in *examples {
            assert!(reference.is_match(ex), "example {ex:?} of {pattern} is wrong");
            // Byte tokens (ids 2..258) spell any string; multi-byte characters arrive split.
            let mut m = RegexMatcher::new(grammar.clone());
            for &b in ex.as_bytes() {
                m.accept(2 + b as u32)
                    .unwrap_or_else(|e| panic!("{pattern}: {ex:?} at byte {b}: {e}"));
            }
            assert!(m.can_finish(), "{pattern}: {ex:?} is complete");
            assert!(
                m.forced_bytes().is_empty(),
                "{pattern}: nothing is forced where the output may end"
            );
            m.accept(EOS).unwrap();
            assert!(m.is_finished());
        }
    }
}

#[test]
fn forced_bytes_run_to_the_first_choice() {
    let vocab = vocab();
    let grammar = RegexGrammar::compile(r"(true|false|null)|\d{4}-\d{2}", vocab).unwrap();
    let mut m = RegexMatcher::new(grammar);
    assert!(m.forced_bytes().is_empty(), "t, f, n or a digit: a choice");
    m.accept(2 + b'f' as u32).unwrap();
    assert_eq!(m.forced_bytes(), b"alse");
    m.rollback(1).unwrap();
    for b in b"2024" {
        m.accept(2 + *b as u32).unwrap();
    }
    assert_eq!(m.forced_bytes(), b"-", "a dash, then a choice of digits");
}

#[test]
fn a_choice_produces_exactly_one_of_its_options() {
    let vocab = vocab();
    let options: Vec<String> = ["true", "tr", "a.b*c", "日本語", "\"quoted\"", "ab"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let grammar = RegexGrammar::choice(&options, vocab.clone()).unwrap();
    let mut rng = Rng(7);
    let mut seen = std::collections::HashSet::new();
    for _ in 0..300 {
        let mut m = RegexMatcher::new(grammar.clone());
        let mut out = Vec::new();
        while !m.is_finished() {
            let allowed: Vec<u32> = allowed_tokens(&mask(&m, &vocab)).collect();
            let t = allowed[rng.next(allowed.len())];
            m.accept(t).unwrap();
            if t != EOS {
                out.extend_from_slice(vocab.token_bytes(t));
            }
        }
        let text = String::from_utf8(out).unwrap();
        assert!(options.contains(&text), "{text:?} is not an option");
        seen.insert(text);
    }
    assert_eq!(seen.len(), options.len(), "every option is reachable: {seen:?}");
    assert!(RegexGrammar::choice(&[], vocab).is_err());
}
