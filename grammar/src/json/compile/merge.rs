//! `allOf`: the intersection of two compiled nodes, where it can be computed exactly. Where it
//! cannot, the first part's constraint is kept and the report says so.

use super::super::ir::{Node, NodeId, NumberRules, ObjectRules, StringRules};
use super::super::report::KeywordStatus;
use super::Compiler;

/// Deeper intersections (of recursive schemas) keep the first part and are reported.
const MAX_MERGE_DEPTH: usize = 16;

impl Compiler<'_> {
    pub(super) fn merge(&mut self, a: Node, b: Node, pointer: &str) -> Node {
        if self.merge_depth >= MAX_MERGE_DEPTH {
            self.approximate(pointer);
            return a;
        }
        self.merge_depth += 1;
        let merged = self.merge_inner(a, b, pointer);
        self.merge_depth -= 1;
        merged
    }

    fn merge_inner(&mut self, a: Node, b: Node, pointer: &str) -> Node {
        match (a, b) {
            (Node::Any, x) | (x, Node::Any) => x,
            (Node::Never, _) | (_, Node::Never) => Node::Never,
            (Node::AnyOf(xs), other) => self.distribute(&xs, other, true, pointer),
            (other, Node::AnyOf(xs)) => self.distribute(&xs, other, false, pointer),
            (Node::Object(x), Node::Object(y)) => Node::Object(self.merge_objects(x, y, pointer)),
            (Node::String(x), Node::String(y)) => {
                if x.pattern.is_some() && y.pattern.is_some() && x.pattern != y.pattern {
                    self.approximate(pointer);
                }
                Node::String(StringRules {
                    min_length: x.min_length.max(y.min_length),
                    max_length: min_opt(x.max_length, y.max_length),
                    pattern: x.pattern.or(y.pattern),
                    format: x.format.or(y.format),
                })
            }
            (Node::Integer(x), Node::Integer(y))
            | (Node::Integer(x), Node::Number(y))
            | (Node::Number(x), Node::Integer(y)) => Node::Integer(merge_numbers(x, y)),
            (Node::Number(x), Node::Number(y)) => Node::Number(merge_numbers(x, y)),
            (Node::Literals(vs), _) | (_, Node::Literals(vs)) => {
                self.approximate(pointer);
                Node::Literals(vs)
            }
            (Node::Array(x), Node::Array(_)) => {
                self.approximate(pointer);
                Node::Array(x)
            }
            (x, y) if std::mem::discriminant(&x) == std::mem::discriminant(&y) => x,
            // Different kinds: nothing is both.
            _ => Node::Never,
        }
    }

    /// `(x1 | x2 | ...) & other`, keeping the operands in their order; a single surviving
    /// alternative is returned as itself.
    fn distribute(&mut self, alts: &[NodeId], other: Node, union_first: bool, pointer: &str) -> Node {
        let mut kept = Vec::new();
        for &x in alts {
            if self.is_pending(x) {
                // A reference still being compiled has no content to intersect yet: keep the
                // reference alone, and say so.
                self.approximate(pointer);
                kept.push(Node::AnyOf(vec![x]));
                continue;
            }
            let x = self.resolve(x).clone();
            let m = if union_first {
                self.merge(x, other.clone(), pointer)
            } else {
                self.merge(other.clone(), x, pointer)
            };
            if m != Node::Never {
                kept.push(m);
            }
        }
        match kept.len() {
            0 => Node::Never,
            1 => kept.pop().expect("one"),
            _ => match kept.into_iter().map(|n| self.push(n)).collect::<Result<Vec<_>, _>>() {
                Ok(ids) => Node::AnyOf(ids),
                Err(_) => Node::Never,
            },
        }
    }

    fn merge_objects(&mut self, mut x: ObjectRules, y: ObjectRules, pointer: &str) -> ObjectRules {
        for (name, id) in y.properties {
            match x.properties.iter().position(|(n, _)| *n == name) {
                Some(i) if self.is_pending(x.properties[i].1) || self.is_pending(id) => self.approximate(pointer),
                Some(i) => {
                    let merged = self.merge(
                        self.resolve(x.properties[i].1).clone(),
                        self.resolve(id).clone(),
                        pointer,
                    );
                    if let Ok(mid) = self.push(merged) {
                        x.properties[i].1 = mid;
                    }
                }
                None => x.properties.push((name, id)),
            }
        }
        for r in y.required {
            if !x.required.contains(&r) {
                x.required.push(r);
            }
        }
        x.pattern_properties.extend(y.pattern_properties);
        if self.is_pending(y.additional) || !matches!(self.resolve(y.additional), Node::Any) {
            if !self.is_pending(x.additional) && matches!(self.resolve(x.additional), Node::Any) {
                x.additional = y.additional;
            } else {
                self.approximate(pointer);
            }
        }
        x.min_properties = x.min_properties.max(y.min_properties);
        x.max_properties = min_opt(x.max_properties, y.max_properties);
        x
    }

    pub(super) fn approximate(&mut self, pointer: &str) {
        if self.report.status_of(pointer, "allOf (merge)").is_none() {
            let how = "parts that could not be intersected keep the first part's constraint";
            self.report
                .add(pointer, "allOf (merge)", KeywordStatus::Approximated(how.into()));
        }
    }
}

fn min_opt(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn merge_numbers(x: NumberRules, y: NumberRules) -> NumberRules {
    // The tighter of two bounds; at equal values an exclusive bound is the tighter.
    let pick = |a: Option<f64>, ae: bool, b: Option<f64>, be: bool, lower: bool| match (a, b) {
        (Some(a), Some(b)) => {
            let a_tighter = if lower {
                a > b || (a == b && ae)
            } else {
                a < b || (a == b && ae)
            };
            if a_tighter {
                (Some(a), ae)
            } else {
                (Some(b), be)
            }
        }
        (Some(a), None) => (Some(a), ae),
        (None, b) => (b, be),
    };
    let (minimum, exclusive_minimum) = pick(x.minimum, x.exclusive_minimum, y.minimum, y.exclusive_minimum, true);
    let (maximum, exclusive_maximum) = pick(x.maximum, x.exclusive_maximum, y.maximum, y.exclusive_maximum, false);
    NumberRules {
        minimum,
        maximum,
        exclusive_minimum,
        exclusive_maximum,
        multiple_of: x.multiple_of.or(y.multiple_of),
    }
}
