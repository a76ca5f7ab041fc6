//! How close an extracted record is to its gold record, field by field: strings compared
//! after folding case and runs of whitespace, numbers numerically, arrays element by element.

use serde_json::Value;

/// Fields right out of fields counted, for one record.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FieldScore {
    pub correct: usize,
    pub total: usize,
}

impl FieldScore {
    pub fn add(&mut self, other: FieldScore) {
        self.correct += other.correct;
        self.total += other.total;
    }

    pub fn exact(&self) -> bool {
        self.correct == self.total
    }

    pub fn accuracy(&self) -> f64 {
        if self.total == 0 {
            return 1.0;
        }
        self.correct as f64 / self.total as f64
    }
}

/// Scores `got` against `expected`. Every leaf of `expected` is a field (an empty array or
/// object is one); an extra array element in `got` is one more wrong field, so an answer
/// padded with invented items cannot score as well as the gold.
pub fn score(expected: &Value, got: Option<&Value>) -> FieldScore {
    match expected {
        Value::Object(fields) if !fields.is_empty() => {
            let mut s = FieldScore::default();
            for (k, v) in fields {
                s.add(score(v, got.and_then(|g| g.get(k))));
            }
            s
        }
        Value::Array(items) if !items.is_empty() => {
            let got_items = got.and_then(Value::as_array).map(Vec::as_slice).unwrap_or(&[]);
            let mut s = FieldScore::default();
            for (i, e) in items.iter().enumerate() {
                s.add(score(e, got_items.get(i)));
            }
            let extra = got_items.len().saturating_sub(items.len());
            s.total += extra;
            s
        }
        leaf => FieldScore {
            correct: got.is_some_and(|g| same(leaf, g)) as usize,
            total: 1,
        },
    }
}

/// Equal as the benchmark counts it.
pub fn same(expected: &Value, got: &Value) -> bool {
    match (expected, got) {
        (Value::String(e), Value::String(g)) => fold(e) == fold(g),
        (Value::Number(e), Value::Number(g)) => match (e.as_f64(), g.as_f64()) {
            (Some(e), Some(g)) => (e - g).abs() <= 1e-9 * e.abs().max(1.0),
            _ => false,
        },
        (Value::Array(e), Value::Array(g)) => e.len() == g.len() && e.iter().zip(g).all(|(e, g)| same(e, g)),
        (Value::Object(e), Value::Object(g)) => {
            e.len() == g.len() && e.iter().all(|(k, v)| g.get(k).is_some_and(|w| same(v, w)))
        }
        (e, g) => e == g,
    }
}

/// Lower case, whitespace runs as one space, no whitespace at the ends.
fn fold(s: &str) -> String {
    s.split_whitespace()
        .map(str::to_lowercase)
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn s(expected: Value, got: Value) -> (usize, usize) {
        let r = score(&expected, Some(&got));
        (r.correct, r.total)
    }

    #[test]
    fn leaves_are_fields_and_strings_fold_case_and_spaces() {
        let gold = json!({"name": "Ada  Lovelace", "age": 36, "city": null, "tags": ["a", "b"]});
        assert_eq!(s(gold.clone(), gold.clone()), (5, 5));
        assert_eq!(
            s(
                gold.clone(),
                json!({"name": "ada lovelace\n", "age": 36.0, "city": null, "tags": ["A", "b"]})
            ),
            (5, 5)
        );
        assert_eq!(
            s(
                gold.clone(),
                json!({"name": "Ada", "age": 37, "city": "London", "tags": ["a"]})
            ),
            (1, 5)
        );
        assert_eq!(score(&gold, None), FieldScore { correct: 0, total: 5 });
    }

    #[test]
    fn extra_items_count_against_and_empty_containers_are_one_field() {
        assert_eq!(s(json!({"xs": [1]}), json!({"xs": [1, 1, 1]})), (1, 3));
        assert_eq!(s(json!({"xs": []}), json!({"xs": []})), (1, 1));
        assert_eq!(s(json!({"xs": []}), json!({"xs": [2]})), (0, 1));
        assert_eq!(s(json!({"o": {"a": 1}}), json!({"o": null})), (0, 1));
        assert_eq!(s(json!({"n": 55.5}), json!({"n": 1})), (0, 1));
        assert_eq!(
            s(json!({"n": "1"}), json!({"n": 1})),
            (0, 1),
            "no coercion across types"
        );
    }
}
