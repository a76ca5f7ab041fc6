//! The schema as the matcher needs it: references resolved into a graph (recursion is a cycle
//! of node ids), `allOf` merged, `type` arrays and `anyOf`/`oneOf` turned into unions, and
//! every kept constraint in typed form.

use serde_json::Value;

pub type NodeId = u32;

#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    /// Any JSON value.
    Any,
    /// No value at all (`false`, or contradictory constraints).
    Never,
    Null,
    Boolean,
    Integer(NumberRules),
    Number(NumberRules),
    String(StringRules),
    /// Exactly these values (`enum`, `const`), compared as JSON.
    Literals(Vec<Value>),
    Array(ArrayRules),
    Object(ObjectRules),
    /// A value matching at least one alternative.
    AnyOf(Vec<NodeId>),
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct NumberRules {
    pub minimum: Option<f64>,
    pub maximum: Option<f64>,
    pub exclusive_minimum: bool,
    pub exclusive_maximum: bool,
    pub multiple_of: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StringFormat {
    Date,
    Time,
    DateTime,
    Duration,
    Email,
    Hostname,
    Ipv4,
    Ipv6,
    Uuid,
    Uri,
}

impl StringFormat {
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "date" => Self::Date,
            "time" => Self::Time,
            "date-time" => Self::DateTime,
            "duration" => Self::Duration,
            "email" => Self::Email,
            "hostname" => Self::Hostname,
            "ipv4" => Self::Ipv4,
            "ipv6" => Self::Ipv6,
            "uuid" => Self::Uuid,
            "uri" => Self::Uri,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct StringRules {
    /// In characters (Unicode scalar values), as JSON Schema counts them.
    pub min_length: u64,
    pub max_length: Option<u64>,
    /// ECMA-262 pattern, unanchored as JSON Schema specifies.
    pub pattern: Option<String>,
    pub format: Option<StringFormat>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ArrayRules {
    /// `prefixItems` (or array-form `items`): the schema of each leading position.
    pub prefix: Vec<NodeId>,
    /// Schema of every item after the prefix; `Never` when none may follow.
    pub items: NodeId,
    pub min_items: u64,
    pub max_items: Option<u64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ObjectRules {
    /// Declared properties, in schema order.
    pub properties: Vec<(String, NodeId)>,
    pub required: Vec<String>,
    pub pattern_properties: Vec<(String, NodeId)>,
    /// Schema of properties matched by neither `properties` nor `patternProperties`.
    pub additional: NodeId,
    pub min_properties: u64,
    pub max_properties: Option<u64>,
    pub property_names: Option<StringRules>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SchemaGraph {
    pub nodes: Vec<Node>,
    pub root: NodeId,
}

impl SchemaGraph {
    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }
}
