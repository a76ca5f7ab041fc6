//! The keywords of each kind of value: numbers, strings, arrays, objects, and the literal
//! values of `enum` and `const`.

use serde_json::{Map, Value};

use super::super::ir::{ArrayRules, Node, NodeId, NumberRules, ObjectRules, StringFormat, StringRules};
use super::super::lexemes::{malformed_pattern, number_lexeme, pattern_body, string_body, MAX_MULTIPLE};
use super::super::report::KeywordStatus;
use super::{bad, escape, Compiler};
use crate::dfa::{ByteDfa, DfaLimits, StateId, DEAD};
use crate::error::GrammarError;
use crate::lexeme::format_exactness;

impl Compiler<'_> {
    pub(super) fn number_rules(
        &mut self,
        obj: &Map<String, Value>,
        pointer: &str,
        integer: bool,
    ) -> Result<NumberRules, GrammarError> {
        let num = |k: &str| -> Result<Option<f64>, GrammarError> {
            match obj.get(k) {
                None => Ok(None),
                Some(v) => v.as_f64().map(Some).ok_or_else(|| bad(pointer, k, "must be a number")),
            }
        };
        let mut r = NumberRules {
            minimum: num("minimum")?,
            maximum: num("maximum")?,
            ..Default::default()
        };
        // Draft 4 spells exclusivity as booleans, later drafts as numbers.
        for (key, bound, flag) in [
            ("exclusiveMinimum", &mut r.minimum, &mut r.exclusive_minimum),
            ("exclusiveMaximum", &mut r.maximum, &mut r.exclusive_maximum),
        ] {
            match obj.get(key) {
                Some(Value::Bool(b)) => *flag = *b,
                Some(v) => {
                    let x = v
                        .as_f64()
                        .ok_or_else(|| bad(pointer, key, "must be a number or a boolean"))?;
                    let tighter = match *bound {
                        None => true,
                        Some(b) => {
                            if key == "exclusiveMinimum" {
                                x >= b
                            } else {
                                x <= b
                            }
                        }
                    };
                    if tighter {
                        *bound = Some(x);
                        *flag = true;
                    }
                }
                None => {}
            }
        }
        for k in ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"] {
            if obj.contains_key(k) && self.report.status_of(pointer, k).is_none() {
                self.report.add(pointer, k, KeywordStatus::Enforced);
            }
        }
        if let Some(m) = num("multipleOf")? {
            if m <= 0.0 {
                return Err(bad(pointer, "multipleOf", "must be greater than 0"));
            }
            r.multiple_of = Some(m);
            self.report.add(pointer, "multipleOf", KeywordStatus::Enforced);
        }
        // What the number lexeme leaves out, as its builder says.
        for loose in number_lexeme(&r, integer).1 {
            let keywords: &[&str] = match loose {
                "multipleOf" => &["multipleOf"],
                _ => &["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"],
            };
            for k in keywords {
                if obj.contains_key(*k) {
                    let status = match loose {
                        "multipleOf" => {
                            KeywordStatus::Rejected(format!("only whole steps up to {MAX_MULTIPLE} are enforced"))
                        }
                        _ => KeywordStatus::Approximated("a bound beyond 1e38 or not finite is not enforced".into()),
                    };
                    self.report.set(pointer, k, status);
                }
            }
        }
        Ok(r)
    }

    pub(super) fn string_rules(
        &mut self,
        obj: &Map<String, Value>,
        pointer: &str,
    ) -> Result<StringRules, GrammarError> {
        let mut r = StringRules {
            min_length: self.count(obj, pointer, "minLength")?.unwrap_or(0),
            max_length: self.count(obj, pointer, "maxLength")?,
            ..Default::default()
        };
        if let Some(v) = obj.get("pattern") {
            let p = v.as_str().ok_or_else(|| bad(pointer, "pattern", "must be a string"))?;
            if let Some(why) = malformed_pattern(p) {
                return Err(bad(pointer, "pattern", why));
            }
            r.pattern = Some(p.to_string());
            self.enforced(pointer, "pattern");
        }
        if let Some(v) = obj.get("format") {
            let name = v.as_str().ok_or_else(|| bad(pointer, "format", "must be a string"))?;
            r.format = StringFormat::parse(name);
            if self.report.status_of(pointer, "format").is_none() {
                let status = match r.format {
                    Some(_) => KeywordStatus::Enforced,
                    // Unknown formats are annotations by the specification.
                    None => KeywordStatus::Approximated(format!("unknown format {name:?} is not checked")),
                };
                self.report.add(pointer, "format", status);
            }
        }
        self.report_loose_string(&r, pointer);
        Ok(r)
    }

    /// What the string lexeme cannot enforce, as the lexeme builder says.
    fn report_loose_string(&mut self, r: &StringRules, pointer: &str) {
        for loose in string_body(r).1 {
            let (keywords, status): (&[&str], KeywordStatus) = match loose {
                "pattern (unsupported regex features)" => {
                    let why = r
                        .pattern
                        .as_deref()
                        .map(pattern_body)
                        .and_then(|b| b.err())
                        .unwrap_or_default();
                    (
                        &["pattern"],
                        KeywordStatus::Rejected(format!("cannot be enforced: {why}")),
                    )
                }
                l if l.starts_with("format") => (&["format"], KeywordStatus::Approximated(l.into())),
                l if l.starts_with("minLength/maxLength") => {
                    (&["minLength", "maxLength"], KeywordStatus::Approximated(l.into()))
                }
                l if l.starts_with("minLength") => (&["minLength"], KeywordStatus::Approximated(l.into())),
                l => (&["maxLength"], KeywordStatus::Approximated(l.into())),
            };
            for k in keywords {
                if self.report.status_of(pointer, k).is_some() {
                    self.report.set(pointer, k, status.clone());
                }
            }
        }
        if let (Some(f), None) = (r.format, &r.pattern) {
            if let Some(how) = format_exactness(f) {
                self.report
                    .set(pointer, "format", KeywordStatus::Approximated(how.into()));
            }
        }
    }

    pub(super) fn array_rules(&mut self, obj: &Map<String, Value>, pointer: &str) -> Result<ArrayRules, GrammarError> {
        let mut prefix = Vec::new();
        let mut items = None;
        let prefix_src = match (obj.get("prefixItems"), obj.get("items")) {
            (Some(Value::Array(p)), _) => Some(("prefixItems", p)),
            (None, Some(Value::Array(p))) => Some(("items", p)),
            _ => None,
        };
        if let Some((key, list)) = prefix_src {
            for (i, s) in list.iter().enumerate() {
                prefix.push(self.compile(s, &format!("{pointer}/{key}/{i}"))?);
            }
            self.enforced(pointer, key);
        }
        if let Some(s) = obj.get("items").filter(|v| !v.is_array()) {
            items = Some(self.compile(s, &format!("{pointer}/items"))?);
            self.enforced(pointer, "items");
        }
        if let Some(s) = obj.get("additionalItems") {
            if prefix_src.is_some_and(|(k, _)| k == "items") && items.is_none() {
                items = Some(self.compile(s, &format!("{pointer}/additionalItems"))?);
            }
            self.enforced(pointer, "additionalItems");
        }
        let items = match items {
            Some(i) => i,
            None => self.push(Node::Any)?,
        };
        let mut r = ArrayRules {
            prefix,
            items,
            min_items: 0,
            max_items: None,
        };
        r.min_items = self.count(obj, pointer, "minItems")?.unwrap_or(0);
        r.max_items = self.count(obj, pointer, "maxItems")?;
        Ok(r)
    }

    pub(super) fn object_rules(
        &mut self,
        obj: &Map<String, Value>,
        pointer: &str,
    ) -> Result<ObjectRules, GrammarError> {
        let properties = self.schema_map(obj, pointer, "properties")?;
        let pattern_properties = self.schema_map(obj, pointer, "patternProperties")?;
        let additional = match obj.get("additionalProperties") {
            Some(s) => {
                self.enforced(pointer, "additionalProperties");
                self.compile(s, &format!("{pointer}/additionalProperties"))?
            }
            // `unevaluatedProperties` speaks of the same keys: such an object is left as written.
            None => {
                let id = self.push(Node::Any)?;
                if !obj.contains_key("unevaluatedProperties") {
                    self.implicit_open.insert(id, pointer.to_string());
                }
                id
            }
        };
        let mut required = Vec::new();
        if let Some(req) = obj.get("required") {
            let list = req
                .as_array()
                .ok_or_else(|| bad(pointer, "required", "must be an array"))?;
            for r in list {
                let name = r
                    .as_str()
                    .ok_or_else(|| bad(pointer, "required", "must hold strings"))?;
                if !required.iter().any(|x: &String| x == name) {
                    required.push(name.to_string());
                }
            }
            self.enforced(pointer, "required");
        }
        let mut r = ObjectRules {
            properties,
            required,
            pattern_properties,
            additional,
            min_properties: 0,
            max_properties: None,
            property_names: None,
        };
        r.min_properties = self.count(obj, pointer, "minProperties")?.unwrap_or(0);
        r.max_properties = self.count(obj, pointer, "maxProperties")?;
        if let Some(Value::Object(names)) = obj.get("propertyNames") {
            let names_pointer = format!("{pointer}/propertyNames");
            r.property_names = Some(self.string_rules(names, &names_pointer)?);
            self.report.set(
                pointer,
                "propertyNames",
                KeywordStatus::Rejected("not enforced yet".into()),
            );
        }
        for (p, _) in &r.pattern_properties {
            if let Err(why) = pattern_body(p) {
                let status = KeywordStatus::Rejected(format!("pattern {p:?} cannot be enforced: {why}"));
                self.report.set(pointer, "patternProperties", status);
            }
        }
        self.overlapping_patterns(&mut r, pointer)?;
        Ok(r)
    }

    /// A key matched by a declared name and by patterns must satisfy every one of their
    /// schemas: the declared property's schema becomes the intersection. A key matched by two
    /// patterns alone would need an intersection per combination; it is held to the first
    /// pattern's schema, and the report says so.
    fn overlapping_patterns(&mut self, r: &mut ObjectRules, pointer: &str) -> Result<(), GrammarError> {
        if r.pattern_properties.is_empty() {
            return Ok(());
        }
        let dfas: Vec<Option<ByteDfa>> = r
            .pattern_properties
            .iter()
            .map(|(p, _)| {
                let body = pattern_body(p).ok()?;
                ByteDfa::from_regex(&body, DfaLimits::default()).ok()
            })
            .collect();
        // Many names often share one schema with the pattern (the same `$ref`): each distinct
        // pair is intersected once, and a schema with itself is itself.
        let mut merged_pairs: std::collections::HashMap<(NodeId, NodeId), NodeId> = Default::default();
        for i in 0..r.properties.len() {
            let quoted = Value::String(r.properties[i].0.clone()).to_string();
            let body = &quoted.as_bytes()[1..quoted.len() - 1];
            for (j, dfa) in dfas.iter().enumerate() {
                let Some(dfa) = dfa else { continue };
                let end = dfa.run(dfa.start(), body);
                if end == DEAD || !dfa.is_accepting(end) {
                    continue;
                }
                let (declared, pattern) = (r.properties[i].1, r.pattern_properties[j].1);
                let pair = (self.target(declared), self.target(pattern));
                if pair.0 == pair.1 {
                    continue;
                }
                if let Some(&m) = merged_pairs.get(&pair) {
                    r.properties[i].1 = m;
                    continue;
                }
                if self.is_pending(declared) || self.is_pending(pattern) {
                    self.approximate(pointer);
                    continue;
                }
                let merged = self.merge(self.resolve(declared).clone(), self.resolve(pattern).clone(), pointer);
                r.properties[i].1 = self.push(merged)?;
                merged_pairs.insert(pair, r.properties[i].1);
            }
        }
        let live: Vec<&ByteDfa> = dfas.iter().flatten().collect();
        let overlap = live.len() >= 2
            && ByteDfa::union(&live, DfaLimits::default().max_states).map_or(true, |u| {
                (0..u.num_states() as StateId).any(|s| u.matches(s).len() >= 2)
            });
        if overlap
            && matches!(
                self.report.status_of(pointer, "patternProperties"),
                Some(KeywordStatus::Enforced) | None
            )
        {
            let how = "a key that several patterns match is held to the first one's schema only";
            self.report
                .set(pointer, "patternProperties", KeywordStatus::Approximated(how.into()));
        }
        Ok(())
    }

    pub(super) fn enforced(&mut self, pointer: &str, keyword: &str) {
        if self.report.status_of(pointer, keyword).is_none() {
            self.report.add(pointer, keyword, KeywordStatus::Enforced);
        }
    }

    /// `enum` and `const`: the allowed values themselves.
    pub(super) fn literals(
        &mut self,
        obj: &Map<String, Value>,
        pointer: &str,
    ) -> Result<Option<Vec<Value>>, GrammarError> {
        let mut values: Option<Vec<Value>> = None;
        if let Some(e) = obj.get("enum") {
            values = Some(
                e.as_array()
                    .ok_or_else(|| bad(pointer, "enum", "must be an array"))?
                    .clone(),
            );
            self.enforced(pointer, "enum");
        }
        if let Some(c) = obj.get("const") {
            values = Some(match values {
                Some(v) => v.into_iter().filter(|x| x == c).collect(),
                None => vec![c.clone()],
            });
            self.enforced(pointer, "const");
        }
        if values.is_some()
            && ["type", "minLength", "maxLength", "pattern", "minimum", "maximum"]
                .iter()
                .any(|k| obj.contains_key(*k))
        {
            // The matcher keeps only the literals the other keywords also accept; until it does,
            // say so rather than pretend.
            self.report.add(
                pointer,
                "enum/const with other keywords",
                KeywordStatus::Approximated("literals are not re-checked against sibling keywords".into()),
            );
        }
        Ok(values)
    }

    /// An optional non-negative integer keyword (`minLength`, `maxItems`, ...), recorded as
    /// enforced. `2.0` counts as an integer, as the specification says.
    fn count(&mut self, obj: &Map<String, Value>, pointer: &str, key: &str) -> Result<Option<u64>, GrammarError> {
        let Some(v) = obj.get(key) else { return Ok(None) };
        let n = v
            .as_u64()
            .or_else(|| v.as_f64().filter(|f| *f >= 0.0 && f.fract() == 0.0).map(|f| f as u64))
            .ok_or_else(|| bad(pointer, key, "must be a non-negative integer"))?;
        self.enforced(pointer, key);
        Ok(Some(n))
    }

    /// A keyword mapping names (or patterns) to schemas, compiled in schema order.
    fn schema_map(
        &mut self,
        obj: &Map<String, Value>,
        pointer: &str,
        key: &str,
    ) -> Result<Vec<(String, NodeId)>, GrammarError> {
        let Some(map) = obj.get(key) else { return Ok(Vec::new()) };
        let map = map.as_object().ok_or_else(|| bad(pointer, key, "must be an object"))?;
        let mut out = Vec::with_capacity(map.len());
        for (name, s) in map {
            out.push((
                name.clone(),
                self.compile(s, &format!("{pointer}/{key}/{}", escape(name)))?,
            ));
        }
        self.enforced(pointer, key);
        Ok(out)
    }
}
