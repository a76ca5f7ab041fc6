//! The grammar text format: a subset of llama.cpp's GBNF.
//!
//! ```text
//! root   ::= "{" ws pair ("," ws pair)* "}"    # rules: name ::= expression
//! pair   ::= key ":" ws [0-9]+                  # literals, classes, references
//! key    ::= "\"" [a-z_]{1,16} "\""             # repetition: * + ? {m} {m,} {m,n}
//! ws     ::= [ \t\n]{0,2}                       # grouping ( ... ), alternation |, `.`
//! ```
//! Escapes in literals and classes: `\n \r \t \\ \" \] \- \xHH \uHHHH \UHHHHHHHH`. The start
//! rule is `root`. Left recursion is refused (the matcher expands calls eagerly).

use crate::error::GrammarError;

/// Largest count a `{m,n}` repetition may name.
pub const MAX_REPEAT: u32 = 1000;

#[derive(Debug, Clone, PartialEq)]
pub enum Expr {
    Alt(Vec<Expr>),
    Seq(Vec<Expr>),
    /// A terminal, as a regex over characters.
    Term(String),
    Ref(String),
    Repeat(Box<Expr>, u32, Option<u32>),
}

/// A rule: its name, its expression and the line it starts on.
pub type Rule = (String, Expr, usize);

pub fn parse(text: &str) -> Result<Vec<Rule>, GrammarError> {
    let mut p = Parser {
        chars: text.chars().collect(),
        at: 0,
    };
    let mut rules = Vec::new();
    loop {
        p.skip_space();
        if p.at >= p.chars.len() {
            break;
        }
        let line = p.line();
        let name = p.name().ok_or_else(|| p.error("expected a rule name"))?;
        p.skip_space();
        if !p.eat_str("::=") {
            return Err(p.error("expected `::=` after the rule name"));
        }
        let expr = p.alt()?;
        if rules.iter().any(|(n, _, _): &Rule| *n == name) {
            return Err(GrammarError::Grammar {
                line,
                reason: format!("rule {name:?} is defined twice"),
            });
        }
        rules.push((name, expr, line));
    }
    Ok(rules)
}

struct Parser {
    chars: Vec<char>,
    at: usize,
}

impl Parser {
    fn line(&self) -> usize {
        self.chars[..self.at.min(self.chars.len())]
            .iter()
            .filter(|&&c| c == '\n')
            .count()
            + 1
    }

    fn error(&self, what: &str) -> GrammarError {
        GrammarError::Grammar {
            line: self.line(),
            reason: what.to_string(),
        }
    }

    fn peek(&self) -> Option<char> {
        self.chars.get(self.at).copied()
    }

    fn eat(&mut self, c: char) -> bool {
        let yes = self.peek() == Some(c);
        self.at += yes as usize;
        yes
    }

    fn eat_str(&mut self, s: &str) -> bool {
        let n = s.chars().count();
        let yes = self.chars[self.at..].iter().take(n).copied().eq(s.chars());
        if yes {
            self.at += n;
        }
        yes
    }

    fn skip_space(&mut self) {
        while let Some(c) = self.peek() {
            if c == '#' {
                while self.peek().is_some_and(|c| c != '\n') {
                    self.at += 1;
                }
            } else if c.is_whitespace() {
                self.at += 1;
            } else {
                break;
            }
        }
    }

    fn name(&mut self) -> Option<String> {
        let start = self.at;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            self.at += 1;
        }
        (self.at > start).then(|| self.chars[start..self.at].iter().collect())
    }

    /// At the start of the next rule (`name ::=`)?
    fn at_rule_start(&mut self) -> bool {
        let save = self.at;
        let yes = self.name().is_some() && {
            self.skip_space();
            self.eat_str("::=")
        };
        self.at = save;
        yes
    }

    fn alt(&mut self) -> Result<Expr, GrammarError> {
        let mut alts = vec![self.seq()?];
        while self.eat('|') {
            alts.push(self.seq()?);
        }
        Ok(if alts.len() == 1 {
            alts.pop().expect("one")
        } else {
            Expr::Alt(alts)
        })
    }

    fn seq(&mut self) -> Result<Expr, GrammarError> {
        let mut items = Vec::new();
        loop {
            self.skip_space();
            match self.peek() {
                None | Some('|') | Some(')') => break,
                _ if self.at_rule_start() => break,
                _ => items.push(self.postfix()?),
            }
        }
        Ok(if items.len() == 1 {
            items.pop().expect("one")
        } else {
            Expr::Seq(items)
        })
    }

    fn postfix(&mut self) -> Result<Expr, GrammarError> {
        let mut e = self.primary()?;
        loop {
            let (min, max) = match self.peek() {
                Some('*') => (0, None),
                Some('+') => (1, None),
                Some('?') => (0, Some(1)),
                Some('{') => {
                    self.at += 1;
                    let min = self.number()?;
                    let max = if !self.eat(',') {
                        Some(min)
                    } else if self.peek() == Some('}') {
                        None
                    } else {
                        Some(self.number()?)
                    };
                    if self.peek() != Some('}') {
                        return Err(self.error("expected `}` to close the repetition"));
                    }
                    if max.is_some_and(|m| m < min) || max.unwrap_or(min) > MAX_REPEAT {
                        return Err(self.error(&format!("repetition counts must be ordered and at most {MAX_REPEAT}")));
                    }
                    (min, max)
                }
                _ => return Ok(e),
            };
            self.at += 1; // the operator, or the closing `}`
            e = Expr::Repeat(Box::new(e), min, max);
        }
    }

    fn number(&mut self) -> Result<u32, GrammarError> {
        let start = self.at;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.at += 1;
        }
        let digits: String = self.chars[start..self.at].iter().collect();
        digits.parse().map_err(|_| self.error("expected a count"))
    }

    fn primary(&mut self) -> Result<Expr, GrammarError> {
        match self.peek() {
            Some('"') => {
                self.at += 1;
                let mut text = String::new();
                loop {
                    match self.peek() {
                        None => return Err(self.error("unterminated literal")),
                        Some('"') => break,
                        Some('\\') => text.push(self.escape()?),
                        Some(c) => {
                            text.push(c);
                            self.at += 1;
                        }
                    }
                }
                self.at += 1;
                Ok(Expr::Term(crate::regex::literal(&text)))
            }
            Some('[') => {
                self.at += 1;
                let mut class = String::from("[");
                if self.eat('^') {
                    class.push('^');
                }
                let mut empty = true;
                while self.peek() != Some(']') {
                    let lo = self.class_char()?;
                    class.push_str(&hex(lo));
                    if self.peek() == Some('-') && self.chars.get(self.at + 1) != Some(&']') {
                        self.at += 1;
                        let hi = self.class_char()?;
                        if hi < lo {
                            return Err(self.error("a class range runs backwards"));
                        }
                        class.push('-');
                        class.push_str(&hex(hi));
                    }
                    empty = false;
                }
                self.at += 1;
                if empty {
                    return Err(self.error("an empty character class"));
                }
                class.push(']');
                Ok(Expr::Term(class))
            }
            Some('.') => {
                self.at += 1;
                Ok(Expr::Term(r"(?s:.)".into()))
            }
            Some('(') => {
                self.at += 1;
                let e = self.alt()?;
                self.skip_space();
                if !self.eat(')') {
                    return Err(self.error("expected `)`"));
                }
                Ok(e)
            }
            _ => match self.name() {
                Some(n) => Ok(Expr::Ref(n)),
                None => Err(self.error(&format!("unexpected {:?}", self.peek().unwrap_or(' ')))),
            },
        }
    }

    fn class_char(&mut self) -> Result<char, GrammarError> {
        match self.peek() {
            None => Err(self.error("unterminated character class")),
            Some('\\') => self.escape(),
            Some(c) => {
                self.at += 1;
                Ok(c)
            }
        }
    }

    /// An escape sequence, the backslash included.
    fn escape(&mut self) -> Result<char, GrammarError> {
        self.at += 1;
        let c = self.peek().ok_or_else(|| self.error("a lone backslash"))?;
        self.at += 1;
        let digits = match c {
            'n' => return Ok('\n'),
            'r' => return Ok('\r'),
            't' => return Ok('\t'),
            'x' => 2,
            'u' => 4,
            'U' => 8,
            other => return Ok(other),
        };
        let hex: String = self.chars[self.at..].iter().take(digits).collect();
        self.at += digits;
        u32::from_str_radix(&hex, 16)
            .ok()
            .filter(|_| hex.len() == digits)
            .and_then(char::from_u32)
            .ok_or_else(|| self.error(&format!("bad escape \\{c}{hex}")))
    }
}

fn hex(c: char) -> String {
    format!("\\x{{{:X}}}", c as u32)
}
