/// Why a constraint could not be compiled or a token was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GrammarError {
    #[error("invalid regex {pattern:?}: {reason}")]
    Regex { pattern: String, reason: String },
    #[error("{what} is too large: {reason}")]
    TooLarge { what: String, reason: String },
    #[error("invalid schema at {pointer:?}, keyword `{keyword}`: {reason}")]
    InvalidSchema {
        pointer: String,
        keyword: String,
        reason: String,
    },
    #[error("unsupported schema keyword `{keyword}` at {pointer:?}: {reason}")]
    Unsupported {
        pointer: String,
        keyword: String,
        reason: String,
    },
    #[error("grammar line {line}: {reason}")]
    Grammar { line: usize, reason: String },
    #[error("token {token} is not allowed here")]
    TokenRejected { token: u32 },
    #[error("the output is already complete")]
    AlreadyFinished,
    #[error("cannot roll back {requested} tokens, only {available} accepted")]
    RollbackTooFar { requested: usize, available: usize },
}
