//! Proposers for speculative decoding: each guesses a request's next tokens before the model
//! is asked, and the model checks the guesses in one pass.

pub mod ngram;

pub use ngram::NgramProposer;
