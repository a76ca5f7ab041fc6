//! Grounding: for each string leaf of an extracted record, where in the document it came
//! from. Matching ignores case and treats any run of whitespace as one space, because models
//! copy values but not always their line breaks or capitals; a value found nowhere (the model
//! paraphrased or invented it) gets no span, which is the point: it flags what to check.
//! Spans count characters (Unicode scalar values), not bytes, so that clients in any
//! language can slice the document with them.

use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

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

/// Every non-blank string leaf of `data`, in document order of the record. A value that
/// occurs more than once is taken at its first occurrence after the previous leaf's match
/// (records usually follow the document's order), else at its first occurrence.
pub fn ground(document: &str, data: &Value) -> Vec<Grounding> {
    let doc = fold(document);
    let mut out = Vec::new();
    let mut cursor = 0;
    let mut leaves = Vec::new();
    strings(data, &mut String::new(), &mut leaves);
    for (pointer, value) in leaves {
        let needle = fold(value.trim()).text;
        let found = doc.text[cursor..]
            .find(&needle)
            .map(|at| at + cursor)
            .or_else(|| doc.text.find(&needle));
        let span = found.map(|at| {
            cursor = at + needle.len();
            doc.span(at, at + needle.len())
        });
        out.push(Grounding { pointer, span });
    }
    out
}

fn strings<'v>(v: &'v Value, pointer: &mut String, out: &mut Vec<(String, &'v str)>) {
    let len = pointer.len();
    match v {
        Value::String(s) if !s.trim().is_empty() => out.push((pointer.clone(), s)),
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                pointer.push('/');
                pointer.push_str(&i.to_string());
                strings(x, pointer, out);
                pointer.truncate(len);
            }
        }
        Value::Object(o) => {
            for (k, x) in o {
                pointer.push('/');
                pointer.push_str(&k.replace('~', "~0").replace('/', "~1"));
                strings(x, pointer, out);
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
        let data = json!({"name": "jörg müller", "company": "Acme GmbH\nBerlin", "n": 3, "made_up": "Paris"});
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
    fn pointers_escape_slashes_and_tildes() {
        let g = ground("x", &json!({"a/b~c": "x"}));
        assert_eq!(g[0].pointer, "/a~1b~0c");
    }
}
