//! Context-free grammars (GBNF subset): masks agree with token-by-token acceptance, random
//! walks produce sentences an independent parser accepts, and bad grammars are typed errors.

mod common;

use std::sync::Arc;

use common::Rng;
use quarry_grammar::{
    allowed_tokens, bitmask_words, is_allowed, CfgGrammar, CfgMatcher, GrammarError, Matcher, TokenVocab,
};

const EOS: u32 = 0;

fn vocab() -> Arc<TokenVocab> {
    let mut toks: Vec<Vec<u8>> = vec![b"<|eos|>".to_vec()];
    toks.extend((0..=255u8).map(|b| vec![b]));
    for w in [
        "12", "(1", "+(", ")*", "))", "hello", "hel", "lo ", "αβ", "true", "null", ", ",
    ] {
        toks.push(w.as_bytes().to_vec());
    }
    TokenVocab::new(toks, &[], &[EOS])
}

const ARITHMETIC: &str = r#"
# Sums of products of numbers and parenthesised sums.
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= [0-9]{1,3} | "(" expr ")"
"#;

/// An independent recursive-descent check of the arithmetic language.
fn is_arithmetic(s: &[u8]) -> bool {
    fn expr(s: &[u8], i: &mut usize) -> bool {
        term(s, i) && {
            while *i < s.len() && (s[*i] == b'+' || s[*i] == b'-') {
                *i += 1;
                if !term(s, i) {
                    return false;
                }
            }
            true
        }
    }
    fn term(s: &[u8], i: &mut usize) -> bool {
        factor(s, i) && {
            while *i < s.len() && (s[*i] == b'*' || s[*i] == b'/') {
                *i += 1;
                if !factor(s, i) {
                    return false;
                }
            }
            true
        }
    }
    fn factor(s: &[u8], i: &mut usize) -> bool {
        if *i < s.len() && s[*i] == b'(' {
            *i += 1;
            return expr(s, i) && *i < s.len() && s[*i] == b')' && {
                *i += 1;
                true
            };
        }
        let start = *i;
        while *i < s.len() && s[*i].is_ascii_digit() && *i - start < 3 {
            *i += 1;
        }
        *i > start && !(*i < s.len() && s[*i].is_ascii_digit())
    }
    let mut i = 0;
    expr(s, &mut i) && i == s.len()
}

fn accepts(g: &Arc<CfgGrammar>, text: &str) -> bool {
    let mut m = CfgMatcher::new(g.clone());
    text.bytes().all(|b| m.accept(1 + b as u32).is_ok()) && m.can_finish()
}

#[test]
fn masks_agree_with_acceptance_and_walks_stay_in_the_language() {
    let vocab = vocab();
    let g = CfgGrammar::compile(ARITHMETIC, vocab.clone()).unwrap();
    let mut rng = Rng(0xC0FFEE);
    let mut mask = vec![0u32; bitmask_words(vocab.vocab_size())];
    let mut finished = 0;
    for _ in 0..40 {
        let mut m = CfgMatcher::new(g.clone());
        let mut out = Vec::new();
        while !m.is_finished() && out.len() < 200 {
            m.fill_bitmask(&mut mask);
            for t in 0..vocab.vocab_size() as u32 {
                let ok = m.accept(t).is_ok();
                if ok {
                    m.rollback(1).unwrap();
                }
                assert_eq!(
                    is_allowed(&mask, t),
                    ok,
                    "token {t} after {:?}",
                    String::from_utf8_lossy(&out)
                );
            }
            let allowed: Vec<u32> = allowed_tokens(&mask).collect();
            assert!(
                !allowed.is_empty(),
                "dead end after {:?}",
                String::from_utf8_lossy(&out)
            );
            // Favour closing once long, so that walks end.
            let t = match allowed.iter().find(|&&t| t == EOS || vocab.token_bytes(t) == b")") {
                Some(&t) if out.len() > 30 => t,
                _ => allowed[rng.next(allowed.len())],
            };
            m.accept(t).unwrap();
            if t != EOS {
                out.extend_from_slice(vocab.token_bytes(t));
            }
        }
        if m.is_finished() {
            assert!(is_arithmetic(&out), "{:?}", String::from_utf8_lossy(&out));
            finished += 1;
        }
    }
    assert!(finished >= 20, "only {finished} walks finished");
    for ok in ["1+2*(3-4)", "((7))", "123/4"] {
        assert!(accepts(&g, ok), "{ok}");
    }
    for bad in ["1+", "(1", "1)", "1234", "", "+1"] {
        assert!(!accepts(&g, bad), "{bad}");
    }
}

#[test]
fn unicode_classes_repetition_and_forced_text() {
    let vocab = vocab();
    let g = CfgGrammar::compile(r#"root ::= "hello" " "? [α-ω]{2,3} ("!" | "?")"#, vocab.clone()).unwrap();
    assert!(accepts(&g, "hello αβ!"));
    assert!(accepts(&g, "helloαβγ?"));
    assert!(!accepts(&g, "hello α!"), "two to three letters");
    assert!(!accepts(&g, "hello abc!"), "Greek letters only");
    let mut m = CfgMatcher::new(g.clone());
    assert_eq!(m.forced_bytes(), b"hello");
    // "α" split across two byte tokens is a live prefix.
    for b in "hello".bytes().chain("α".bytes().take(1)) {
        m.accept(1 + b as u32).unwrap();
    }
    let mut mask = vec![0u32; bitmask_words(vocab.vocab_size())];
    m.fill_bitmask(&mut mask);
    assert!(is_allowed(&mask, 1 + "α".as_bytes()[1] as u32));
    assert!(!is_allowed(&mask, EOS));
}

#[test]
fn bad_grammars_are_typed_errors() {
    let vocab = vocab();
    let err = |text: &str| {
        CfgGrammar::compile(text, vocab.clone())
            .err()
            .unwrap_or_else(|| panic!("{text} compiled"))
    };
    for (text, line, what) in [
        ("root ::= root \"a\" | \"a\"", 0, "left-recursive"),
        ("root ::= a\na ::= b? a \"x\"\nb ::= \"y\"", 0, "left-recursive"),
        ("root ::= \"a\"\n\nx ::= missing", 3, "undefined rule"),
        ("root ::= \"abc", 1, "unterminated literal"),
        ("root ::= [z-a]", 1, "backwards"),
        ("root ::= \"a\"{5,2}", 1, "ordered"),
        ("start ::= \"a\"", 1, "no `root`"),
        ("root ::= \"a\"\nroot ::= \"b\"", 2, "defined twice"),
    ] {
        match err(text) {
            GrammarError::Grammar { line: l, reason } => {
                assert!(reason.contains(what), "{text}: {reason}");
                assert_eq!(l, line, "{text}: {reason}");
            }
            other => panic!("{text}: {other}"),
        }
    }
    assert!(matches!(
        CfgGrammar::compile("root ::= (\"a\"{1000}){1000}", vocab.clone()),
        Err(GrammarError::TooLarge { .. })
    ));
}
