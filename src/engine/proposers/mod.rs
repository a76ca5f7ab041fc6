//! Proposers for speculative decoding: each guesses a request's next tokens before the model
//! is asked, and the model checks the guesses in one pass.

pub mod draft_model;
pub mod grammar;
pub mod ngram;

pub use draft_model::{DraftModel, DraftRow};
pub use grammar::forced_after;
pub use ngram::NgramProposer;
