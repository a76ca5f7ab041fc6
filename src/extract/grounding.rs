//! Grounding: for each string and number of an extracted record, where in the document it
//! came from. Strings match ignoring case and treating any run of whitespace as one space,
//! because models copy values but not always their line breaks or capitals; a date the record
//! writes `YYYY-MM-DD` and numbers match by meaning, in whatever spelling the document uses
//! (`spelling`). A value found nowhere (the model paraphrased or invented it) gets no span,
//! which is the point: it flags what to check. Spans count characters (Unicode scalar
//! values), not bytes, so that clients in any language can slice the document with them.

use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

use super::spelling::{dates, iso_date, numbers, same_number, DateToken, NumberToken};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize, ToSchema)]
pub struct Span {
    /// First character, counted from 0.
    pub start: usize,
    /// One past the last character.
    pub end: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct Grounding {
    /// The string's JSON pointer in `data`.
    pub pointer: String,
    /// Where the document says it, or null.
    pub span: Option<Span>,
}

/// The document lower-cased with whitespace runs folded to one space, and for each byte of
/// that text the character of the original it came from.
struct Folded {
    text: String,
    origin: Vec<usize>,
    /// Characters in the original, for spans that end at its end.
    len: usize,
}

fn fold(s: &str) -> Folded {
    let mut f = Folded {
        text: String::with_capacity(s.len()),
        origin: Vec::with_capacity(s.len() + 1),
        len: 0,
    };
    let mut in_space = false;
    for (i, c) in s.chars().enumerate() {
        f.len = i + 1;
        if c.is_whitespace() {
            if !in_space {
                f.text.push(' ');
                f.origin.push(i);
            }
            in_space = true;
            continue;
        }
        in_space = false;
        for l in c.to_lowercase() {
            let at = f.text.len();
            f.text.push(l);
            f.origin.resize(f.text.len(), i);
            debug_assert!(f.origin.len() > at);
        }
    }
    f
}

impl Folded {
    /// The original characters covered by folded bytes `start..end`.
    fn span(&self, start: usize, end: usize) -> Span {
        let first = self.origin[start];
        let last = self.origin[end - 1];
        Span {
            start: first,
            end: (last + 1).min(self.len),
        }
    }
}

/// Every non-blank string and every number of `data`, in the record's order. A value that
/// occurs more than once is taken at its first occurrence after the previous value's match
/// (records usually follow the document's order), else at its first occurrence.
pub fn ground(document: &str, data: &Value) -> Vec<Grounding> {
    let doc = fold(document);
    let chars: Vec<char> = document.chars().collect();
    let (mut number_tokens, mut date_tokens): (Option<Vec<NumberToken>>, Option<Vec<DateToken>>) = (None, None);
    let mut leaves = Vec::new();
    values(data, &mut String::new(), &mut leaves);
    let mut out = Vec::new();
    // A character of the document: where the previous match ended.
    let mut cursor = 0;
    for (pointer, leaf) in leaves {
        let span = match leaf {
            Leaf::Text(text) => find_text(&doc, text, cursor).or_else(|| {
                let date = iso_date(text)?;
                let tokens = date_tokens.get_or_insert_with(|| dates(&chars));
                first_from(tokens, cursor, |t| (t.start, t.end), |t| t.dates.contains(&date))
            }),
            Leaf::Number(value) => {
                let tokens = number_tokens.get_or_insert_with(|| numbers(&chars));
                first_from(tokens, cursor, |t| (t.start, t.end), |t| same_number(value, t))
            }
        };
        if let Some(s) = &span {
            cursor = s.end;
        }
        out.push(Grounding { pointer, span });
    }
    out
}

/// A text's span: its first folded occurrence from character `cursor` on, else its first.
fn find_text(doc: &Folded, text: &str, cursor: usize) -> Option<Span> {
    let needle = fold(text.trim()).text;
    let from = doc.origin.partition_point(|&o| o < cursor);
    let at = doc.text[from..]
        .find(&needle)
        .map(|at| at + from)
        .or_else(|| doc.text.find(&needle))?;
    Some(doc.span(at, at + needle.len()))
}

/// The first token from character `cursor` on that `fits`, else the first anywhere.
fn first_from<T>(
    tokens: &[T],
    cursor: usize,
    at: impl Fn(&T) -> (usize, usize),
    fits: impl Fn(&T) -> bool,
) -> Option<Span> {
    let later = tokens.iter().find(|t| at(t).0 >= cursor && fits(t));
    let (start, end) = at(later.or_else(|| tokens.iter().find(|t| fits(t)))?);
    Some(Span { start, end })
}

enum Leaf<'v> {
    Text(&'v str),
    Number(f64),
}

fn values<'v>(v: &'v Value, pointer: &mut String, out: &mut Vec<(String, Leaf<'v>)>) {
    let len = pointer.len();
    match v {
        Value::String(s) if !s.trim().is_empty() => out.push((pointer.clone(), Leaf::Text(s))),
        Value::Number(n) => out.extend(n.as_f64().map(|n| (pointer.clone(), Leaf::Number(n)))),
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                pointer.push('/');
                pointer.push_str(&i.to_string());
                values(x, pointer, out);
                pointer.truncate(len);
            }
        }
        Value::Object(o) => {
            for (k, x) in o {
                pointer.push('/');
                pointer.push_str(&super::pointer_token(k));
                values(x, pointer, out);
                pointer.truncate(len);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn slice(doc: &str, s: &Span) -> String {
        doc.chars().skip(s.start).take(s.end - s.start).collect()
    }

    #[test]
    fn finds_values_ignoring_case_and_line_breaks_with_character_offsets() {
        let doc = "Rechnung für Jörg Müller\nACME  GmbH\n  Berlin";
        let data = json!({"name": "jörg müller", "company": "Acme GmbH\nBerlin", "ok": true, "made_up": "Paris"});
        let g = ground(doc, &data);
        assert_eq!(g.len(), 3, "{g:?}");
        assert_eq!(g[0].pointer, "/name");
        assert_eq!(slice(doc, g[0].span.as_ref().unwrap()), "Jörg Müller");
        assert_eq!(slice(doc, g[1].span.as_ref().unwrap()), "ACME  GmbH\n  Berlin");
        assert_eq!((g[2].pointer.as_str(), &g[2].span), ("/made_up", &None));
    }

    #[test]
    fn repeated_values_follow_the_order_of_the_record() {
        let doc = "item: pen, 2.00\nitem: pen, 3.00";
        let data = json!({"items": [{"d": "pen", "p": "2.00"}, {"d": "pen", "p": "3.00"}]});
        let g = ground(doc, &data);
        let spans: Vec<_> = g.iter().map(|g| g.span.clone().unwrap().start).collect();
        assert_eq!(spans, [6, 11, 22, 27]);
        assert_eq!(g[2].pointer, "/items/1/d");
    }

    #[test]
    fn numbers_and_dates_are_found_in_the_documents_spelling_in_record_order() {
        let doc = "INVOICE INV-2291\nDate: 14/03/2025\n2 x Widget A .... 40.00 EUR\n1 x Fee ..... 15.50 EUR\nTOTAL DUE: 55.50 EUR\nPaid March 20, 2025";
        let data = json!({"number": 2291, "date": "2025-03-14", "lines": [{"qty": 2, "amount": 40}, {"qty": 1, "amount": 15.5}],
                          "total": 55.5, "paid": "2025-03-20", "tax": 0, "due": "2025-04-01"});
        let g = ground(doc, &data);
        let shown: Vec<(&str, Option<String>)> = g
            .iter()
            .map(|g| (g.pointer.as_str(), g.span.as_ref().map(|s| slice(doc, s))))
            .collect();
        assert_eq!(
            shown,
            [
                ("/number", Some("2291".into())),
                ("/date", Some("14/03/2025".into())),
                ("/lines/0/qty", Some("2".into())),
                ("/lines/0/amount", Some("40.00".into())),
                // The 1 of "1 x Fee", after the previous match, not the 1 of "14/03".
                ("/lines/1/qty", Some("1".into())),
                ("/lines/1/amount", Some("15.50".into())),
                ("/total", Some("55.50".into())),
                ("/paid", Some("March 20, 2025".into())),
                ("/tax", None),
                ("/due", None),
            ]
        );
    }

    #[test]
    fn pointers_escape_slashes_and_tildes() {
        let g = ground("x", &json!({"a/b~c": "x"}));
        assert_eq!(g[0].pointer, "/a~1b~0c");
    }
}
