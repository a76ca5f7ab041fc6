//! Per-field confidence: how sure the model was of each leaf of a record, from the tokens that
//! wrote it. Each drawn token carries its probability under the distribution it was drawn from
//! (`TokenConfidence`: the temperature-1 softmax of the final scores, the mask and every option
//! applied); a token the grammar left as the only choice tells nothing and does not count, and a
//! token that straddles a value and the JSON around it counts for the value by the share of its
//! bytes inside it. A leaf's value spans its bytes in the output text: a string with its quotes
//! (opening a string rather than writing null is part of the choice), a number, `true`, `false`,
//! `null`, or an empty array or object.

use std::ops::Range;

use serde::Serialize;

use crate::sampling::TokenConfidence;

/// One leaf of a record: its JSON pointer, the bytes of the output text that spell it, and the
/// bytes that decided it exists: for each enclosing object member its key (and the comma
/// before it), for each enclosing array element the commas before it and before every element
/// ahead of it (element i exists only if the list went on i times; the first element's
/// existence is decided by its own first token).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leaf {
    pub pointer: String,
    pub range: Range<usize>,
    pub decisions: Vec<Range<usize>>,
}

/// Ways to turn a value's token probabilities into one number, each measured by
/// `quarry bench quality` (AUROC for right against wrong fields, calibration).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Candidates {
    /// The product of the probabilities (each raised to its token's share of value bytes): the
    /// probability of the whole value, lower for longer values.
    pub product: f64,
    /// Their geometric mean, with the same weights.
    pub geometric: f64,
    /// The least probable token's probability.
    pub min: f64,
    /// The first informative token's probability: the decision between values, before the
    /// rest of a value follows from its beginning.
    pub first: f64,
    /// `product` times the probabilities of the tokens that decided the leaf exists (a key the
    /// schema left optional, another array element): an invented item is as doubtful as the
    /// choice to write it.
    pub product_existence: f64,
    /// `min` over the value's and the existence's tokens.
    pub min_existence: f64,
}

/// The confidence reported for a field: the candidate `quarry bench quality` measured best at
/// telling right fields from wrong ones on the development set (see the issue note).
pub fn field_confidence(c: &Candidates) -> f64 {
    c.product_existence
}

/// The leaves of a JSON text, in text order; `None` where the text is not one JSON value.
pub fn leaves(text: &str) -> Option<Vec<Leaf>> {
    let mut walk = Walk {
        s: text.as_bytes(),
        at: 0,
        out: Vec::new(),
        decisions: Vec::new(),
    };
    walk.value(&mut String::new())?;
    walk.ws();
    (walk.at == walk.s.len()).then_some(walk.out)
}

/// The byte range of each token of `tokens` in their concatenation.
pub fn token_ranges(lengths: impl IntoIterator<Item = usize>) -> Vec<Range<usize>> {
    let mut at = 0;
    lengths
        .into_iter()
        .map(|n| {
            at += n;
            at - n..at
        })
        .collect()
}

/// Each leaf's candidates from the tokens that overlap it (`ranges[i]` is token i's bytes in
/// the text, `tokens[i]` its confidence): `None` where one of them has no confidence (drawn
/// where it was not computed). A leaf written by the grammar alone has confidence 1.
pub fn score_leaves(
    leaves: &[Leaf],
    ranges: &[Range<usize>],
    tokens: &[Option<TokenConfidence>],
) -> Vec<Option<Candidates>> {
    leaves
        .iter()
        .map(|leaf| {
            let mut weighted_log = 0.0f64;
            let mut weight = 0.0f64;
            let mut min = 1.0f64;
            let mut first = None;
            // Tokens are in text order: those before the leaf end before it starts.
            let from = ranges.partition_point(|r| r.end <= leaf.range.start);
            for (r, t) in ranges[from..].iter().zip(&tokens[from..]) {
                if r.start >= leaf.range.end {
                    break;
                }
                let overlap = r.end.min(leaf.range.end) - r.start.max(leaf.range.start);
                if overlap == 0 {
                    continue;
                }
                let t = (*t)?;
                if t.choices <= 1 {
                    continue;
                }
                let p = (t.prob as f64).clamp(1e-30, 1.0);
                let w = overlap as f64 / r.len() as f64;
                weighted_log += w * p.ln();
                weight += w;
                min = min.min(p);
                first.get_or_insert(p);
            }
            // A decision counts whole for every token that writes part of it.
            let (mut decided_log, mut decided_min) = (0.0f64, 1.0f64);
            for d in &leaf.decisions {
                let from = ranges.partition_point(|r| r.end <= d.start);
                for (r, t) in ranges[from..].iter().zip(&tokens[from..]) {
                    if r.start >= d.end {
                        break;
                    }
                    let t = (*t)?;
                    if t.choices > 1 {
                        let p = (t.prob as f64).clamp(1e-30, 1.0);
                        decided_log += p.ln();
                        decided_min = decided_min.min(p);
                    }
                }
            }
            Some(Candidates {
                product: weighted_log.exp(),
                geometric: if weight > 0.0 {
                    (weighted_log / weight).exp()
                } else {
                    1.0
                },
                min,
                first: first.unwrap_or(1.0),
                product_existence: (weighted_log + decided_log).exp(),
                min_existence: min.min(decided_min),
            })
        })
        .collect()
}

/// A JSON walk that records leaves with their byte ranges and pointers.
struct Walk<'a> {
    s: &'a [u8],
    at: usize,
    out: Vec<Leaf>,
    /// The existence decisions of the members around the walk's position.
    decisions: Vec<Range<usize>>,
}

impl Walk<'_> {
    fn ws(&mut self) {
        while self.at < self.s.len() && matches!(self.s[self.at], b' ' | b'\t' | b'\n' | b'\r') {
            self.at += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.at).copied()
    }

    fn eat(&mut self, b: u8) -> Option<()> {
        self.ws();
        (self.peek()? == b).then(|| self.at += 1)
    }

    /// A value at `pointer`; `pointer` is restored on return.
    fn value(&mut self, pointer: &mut String) -> Option<()> {
        self.ws();
        let start = self.at;
        match self.peek()? {
            b'{' => {
                self.at += 1;
                self.ws();
                if self.peek()? == b'}' {
                    self.at += 1;
                    return self.leaf(pointer, start);
                }
                let mut comma = None;
                loop {
                    self.ws();
                    let key_start = self.at;
                    self.string()?;
                    let key: String = serde_json::from_slice(&self.s[key_start..self.at]).ok()?;
                    let held = self.decisions.len();
                    self.decisions.extend(comma.take());
                    self.decisions.push(key_start..self.at);
                    self.eat(b':')?;
                    let len = pointer.len();
                    pointer.push('/');
                    pointer.push_str(&super::pointer_token(&key));
                    self.value(pointer)?;
                    pointer.truncate(len);
                    self.decisions.truncate(held);
                    self.ws();
                    match self.peek()? {
                        b',' => {
                            comma = Some(self.at..self.at + 1);
                            self.at += 1
                        }
                        b'}' => {
                            self.at += 1;
                            return Some(());
                        }
                        _ => return None,
                    }
                }
            }
            b'[' => {
                self.at += 1;
                self.ws();
                if self.peek()? == b']' {
                    self.at += 1;
                    return self.leaf(pointer, start);
                }
                // Element i exists only if the list went on after each element before it: every
                // comma so far decided it.
                let held = self.decisions.len();
                for i in 0.. {
                    let len = pointer.len();
                    pointer.push_str(&format!("/{i}"));
                    self.value(pointer)?;
                    pointer.truncate(len);
                    self.ws();
                    match self.peek()? {
                        b',' => {
                            self.decisions.push(self.at..self.at + 1);
                            self.at += 1
                        }
                        b']' => {
                            self.at += 1;
                            break;
                        }
                        _ => return None,
                    }
                }
                self.decisions.truncate(held);
                Some(())
            }
            b'"' => {
                self.string()?;
                self.leaf(pointer, start)
            }
            _ => {
                while self
                    .peek()
                    .is_some_and(|b| !matches!(b, b',' | b']' | b'}' | b' ' | b'\t' | b'\n' | b'\r'))
                {
                    self.at += 1;
                }
                serde_json::from_slice::<serde_json::Value>(&self.s[start..self.at]).ok()?;
                self.leaf(pointer, start)
            }
        }
    }

    /// A string from its opening quote to just past its closing one.
    fn string(&mut self) -> Option<()> {
        (self.peek()? == b'"').then_some(())?;
        self.at += 1;
        loop {
            match self.peek()? {
                b'\\' => self.at += 2,
                b'"' => {
                    self.at += 1;
                    return Some(());
                }
                _ => self.at += 1,
            }
        }
    }

    fn leaf(&mut self, pointer: &str, start: usize) -> Option<()> {
        self.out.push(Leaf {
            pointer: pointer.to_string(),
            range: start..self.at,
            decisions: self.decisions.clone(),
        });
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conf(prob: f32, choices: u32) -> Option<TokenConfidence> {
        Some(TokenConfidence { prob, choices })
    }

    #[test]
    fn leaves_have_pointers_and_the_bytes_of_their_values() {
        let text = r#"{ "a~b/c": "x\"y", "n": [1, -2.5e3, {}], "o": {"t": true, "z": null}, "e": [] }"#;
        let got = leaves(text).unwrap();
        let spelled: Vec<(&str, &str)> = got
            .iter()
            .map(|l| (l.pointer.as_str(), &text[l.range.clone()]))
            .collect();
        assert_eq!(
            spelled,
            [
                ("/a~0b~1c", r#""x\"y""#),
                ("/n/0", "1"),
                ("/n/1", "-2.5e3"),
                ("/n/2", "{}"),
                ("/o/t", "true"),
                ("/o/z", "null"),
                ("/e", "[]"),
            ]
        );
        assert_eq!(leaves("7").unwrap()[0].pointer, "");
        // Existence: the key of each member around the leaf, the comma before a later member
        // or element.
        let decided = |p: &str| -> Vec<&str> {
            let l = got.iter().find(|l| l.pointer == p).unwrap();
            l.decisions.iter().map(|d| &text[d.clone()]).collect()
        };
        assert_eq!(decided("/a~0b~1c"), [r#""a~b/c""#]);
        assert_eq!(decided("/n/0"), [",", r#""n""#]);
        assert_eq!(decided("/n/2"), [",", r#""n""#, ",", ","]);
        assert_eq!(decided("/o/z"), [",", r#""o""#, ",", r#""z""#]);
        assert!(leaves(r#"{"a": 1"#).is_none());
        assert!(leaves(r#"{"a": 1} x"#).is_none());
        assert!(leaves(r#"{"a": tru}"#).is_none());
    }

    #[test]
    fn sole_choices_do_not_count_and_straddling_tokens_count_by_their_value_bytes() {
        // {"a": "xy"} as tokens: `{"a": ` (grammar's), `"x` (p 0.5), `y"` (p 0.8), `}` (sole).
        let text = r#"{"a": "xy"}"#;
        let ranges = token_ranges([6, 2, 2, 1]);
        let tokens = [conf(1.0, 1), conf(0.5, 10), conf(0.8, 3), conf(1.0, 1)];
        let l = leaves(text).unwrap();
        let c = score_leaves(&l, &ranges, &tokens)[0].unwrap();
        assert!((c.product - 0.4).abs() < 1e-6, "{c:?}");
        assert!((c.geometric - 0.4f64.sqrt()).abs() < 1e-6);
        assert_eq!(c.min, 0.5);
        assert_eq!(c.first, 0.5);

        // `: "x` straddles: 2 of its 4 bytes are the value's, so it counts half.
        let ranges = token_ranges([4, 4, 2, 1]);
        let tokens = [conf(1.0, 1), conf(0.25, 5), conf(1.0, 2), conf(1.0, 1)];
        let c = score_leaves(&l, &ranges, &tokens)[0].unwrap();
        assert!((c.product - 0.5).abs() < 1e-6, "{c:?}");
        assert!((c.geometric - 0.5f64.powf(1.0 / 1.5)).abs() < 1e-6);

        // Written by the grammar alone: certain. A token without confidence: unknown.
        let ranges = token_ranges([6, 4, 1]);
        let sole = [conf(1.0, 1), conf(1.0, 1), conf(1.0, 1)];
        assert_eq!(score_leaves(&l, &ranges, &sole)[0].unwrap().product, 1.0);
        let unknown = [conf(1.0, 1), None, conf(1.0, 1)];
        assert_eq!(score_leaves(&l, &ranges, &unknown)[0], None);
    }

    #[test]
    fn a_token_spanning_two_values_counts_for_both() {
        // [1,2] written as `[`, `1,2`, `]`: the middle token is one of three bytes in each.
        let text = "[1,2]";
        let l = leaves(text).unwrap();
        let ranges = token_ranges([1, 3, 1]);
        let tokens = [conf(1.0, 1), conf(0.1, 4), conf(1.0, 1)];
        let scored = score_leaves(&l, &ranges, &tokens);
        for c in scored {
            let c = c.unwrap();
            assert!((c.product - 0.1f64.powf(1.0 / 3.0)).abs() < 1e-6);
            assert!((c.first - 0.1).abs() < 1e-6);
        }
    }
}
