//! JSON Schema constraints: the schema compiler (to a resolved graph plus a per-keyword
//! report), the automata built from it, and the matcher that steps through them.

pub mod compile;
mod completion;
pub mod grammar;
pub mod ir;
pub mod lexemes;
mod machine;
pub mod matcher;
pub mod report;

pub use compile::{compile_schema, SchemaOptions};
pub use grammar::JsonGrammar;
pub use ir::{Node, NodeId, SchemaGraph};
pub use lexemes::Whitespace;
pub use matcher::JsonMatcher;
pub use report::{CompileReport, KeywordReport, KeywordStatus};
