//! Regexes for JSON lexemes under schema constraints: integers and decimals in a range, string
//! formats.
//! Each becomes a byte DFA; the JSON matcher steps through them.

pub mod decimal_range;
pub mod format;
pub mod int_range;

pub use format::{format_exactness, format_regex};
pub use int_range::{int_range_regex, integer_bounds};
