//! What a compiled schema does with each keyword, so that nothing is silently ignored.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeywordStatus {
    /// Every output satisfies it.
    Enforced,
    /// Enforced in a weaker form; the reason says how.
    Approximated(String),
    /// Not enforced at all (lenient mode) or the cause of a compile error (strict mode).
    Rejected(String),
    /// Enforced more strictly than written, by a policy the caller chose; the reason says how.
    /// Every output still validates against the schema as written.
    Narrowed(String),
    /// Carries no constraint (title, description, examples, vendor extensions...).
    Annotation,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeywordReport {
    /// JSON pointer of the schema object the keyword belongs to (`""` is the root).
    pub pointer: String,
    pub keyword: String,
    pub status: KeywordStatus,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompileReport {
    pub keywords: Vec<KeywordReport>,
}

impl CompileReport {
    pub(crate) fn add(&mut self, pointer: &str, keyword: &str, status: KeywordStatus) {
        self.keywords.push(KeywordReport {
            pointer: pointer.to_string(),
            keyword: keyword.to_string(),
            status,
        });
    }

    /// Records `status`, replacing what was said of the same keyword before.
    pub(crate) fn set(&mut self, pointer: &str, keyword: &str, status: KeywordStatus) {
        match self
            .keywords
            .iter_mut()
            .find(|k| k.pointer == pointer && k.keyword == keyword)
        {
            Some(k) => k.status = status,
            None => self.add(pointer, keyword, status),
        }
    }

    /// Every constraint is enforced exactly: valid outputs are exactly the schema's instances
    /// (up to the whitespace policy).
    pub fn fully_enforced(&self) -> bool {
        self.keywords
            .iter()
            .all(|k| matches!(k.status, KeywordStatus::Enforced | KeywordStatus::Annotation))
    }

    pub fn rejected(&self) -> impl Iterator<Item = &KeywordReport> {
        self.keywords
            .iter()
            .filter(|k| matches!(k.status, KeywordStatus::Rejected(_)))
    }

    pub fn approximated(&self) -> impl Iterator<Item = &KeywordReport> {
        self.keywords
            .iter()
            .filter(|k| matches!(k.status, KeywordStatus::Approximated(_)))
    }

    pub fn status_of(&self, pointer: &str, keyword: &str) -> Option<&KeywordStatus> {
        self.keywords
            .iter()
            .find(|k| k.pointer == pointer && k.keyword == keyword)
            .map(|k| &k.status)
    }
}

impl fmt::Display for KeywordReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let at = if self.pointer.is_empty() { "#" } else { &self.pointer };
        match &self.status {
            KeywordStatus::Enforced => write!(f, "{at}/{}: enforced", self.keyword),
            KeywordStatus::Approximated(how) => write!(f, "{at}/{}: approximated ({how})", self.keyword),
            KeywordStatus::Rejected(why) => write!(f, "{at}/{}: rejected ({why})", self.keyword),
            KeywordStatus::Narrowed(how) => write!(f, "{at}/{}: narrowed ({how})", self.keyword),
            KeywordStatus::Annotation => write!(f, "{at}/{}: annotation", self.keyword),
        }
    }
}
