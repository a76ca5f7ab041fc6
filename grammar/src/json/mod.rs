//! JSON Schema constraints: the schema compiler (to a resolved graph plus a per-keyword
//! report). The matcher over this graph comes next.

pub mod compile;
pub mod ir;
pub mod report;

pub use compile::{compile_schema, SchemaOptions};
pub use ir::{Node, NodeId, SchemaGraph};
pub use report::{CompileReport, KeywordReport, KeywordStatus};
