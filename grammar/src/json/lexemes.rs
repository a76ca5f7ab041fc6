//! Regexes for the scalar values of a schema, over their JSON encoding: strings (with length,
//! format or pattern), integers in a range, numbers, and the literal values of `enum`/`const`.

use std::sync::{Mutex, OnceLock};

use serde_json::Value;

use super::ir::{NumberRules, StringRules};
use crate::cache::GenerationalCache;
use crate::dfa::{ByteDfa, DfaLimits, StateId, DEAD};
use crate::lexeme::decimal_range::{at_least, at_most};
use crate::lexeme::{format_regex, int_range_regex, integer_bounds};
use crate::regex::literal;

/// One character of a JSON string body, as encoded: a character other than `"`, `\` and
/// controls, or an escape.
/// `\u` escapes name a Unicode scalar: a surrogate only as a high-low pair, never alone (many
/// parsers, serde_json among them, refuse a lone one).
pub const STRING_CHAR: &str = r#"(?:[^"\\\x00-\x1F]|\\["\\/bfnrt]|\\u(?:[0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2})|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2})"#;

/// Longest `maxLength` spelled out as a counted repetition; beyond it the DFA would grow
/// with the bound, so the bound is left to a later check (and reported).
pub const MAX_COUNTED_LENGTH: u64 = 256;

/// A regex no input matches (an empty range, an object that admits no key).
pub const NOTHING: &str = r"[^\x00-\x{10FFFF}]";

pub const NUMBER: &str = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?";
pub const INTEGER: &str = r"-?(?:0|[1-9][0-9]*)";

/// How the whitespace between tokens is allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Whitespace {
    /// None at all: `{"a":1,"b":[2,3]}`.
    Compact,
    /// Runs of at most `max_run` whitespace bytes around structural characters.
    Flexible { max_run: u8 },
}

impl Whitespace {
    pub fn regex(self) -> String {
        match self {
            Whitespace::Compact => String::new(),
            Whitespace::Flexible { max_run } => format!("[ \\t\\n\\r]{{0,{max_run}}}"),
        }
    }
}

/// The body of the string lexeme of `rules` (the matcher handles the quotes, so `^` and `$` in
/// a pattern are true assertions at the body's ends), and what it does not enforce.
pub fn string_body(rules: &StringRules) -> (String, Vec<&'static str>) {
    let mut loose = Vec::new();
    let body = if let Some(p) = &rules.pattern {
        match pattern_body(p) {
            Ok(b) => {
                if rules.format.is_some() {
                    loose.push("format (a pattern is enforced instead)");
                }
                if rules.min_length > 0 || rules.max_length.is_some() {
                    loose.push("minLength/maxLength (a pattern is enforced instead)");
                }
                b
            }
            Err(_) => {
                loose.push("pattern (unsupported regex features)");
                counted(rules, &mut loose)
            }
        }
    } else if let Some(f) = rules.format {
        if rules.min_length > 0 || rules.max_length.is_some() {
            loose.push("minLength/maxLength (a format is enforced instead)");
        }
        format_regex(f)
    } else {
        counted(rules, &mut loose)
    };
    (body, loose)
}

fn counted(rules: &StringRules, loose: &mut Vec<&'static str>) -> String {
    let min = rules.min_length.min(MAX_COUNTED_LENGTH);
    if rules.min_length > MAX_COUNTED_LENGTH {
        loose.push("minLength (above the counted limit)");
    }
    match rules.max_length {
        Some(max) if max <= MAX_COUNTED_LENGTH => format!("{STRING_CHAR}{{{min},{max}}}"),
        Some(_) => {
            loose.push("maxLength (above the counted limit)");
            format!("{STRING_CHAR}{{{min},}}")
        }
        None => format!("{STRING_CHAR}{{{min},}}"),
    }
}

/// The body of a string whose decoded text matches the ECMA-262 `pattern` somewhere (JSON
/// Schema patterns are not anchored; `^` and `$` inside are assertions at the body's ends).
/// Characters the pattern needs are produced unescaped, so patterns that can match `"`, `\`
/// or controls are refused rather than approximated.
pub fn pattern_body(pattern: &str) -> Result<String, String> {
    // A schema's pattern is read while its keywords are reported and again while its automata
    // are built, and real schemas repeat patterns: the check below (a DFA build, up to
    // hundreds of milliseconds for a large class) runs once per pattern per process.
    type Bodies = GenerationalCache<String, Result<String, String>>;
    static BODIES: OnceLock<Mutex<Bodies>> = OnceLock::new();
    let bodies = BODIES.get_or_init(|| Mutex::new(GenerationalCache::new(16 << 20)));
    if let Some(known) = bodies.lock().unwrap_or_else(|e| e.into_inner()).get(pattern) {
        return known;
    }
    let body = checked_pattern_body(pattern);
    let bytes = pattern.len() + body.as_ref().map_or_else(String::len, String::len);
    bodies
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(pattern.to_string(), body, bytes)
}

fn checked_pattern_body(pattern: &str) -> Result<String, String> {
    let translated = ecma_to_rust(pattern)?;
    let free = r#"[^"\\\x00-\x1F]*"#;
    let body = format!("{free}(?:{}){free}", restrict(&translated));
    // Whatever the pattern spells (a literal quote, `\x22`, ...), a raw string body must never
    // take `"`, `\` or a control byte: check the automaton itself, not the spelling.
    let dfa = ByteDfa::from_regex(&body, DfaLimits::default()).map_err(|e| e.to_string())?;
    let forbidden = (0u8..0x20).chain([b'"', b'\\']);
    for b in forbidden {
        if (1..dfa.num_states() as StateId).any(|s| dfa.next(s, b) != DEAD) {
            return Err(format!(
                "the pattern can match byte {b:#04x}, which a JSON string must escape"
            ));
        }
    }
    Ok(body)
}

/// Removes `"`, `\` and control characters from what `pattern` can match, by intersecting
/// every dot and class with the characters a raw string body may hold.
fn restrict(pattern: &str) -> String {
    let mut out = String::with_capacity(pattern.len() + 16);
    let mut chars = pattern.chars().peekable();
    let mut in_class = 0usize;
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                out.push(c);
                if let Some(n) = chars.next() {
                    out.push(n);
                }
            }
            '[' => {
                if in_class == 0 {
                    out.push_str(r#"[[^"\\\x00-\x1F]&&["#);
                } else {
                    out.push('[');
                }
                in_class += 1;
            }
            ']' if in_class > 0 => {
                in_class -= 1;
                out.push(']');
                if in_class == 0 {
                    out.push(']');
                }
            }
            '.' if in_class == 0 => out.push_str(r#"[^"\\\x00-\x1F]"#),
            _ => out.push(c),
        }
    }
    out
}

/// ECMA-262 escapes that differ from Rust's regex syntax: `\d`, `\w` and `\s` are ASCII (and
/// ECMA whitespace) there; `\/` is a plain slash.
/// Why `pattern` is not a regular expression at all (an unclosed group or class, a
/// quantifier with nothing to repeat), as opposed to one that merely uses features the
/// automata cannot enforce (backreferences, lookaround), which a lenient compile reports and
/// skips. Only errors that ECMA-262 shares are named, so no valid schema is refused.
pub fn malformed_pattern(pattern: &str) -> Option<String> {
    use regex_syntax::ast::ErrorKind;
    let translated = ecma_to_rust(pattern).ok()?;
    let err = regex_syntax::ast::parse::Parser::new().parse(&translated).err()?;
    // ECMA's empty classes `[]` and `[^]` read as unclosed classes in Rust's syntax.
    let empty_class = translated.contains("[]") || translated.contains("[^]");
    match err.kind() {
        ErrorKind::GroupUnclosed | ErrorKind::GroupUnopened | ErrorKind::RepetitionMissing => {}
        ErrorKind::ClassUnclosed if !empty_class => {}
        _ => return None,
    }
    Some(format!("not a regular expression: {}", err.kind()))
}

fn ecma_to_rust(p: &str) -> Result<String, String> {
    let mut out = String::with_capacity(p.len());
    let mut chars = p.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str("[0-9]"),
            Some('D') => out.push_str("[^0-9]"),
            Some('w') => out.push_str("[A-Za-z0-9_]"),
            Some('W') => out.push_str("[^A-Za-z0-9_]"),
            Some('/') => out.push('/'),
            Some(c @ ('1'..='9' | 'k')) => return Err(format!("backreference \\{c}")),
            Some(c) => {
                out.push('\\');
                out.push(c);
            }
            None => return Err("pattern ends in a backslash".into()),
        }
    }
    if out.contains("(?=") || out.contains("(?!") || out.contains("(?<=") || out.contains("(?<!") {
        return Err("lookaround".into());
    }
    Ok(out)
}

/// The digits a number may have: 20 before the point (every 64-bit integer), 20 after it,
/// 2 in the exponent. JSON itself sets no bound, but readers do (serde_json refuses a number
/// past 1.8e308, so a model stuck repeating a digit wrote records nobody could read), and with
/// these bounds every number stays within 1e120 of zero either way. MaskBench's valid
/// instances have at most 16 digits.
pub const NUMBER_DIGITS: &str = r"-?(?:0|[1-9][0-9]{0,19})(?:\.[0-9]{1,20})?(?:[eE][+-]?[0-9]{1,2})?";

/// Largest `multipleOf` enforced: the DFA has a state per remainder.
pub const MAX_MULTIPLE: f64 = 100_000.0;

/// 2^53 - 1, the largest integer below which every integer is a double.
const MAX_SAFE: i128 = (1 << 53) - 1;

/// A number lexeme: the numbers every regex matches (a lower and an upper bound are two
/// regexes), that are also multiples of `multiple_of`.
#[derive(Debug, Clone, PartialEq)]
pub struct NumberLexeme {
    pub regexes: Vec<String>,
    pub multiple_of: Option<u32>,
}

/// The number lexeme of `rules`, and what of them it leaves unenforced.
pub fn number_lexeme(rules: &NumberRules, integer: bool) -> (NumberLexeme, Vec<&'static str>) {
    let mut loose = Vec::new();
    // An integral step is a remainder DFA over the digits; a fractional one is left out (a
    // float step such as 0.01 is also where validators disagree, dividing in binary).
    let multiple_of = match rules.multiple_of {
        // A step of 1 says nothing about an integer, but makes a number one.
        Some(m) if m.fract() == 0.0 && (1.0..=MAX_MULTIPLE).contains(&m) => (m > 1.0 || !integer).then_some(m as u32),
        Some(_) => {
            loose.push("multipleOf");
            None
        }
        None => None,
    };
    let mut regexes = Vec::new();
    // Multiples stay within the integers a double holds exactly, where every validator agrees
    // (one dividing in floating point finds 3^41 no multiple of 3).
    let safe = |b: Option<i128>, f: fn(i128, i128) -> i128, limit: i128| match multiple_of {
        Some(_) => Some(b.map_or(limit, |b| f(b, limit))),
        None => b,
    };
    if integer {
        let (lo, hi) = integer_bounds(
            rules.minimum,
            rules.exclusive_minimum,
            rules.maximum,
            rules.exclusive_maximum,
        );
        let (lo, hi) = (safe(lo, i128::max, -MAX_SAFE), safe(hi, i128::min, MAX_SAFE));
        regexes.push(int_range_regex(lo, hi).unwrap_or_else(|| NOTHING.into()));
    } else {
        if multiple_of.is_some() {
            regexes.push(int_range_regex(Some(-MAX_SAFE), Some(MAX_SAFE)).unwrap_or_default());
        }
        let sides = [
            rules.minimum.map(|b| at_least(b, rules.exclusive_minimum)),
            rules.maximum.map(|b| at_most(b, rules.exclusive_maximum)),
        ];
        for side in sides.into_iter().flatten() {
            match side {
                Some(re) => regexes.push(re),
                None => loose.push("minimum/maximum on numbers"),
            }
        }
        if regexes.is_empty() {
            regexes.push(NUMBER.into());
        }
    }
    // Every number also keeps to the digits any reader can hold.
    regexes.push(NUMBER_DIGITS.into());
    (NumberLexeme { regexes, multiple_of }, loose)
}

/// One literal value (`enum`, `const`) spelled as JSON, with the whitespace policy between
/// the tokens of arrays and objects.
pub fn literal_regex(value: &Value, ws: Whitespace) -> String {
    let w = ws.regex();
    match value {
        Value::Array(items) => {
            let parts: Vec<String> = items.iter().map(|v| literal_regex(v, ws)).collect();
            format!("\\[{w}{}{w}\\]", parts.join(&format!("{w},{w}")))
        }
        Value::Object(map) => {
            let parts: Vec<String> = map
                .iter()
                .map(|(k, v)| {
                    format!(
                        "{}{w}:{w}{}",
                        literal(&Value::String(k.clone()).to_string()),
                        literal_regex(v, ws)
                    )
                })
                .collect();
            format!("\\{{{w}{}{w}\\}}", parts.join(&format!("{w},{w}")))
        }
        // Numbers: the value's own spelling, plus `1.0` for integral floats as Python writes.
        Value::Number(n) => {
            let s = n.to_string();
            match n.as_f64() {
                Some(f) if f.fract() == 0.0 && !s.contains('.') && !s.contains('e') => {
                    format!("{}(?:\\.0+)?", literal(&s))
                }
                _ => literal(&s),
            }
        }
        other => literal(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn full(re: &str) -> regex::Regex {
        regex::Regex::new(&format!("^(?:{re})$")).unwrap()
    }

    #[test]
    fn strings_with_lengths_formats_and_patterns() {
        // Bodies are matched without their quotes: the matcher handles those.
        let body = |r: StringRules| {
            let (b, loose) = string_body(&r);
            (full(&b), loose)
        };
        let (re, loose) = body(StringRules {
            min_length: 2,
            max_length: Some(3),
            ..Default::default()
        });
        assert!(loose.is_empty());
        for ok in ["ab", r#"a\"b"#, r"\u00e9é"] {
            assert!(re.is_match(ok), "{ok}");
        }
        for bad in ["a", "abcd", r#"a"b"#, "a\nb"] {
            assert!(!re.is_match(bad), "{bad:?}");
        }
        let (re, _) = body(StringRules {
            pattern: Some(r"^[A-Z]{2}\d{3}$".into()),
            ..Default::default()
        });
        assert!(re.is_match("AB123") && !re.is_match("AB12") && !re.is_match("xAB123"));
        let (re, _) = body(StringRules {
            pattern: Some(r"\d{3}".into()),
            ..Default::default()
        });
        assert!(
            re.is_match("abc 123 def") && !re.is_match("12a"),
            "unanchored pattern matches anywhere"
        );
        assert!(!re.is_match(r#"x" 123"#), "a raw quote never enters a string");
        let (re, _) = body(StringRules {
            pattern: Some(r"^[^\s]+$".into()),
            ..Default::default()
        });
        assert!(re.is_match("sample") && !re.is_match("sample tag"));
        let (re, _) = body(StringRules {
            pattern: Some(r"^$|^(([0-9]|[1-9][0-9]|1[0-9]{2}|2[0-4][0-9]|25[0-5])\.){3}([0-9]|[1-9][0-9]|1[0-9]{2}|2[0-4][0-9]|25[0-5])?$".into()),
            ..Default::default()
        });
        assert!(
            re.is_match("") && re.is_match("10.0.0.1") && !re.is_match("256.1.1.1"),
            "anchors inside alternatives"
        );
        let (_, loose) = string_body(&StringRules {
            pattern: Some(r"(a)\1".into()),
            ..Default::default()
        });
        assert_eq!(loose, vec!["pattern (unsupported regex features)"]);
        for smuggled in [r#"a"b"#, r"a\\b", r"a\x22b", "a\\nb"] {
            assert!(
                pattern_body(smuggled).is_err(),
                "{smuggled} would put a raw quote, backslash or control in a string"
            );
        }
    }

    #[test]
    fn malformed_patterns_are_told_apart_from_unsupported_ones() {
        for broken in ["(unclosed", "a)", "[abc", "*a", "a|+"] {
            assert!(malformed_pattern(broken).is_some(), "{broken} is not a regex");
        }
        // Valid ECMA-262 that the automata cannot enforce, or that Rust's syntax reads
        // differently, is never called malformed.
        for fine in [
            r"(a)\1",
            "(?=x)y",
            "a{",
            r"^\d{3}-\w+$",
            "[^]",
            r"\cJ",
            "(?<year>[0-9]{4})",
        ] {
            assert_eq!(malformed_pattern(fine), None, "{fine}");
        }
    }

    #[test]
    fn numbers_and_literals() {
        let (lex, loose) = number_lexeme(
            &NumberRules {
                minimum: Some(1.0),
                maximum: Some(12.0),
                ..Default::default()
            },
            true,
        );
        assert!(loose.is_empty());
        let re = full(&lex.regexes[0]);
        assert!(re.is_match("1") && re.is_match("12") && !re.is_match("13") && !re.is_match("0"));
        let bounded = NumberRules {
            minimum: Some(0.5),
            maximum: Some(1e300),
            multiple_of: Some(0.5),
            ..Default::default()
        };
        let (lex, loose) = number_lexeme(&bounded, false);
        assert_eq!(loose, vec!["multipleOf", "minimum/maximum on numbers"]);
        assert_eq!(lex.regexes.len(), 2, "the bound, and the digits any reader holds");
        assert!(full(&lex.regexes[0]).is_match("0.5") && !full(&lex.regexes[0]).is_match("0.49"));
        let (lex, loose) = number_lexeme(
            &NumberRules {
                multiple_of: Some(7.0),
                ..Default::default()
            },
            true,
        );
        assert!(loose.is_empty());
        assert_eq!(lex.multiple_of, Some(7));

        let digits = full(NUMBER_DIGITS);
        for ok in [
            "12345678901234567890",
            "-0.5",
            "1.00000000000000000001",
            "6.02e23",
            "1E-99",
        ] {
            assert!(digits.is_match(ok), "{ok}");
        }
        for long in ["123456789012345678901", "1.000000000000000000001", "1e100", "2e+400"] {
            assert!(!digits.is_match(long), "{long}");
        }

        let flexible = Whitespace::Flexible { max_run: 2 };
        let re = full(&literal_regex(&json!({"a": [1, "x"], "b": null}), flexible));
        assert!(re.is_match(r#"{"a":[1,"x"],"b":null}"#));
        assert!(re.is_match(r#"{"a": [1, "x"], "b": null}"#));
        assert!(
            re.is_match(r#"{"a": [1.0, "x"], "b": null}"#),
            "Python writes integral floats as 1.0"
        );
        assert!(
            !re.is_match(r#"{"b":null,"a":[1,"x"]}"#),
            "a literal keeps its own key order"
        );
        let compact = full(&literal_regex(&json!("a.b\"c"), Whitespace::Compact));
        assert!(compact.is_match(r#""a.b\"c""#) && !compact.is_match(r#""aXb\"c""#));
    }
}
