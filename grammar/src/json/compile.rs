//! JSON Schema (drafts 4 to 2020-12 as real schemas use them) to a `SchemaGraph`, with a
//! report on every keyword. Local references only; recursion becomes a cycle in the graph.

mod kinds;
mod merge;

use std::collections::HashMap;

use serde_json::{Map, Value};

use super::ir::{Node, NodeId, SchemaGraph};
use super::report::{CompileReport, KeywordStatus};
use crate::error::GrammarError;

#[derive(Debug, Clone)]
pub struct SchemaOptions {
    /// Refuse schemas with keywords that cannot be enforced (else enforce the rest and report).
    pub strict: bool,
    pub max_nodes: usize,
    pub max_depth: usize,
    /// An object that declares properties but says nothing of `additionalProperties` takes
    /// only its declared (and pattern) properties, as OpenAI's strict mode requires: what an
    /// extraction wants, where the literal reading lets a model invent keys. Reported as
    /// `narrowed` at each such object.
    pub close_objects: bool,
    /// Declared properties come in the order the schema lists them (each may still be left
    /// out unless required), as OpenAI's structured outputs and llama.cpp's grammars write
    /// them: the model reads the schema's order and then only picks values.
    pub ordered_properties: bool,
    /// Longest a schema may take to compile (checked between the automata it builds).
    pub max_compile_time: std::time::Duration,
    /// Most heap the automata of one schema may take.
    pub max_automata_bytes: usize,
}

impl Default for SchemaOptions {
    fn default() -> Self {
        SchemaOptions {
            strict: true,
            max_nodes: 100_000,
            max_depth: 128,
            close_objects: false,
            ordered_properties: false,
            // The slowest of MaskBench's 7,943 real schemas compiles in about 1 s on one core
            // and the largest takes under 200 MiB.
            max_compile_time: std::time::Duration::from_secs(5),
            max_automata_bytes: 512 << 20,
        }
    }
}

/// Keywords with no effect on which instances are valid.
const ANNOTATIONS: &[&str] = &[
    "$schema",
    "$id",
    "id",
    "$comment",
    "$anchor",
    "$dynamicAnchor",
    "title",
    "description",
    "default",
    "examples",
    "example",
    "readOnly",
    "writeOnly",
    "deprecated",
    "$vocabulary",
    "contentMediaType",
    "contentEncoding",
    "discriminator",
    "xml",
    "externalDocs",
];

/// Keywords handled where their parent keyword is, not on their own.
const COMPANIONS: &[&str] = &["definitions", "$defs", "then", "else"];

pub fn compile_schema(schema: &Value, options: &SchemaOptions) -> Result<(SchemaGraph, CompileReport), GrammarError> {
    let mut c = Compiler {
        root: schema,
        options,
        nodes: Vec::new(),
        report: CompileReport::default(),
        refs: HashMap::new(),
        pending: std::collections::HashSet::new(),
        depth: 0,
        merge_depth: 0,
        implicit_open: HashMap::new(),
    };
    let root = c.compile(schema, "")?;
    if options.close_objects {
        c.close_objects()?;
    }
    if options.strict {
        if let Some(k) = c.report.rejected().next() {
            return Err(GrammarError::Unsupported {
                pointer: k.pointer.clone(),
                keyword: k.keyword.clone(),
                reason: match &k.status {
                    KeywordStatus::Rejected(r) => r.clone(),
                    _ => String::new(),
                },
            });
        }
    }
    Ok((SchemaGraph { nodes: c.nodes, root }, c.report))
}

struct Compiler<'a> {
    root: &'a Value,
    options: &'a SchemaOptions,
    nodes: Vec<Node>,
    report: CompileReport,
    /// Reference target pointer -> node, reserved before the target is compiled.
    refs: HashMap<String, NodeId>,
    /// Reference targets still being compiled: their node is a placeholder, so nothing may
    /// be intersected with it yet.
    pending: std::collections::HashSet<NodeId>,
    depth: usize,
    /// Nesting of `merge` calls: intersecting recursive schemas would otherwise never end.
    merge_depth: usize,
    /// The `additionalProperties` nodes that stand for an absent keyword, with the pointer of
    /// their object: closed afterwards under `close_objects` (after `allOf` merges, so a
    /// part that declares nothing does not close the properties another part declares).
    implicit_open: HashMap<NodeId, String>,
}

fn bad(pointer: &str, keyword: &str, reason: impl Into<String>) -> GrammarError {
    GrammarError::InvalidSchema {
        pointer: pointer.to_string(),
        keyword: keyword.to_string(),
        reason: reason.into(),
    }
}

fn escape(token: &str) -> String {
    token.replace('~', "~0").replace('/', "~1")
}

impl<'a> Compiler<'a> {
    /// Closes every object that declares properties and left `additionalProperties` out.
    fn close_objects(&mut self) -> Result<(), GrammarError> {
        let never = self.push(Node::Never)?;
        let mut closed = Vec::new();
        for node in self.nodes.iter_mut() {
            let Node::Object(r) = node else { continue };
            let declares = !r.properties.is_empty() || !r.pattern_properties.is_empty();
            if let (true, Some(pointer)) = (declares, self.implicit_open.get(&r.additional)) {
                // A required name the object does not declare is one it promises all the same:
                // it keeps the schema the open object gave it.
                for name in &r.required {
                    if !r.properties.iter().any(|(n, _)| n == name) {
                        r.properties.push((name.clone(), r.additional));
                    }
                }
                r.additional = never;
                closed.push(pointer.clone());
            }
        }
        closed.sort();
        closed.dedup();
        for pointer in closed {
            let how = "not given: closed to the declared properties (an open object lets the model invent keys)";
            self.report
                .add(&pointer, "additionalProperties", KeywordStatus::Narrowed(how.into()));
        }
        Ok(())
    }

    fn push(&mut self, node: Node) -> Result<NodeId, GrammarError> {
        if self.nodes.len() >= self.options.max_nodes {
            return Err(GrammarError::TooLarge {
                what: "schema".into(),
                reason: format!("more than {} nodes", self.options.max_nodes),
            });
        }
        self.nodes.push(node);
        Ok((self.nodes.len() - 1) as NodeId)
    }

    fn compile(&mut self, schema: &Value, pointer: &str) -> Result<NodeId, GrammarError> {
        self.depth += 1;
        if self.depth > self.options.max_depth {
            return Err(GrammarError::TooLarge {
                what: "schema".into(),
                reason: format!("nested deeper than {}", self.options.max_depth),
            });
        }
        let node = self.node(schema, pointer);
        self.depth -= 1;
        let node = node?;
        self.push(node)
    }

    fn node(&mut self, schema: &Value, pointer: &str) -> Result<Node, GrammarError> {
        let obj = match schema {
            Value::Bool(true) => return Ok(Node::Any),
            Value::Bool(false) => return Ok(Node::Never),
            Value::Object(o) => o,
            _ => return Err(bad(pointer, "", "a schema must be an object or a boolean")),
        };
        for key in obj.keys() {
            if ANNOTATIONS.contains(&key.as_str()) || key.starts_with("x-") {
                self.report.add(pointer, key, KeywordStatus::Annotation);
            }
        }
        if let Some(r) = obj.get("$ref") {
            return self.reference(obj, r, pointer);
        }
        let mut alternatives = self.typed_alternatives(obj, pointer)?;
        if let Some(all) = obj.get("allOf") {
            alternatives = self.all_of(all, alternatives, pointer)?;
        }
        let mut node = match alternatives.len() {
            0 => Node::Never,
            1 => alternatives.pop().expect("one"),
            _ => {
                let ids = alternatives
                    .into_iter()
                    .map(|n| self.push(n))
                    .collect::<Result<_, _>>()?;
                Node::AnyOf(ids)
            }
        };
        for key in ["anyOf", "oneOf"] {
            if let Some(list) = obj.get(key) {
                node = self.union(node, key, list, pointer)?;
            }
        }
        if let Some(values) = self.literals(obj, pointer)? {
            node = Node::Literals(values);
        }
        for key in obj.keys() {
            let k = key.as_str();
            let known = self.report.status_of(pointer, k).is_some() || COMPANIONS.contains(&k);
            if !known {
                let status = match k {
                    "not"
                    | "if"
                    | "uniqueItems"
                    | "contains"
                    | "minContains"
                    | "maxContains"
                    | "dependencies"
                    | "dependentRequired"
                    | "dependentSchemas"
                    | "unevaluatedProperties"
                    | "unevaluatedItems"
                    | "$dynamicRef"
                    | "$recursiveRef" => KeywordStatus::Rejected("not supported yet".into()),
                    _ => KeywordStatus::Annotation,
                };
                self.report.add(pointer, k, status);
            }
        }
        Ok(node)
    }

    /// `$ref` to a local JSON pointer. Siblings of `$ref` apply together with it (allOf).
    fn reference(&mut self, obj: &Map<String, Value>, r: &Value, pointer: &str) -> Result<Node, GrammarError> {
        let target = r.as_str().ok_or_else(|| bad(pointer, "$ref", "must be a string"))?;
        let Some(fragment) = target.strip_prefix('#') else {
            return Err(bad(
                pointer,
                "$ref",
                format!("only local references (#/...) are supported, not {target:?}"),
            ));
        };
        let resolved = self
            .root
            .pointer(fragment)
            .ok_or_else(|| bad(pointer, "$ref", format!("unresolvable reference {target:?}")))?;
        self.report.add(pointer, "$ref", KeywordStatus::Enforced);
        let id = match self.refs.get(fragment) {
            Some(&id) => id,
            None => {
                let id = self.push(Node::Any)?;
                self.refs.insert(fragment.to_string(), id);
                self.pending.insert(id);
                self.depth += 1;
                let node = self.node(resolved, fragment);
                self.depth -= 1;
                self.pending.remove(&id);
                self.nodes[id as usize] = node?;
                id
            }
        };
        let constraining = obj.keys().any(|k| {
            k != "$ref"
                && !ANNOTATIONS.contains(&k.as_str())
                && !k.starts_with("x-")
                && !COMPANIONS.contains(&k.as_str())
        });
        if !constraining {
            return Ok(Node::AnyOf(vec![id]));
        }
        // The siblings alone, then intersected with the target.
        let mut rest = obj.clone();
        rest.remove("$ref");
        let siblings = self.node(&Value::Object(rest), pointer)?;
        if self.is_pending(id) {
            self.approximate(pointer);
            return Ok(Node::AnyOf(vec![id]));
        }
        let target_node = self.nodes[id as usize].clone();
        Ok(self.merge(target_node, siblings, pointer))
    }

    /// The value kinds a schema admits, each with the keywords of its kind applied.
    fn typed_alternatives(&mut self, obj: &Map<String, Value>, pointer: &str) -> Result<Vec<Node>, GrammarError> {
        let types: Vec<&str> = match obj.get("type") {
            None => vec![],
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(ts)) => ts
                .iter()
                .map(|t| t.as_str().ok_or_else(|| bad(pointer, "type", "must hold strings")))
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(bad(pointer, "type", "must be a string or an array")),
        };
        if obj.contains_key("type") {
            self.report.add(pointer, "type", KeywordStatus::Enforced);
        }
        let mut kinds: Vec<&str> = if types.is_empty() {
            // No `type`: a value of any kind, each kind held to its own keywords.
            vec!["null", "boolean", "object", "array", "string", "number"]
        } else {
            types.clone()
        };
        if obj.get("nullable") == Some(&Value::Bool(true)) && !kinds.contains(&"null") {
            kinds.push("null");
        }
        if obj.contains_key("nullable") {
            self.report.add(pointer, "nullable", KeywordStatus::Enforced);
        }
        if kinds.contains(&"number") && kinds.contains(&"integer") {
            kinds.retain(|k| *k != "integer");
        }
        let untyped = types.is_empty() && !kinds.is_empty();
        let mut out = Vec::new();
        for kind in kinds {
            out.push(match kind {
                "null" => Node::Null,
                "boolean" => Node::Boolean,
                "integer" => Node::Integer(self.number_rules(obj, pointer, true)?),
                "number" => Node::Number(self.number_rules(obj, pointer, false)?),
                "string" => Node::String(self.string_rules(obj, pointer)?),
                "array" => Node::Array(self.array_rules(obj, pointer)?),
                "object" => Node::Object(self.object_rules(obj, pointer)?),
                other => return Err(bad(pointer, "type", format!("unknown type {other:?}"))),
            });
        }
        // No `type` and no keyword of any kind: any value, said once (so that an `allOf` beside
        // it has nothing to intersect).
        if untyped && out.iter().all(|n| self.unconstrained(n)) {
            return Ok(vec![Node::Any]);
        }
        Ok(out)
    }

    fn union(&mut self, node: Node, key: &str, list: &Value, pointer: &str) -> Result<Node, GrammarError> {
        let list = list.as_array().ok_or_else(|| bad(pointer, key, "must be an array"))?;
        let mut alts = Vec::new();
        for (i, s) in list.iter().enumerate() {
            alts.push(self.compile(s, &format!("{pointer}/{key}/{i}"))?);
        }
        let status = if key == "oneOf" && !self.disjoint_kinds(&alts) {
            KeywordStatus::Approximated("treated as anyOf: an output may match more than one alternative".into())
        } else {
            KeywordStatus::Enforced
        };
        self.report.add(pointer, key, status);
        let union = Node::AnyOf(alts);
        Ok(match node {
            Node::Any => union,
            other => self.merge(other, union, pointer),
        })
    }

    /// Alternatives of different value kinds can never both match.
    fn disjoint_kinds(&self, alts: &[NodeId]) -> bool {
        let kind = |id: NodeId| -> Option<u8> {
            Some(match self.resolve(id) {
                Node::Null => 0,
                Node::Boolean => 1,
                Node::Integer(_) | Node::Number(_) => 2,
                Node::String(_) => 3,
                Node::Array(_) => 4,
                Node::Object(_) => 5,
                _ => return None,
            })
        };
        let mut seen = [false; 6];
        for &a in alts {
            match kind(a) {
                Some(k) if !seen[k as usize] => seen[k as usize] = true,
                _ => return false,
            }
        }
        true
    }

    /// A kind's node that admits every value of its kind.
    fn unconstrained(&self, n: &Node) -> bool {
        let any = |id: NodeId| !self.is_pending(id) && matches!(self.resolve(id), Node::Any);
        match n {
            Node::Null | Node::Boolean | Node::Any => true,
            Node::Number(r) => *r == Default::default(),
            Node::String(r) => *r == Default::default(),
            Node::Array(r) => r.prefix.is_empty() && any(r.items) && r.min_items == 0 && r.max_items.is_none(),
            Node::Object(r) => {
                r.properties.is_empty()
                    && r.required.is_empty()
                    && r.pattern_properties.is_empty()
                    && any(r.additional)
                    && r.min_properties == 0
                    && r.max_properties.is_none()
                    && r.property_names.is_none()
            }
            _ => false,
        }
    }

    /// Whether `id` (through single-alternative unions) is a reference target still being
    /// compiled.
    fn is_pending(&self, mut id: NodeId) -> bool {
        for _ in 0..64 {
            if self.pending.contains(&id) {
                return true;
            }
            match &self.nodes[id as usize] {
                Node::AnyOf(a) if a.len() == 1 => id = a[0],
                _ => return false,
            }
        }
        false
    }

    /// The node a chain of single-alternative unions (references) ends at.
    fn target(&self, mut id: NodeId) -> NodeId {
        for _ in 0..64 {
            match &self.nodes[id as usize] {
                Node::AnyOf(a) if a.len() == 1 => id = a[0],
                _ => break,
            }
        }
        id
    }

    /// Follows single-alternative unions (references) to the node they stand for.
    fn resolve(&self, mut id: NodeId) -> &Node {
        for _ in 0..64 {
            match &self.nodes[id as usize] {
                Node::AnyOf(a) if a.len() == 1 => id = a[0],
                n => return n,
            }
        }
        &self.nodes[id as usize]
    }

    fn all_of(&mut self, all: &Value, base: Vec<Node>, pointer: &str) -> Result<Vec<Node>, GrammarError> {
        let list = all
            .as_array()
            .ok_or_else(|| bad(pointer, "allOf", "must be an array"))?;
        let mut acc = match base.len() {
            0 => Node::Any,
            1 => base.into_iter().next().expect("one"),
            _ => Node::AnyOf(base.into_iter().map(|n| self.push(n)).collect::<Result<_, _>>()?),
        };
        for (i, s) in list.iter().enumerate() {
            let part = self.node(s, &format!("{pointer}/allOf/{i}"))?;
            acc = self.merge(acc, part, pointer);
        }
        self.enforced(pointer, "allOf");
        Ok(vec![acc])
    }
}
