//! Context-free grammars in a GBNF subset (see `parse`): each rule becomes a small NFA whose
//! edges read a terminal (a byte DFA), call another rule, or move freely; the matcher keeps a
//! set of call stacks over them, as the JSON matcher does over schema frames.

mod machine;
mod matcher;
pub mod parse;

use std::collections::HashMap;
use std::sync::Arc;

use crate::dfa::ByteDfa;
use crate::error::GrammarError;
use crate::vocab::TokenVocab;
use parse::Expr;

pub use matcher::CfgMatcher;

/// Bound on the NFA nodes of a whole grammar (repetition counts multiply them).
const MAX_NODES: usize = 200_000;

#[derive(Clone, Copy, Debug)]
pub(crate) enum Edge {
    Eps(u32),
    /// Read terminal `.0`, then go to `.1`.
    Term(u32, u32),
    /// Match rule `.0`, then go to `.1`.
    Call(u32, u32),
}

/// A rule's NFA: node 0 is its start, `end` its end.
pub(crate) struct RuleNfa {
    pub edges: Vec<Vec<Edge>>,
    pub end: u32,
}

pub struct CfgGrammar {
    pub(crate) rules: Vec<RuleNfa>,
    names: Vec<String>,
    pub(crate) terms: Vec<Arc<ByteDfa>>,
    /// Per rule, whether it can match the empty string.
    pub(crate) nullable: Vec<bool>,
    pub(crate) root: u32,
    pub(crate) vocab: Arc<TokenVocab>,
}

impl CfgGrammar {
    pub fn compile(text: &str, vocab: Arc<TokenVocab>) -> Result<Arc<Self>, GrammarError> {
        let parsed = parse::parse(text)?;
        let ids: HashMap<&str, u32> = parsed
            .iter()
            .enumerate()
            .map(|(i, (n, _, _))| (n.as_str(), i as u32))
            .collect();
        let root = *ids.get("root").ok_or(GrammarError::Grammar {
            line: 1,
            reason: "no `root` rule".into(),
        })?;
        let mut b = Builder {
            ids: &ids,
            vocab: &vocab,
            terms: Vec::new(),
            term_ids: HashMap::new(),
            nodes: 0,
        };
        let mut rules = Vec::new();
        for (name, expr, line) in &parsed {
            let mut edges = vec![Vec::new(), Vec::new()];
            b.build(expr, &mut edges, 0, 1).map_err(|reason| match reason {
                BuildError::Grammar(reason) => GrammarError::Grammar {
                    line: *line,
                    reason: format!("in rule {name:?}: {reason}"),
                },
                BuildError::Other(e) => e,
            })?;
            rules.push(RuleNfa { edges, end: 1 });
        }
        let nullable = nullable(&rules);
        let g = CfgGrammar {
            rules,
            names: parsed.iter().map(|(n, _, _)| n.clone()).collect(),
            terms: b.terms,
            nullable,
            root,
            vocab,
        };
        g.refuse_left_recursion()?;
        Ok(Arc::new(g))
    }

    pub fn vocab(&self) -> &Arc<TokenVocab> {
        &self.vocab
    }

    /// The rules each rule may call before reading anything; a cycle among them would make
    /// the eager expansion of calls endless.
    fn refuse_left_recursion(&self) -> Result<(), GrammarError> {
        let n = self.rules.len();
        let mut left: Vec<Vec<u32>> = vec![Vec::new(); n];
        for (r, out) in left.iter_mut().enumerate() {
            let mut seen = vec![false; self.rules[r].edges.len()];
            let mut todo = vec![0u32];
            while let Some(node) = todo.pop() {
                if std::mem::replace(&mut seen[node as usize], true) {
                    continue;
                }
                for e in &self.rules[r].edges[node as usize] {
                    match *e {
                        Edge::Eps(m) => todo.push(m),
                        Edge::Call(c, to) => {
                            out.push(c);
                            if self.nullable[c as usize] {
                                todo.push(to);
                            }
                        }
                        Edge::Term(..) => {}
                    }
                }
            }
        }
        // Depth-first search for a cycle: 0 unvisited, 1 on the path, 2 done.
        fn visit(r: usize, left: &[Vec<u32>], mark: &mut [u8]) -> Option<usize> {
            mark[r] = 1;
            for &c in &left[r] {
                match mark[c as usize] {
                    1 => return Some(c as usize),
                    0 => {
                        if let Some(x) = visit(c as usize, left, mark) {
                            return Some(x);
                        }
                    }
                    _ => {}
                }
            }
            mark[r] = 2;
            None
        }
        let mut mark = vec![0u8; n];
        for r in 0..n {
            if mark[r] == 0 {
                if let Some(x) = visit(r, &left, &mut mark) {
                    return Err(GrammarError::Grammar {
                        line: 0,
                        reason: format!(
                            "rule {:?} is left-recursive (rewrite it with repetition)",
                            self.names[x]
                        ),
                    });
                }
            }
        }
        Ok(())
    }
}

enum BuildError {
    Grammar(String),
    Other(GrammarError),
}

struct Builder<'a> {
    ids: &'a HashMap<&'a str, u32>,
    vocab: &'a TokenVocab,
    terms: Vec<Arc<ByteDfa>>,
    term_ids: HashMap<String, u32>,
    nodes: usize,
}

impl Builder<'_> {
    fn node(&mut self, edges: &mut Vec<Vec<Edge>>) -> Result<u32, BuildError> {
        self.nodes += 1;
        if self.nodes > MAX_NODES {
            return Err(BuildError::Other(GrammarError::TooLarge {
                what: "grammar".into(),
                reason: format!("more than {MAX_NODES} NFA nodes"),
            }));
        }
        edges.push(Vec::new());
        Ok((edges.len() - 1) as u32)
    }

    /// Adds edges from `from` to `to` that read `expr`.
    fn build(&mut self, expr: &Expr, edges: &mut Vec<Vec<Edge>>, from: u32, to: u32) -> Result<(), BuildError> {
        match expr {
            Expr::Term(regex) => {
                let id = match self.term_ids.get(regex) {
                    Some(&id) => id,
                    None => {
                        let dfa = self.vocab.dfa(regex).map_err(BuildError::Other)?;
                        self.terms.push(dfa);
                        let id = (self.terms.len() - 1) as u32;
                        self.term_ids.insert(regex.clone(), id);
                        id
                    }
                };
                edges[from as usize].push(Edge::Term(id, to));
            }
            Expr::Ref(name) => {
                let &id = self
                    .ids
                    .get(name.as_str())
                    .ok_or_else(|| BuildError::Grammar(format!("undefined rule {name:?}")))?;
                edges[from as usize].push(Edge::Call(id, to));
            }
            Expr::Seq(items) => {
                let mut cur = from;
                for (i, item) in items.iter().enumerate() {
                    let next = if i + 1 == items.len() { to } else { self.node(edges)? };
                    self.build(item, edges, cur, next)?;
                    cur = next;
                }
                if items.is_empty() {
                    edges[from as usize].push(Edge::Eps(to));
                }
            }
            Expr::Alt(alts) => {
                for a in alts {
                    self.build(a, edges, from, to)?;
                }
            }
            Expr::Repeat(e, min, max) => {
                let mut cur = from;
                for _ in 0..*min {
                    let next = self.node(edges)?;
                    self.build(e, edges, cur, next)?;
                    cur = next;
                }
                match max {
                    None => {
                        let (lp, back) = (self.node(edges)?, self.node(edges)?);
                        edges[cur as usize].push(Edge::Eps(lp));
                        self.build(e, edges, lp, back)?;
                        edges[back as usize].push(Edge::Eps(lp));
                        edges[lp as usize].push(Edge::Eps(to));
                    }
                    Some(max) => {
                        for _ in *min..*max {
                            let next = self.node(edges)?;
                            edges[cur as usize].push(Edge::Eps(to));
                            self.build(e, edges, cur, next)?;
                            cur = next;
                        }
                        edges[cur as usize].push(Edge::Eps(to));
                    }
                }
            }
        }
        Ok(())
    }
}

/// Which rules match the empty string: a fixpoint over "the end is reachable by free moves
/// and calls of nullable rules".
fn nullable(rules: &[RuleNfa]) -> Vec<bool> {
    let mut null = vec![false; rules.len()];
    loop {
        let mut changed = false;
        for (r, rule) in rules.iter().enumerate() {
            if null[r] {
                continue;
            }
            let mut seen = vec![false; rule.edges.len()];
            let mut todo = vec![0u32];
            while let Some(n) = todo.pop() {
                if std::mem::replace(&mut seen[n as usize], true) {
                    continue;
                }
                for e in &rule.edges[n as usize] {
                    match *e {
                        Edge::Eps(m) => todo.push(m),
                        Edge::Call(c, to) if null[c as usize] => todo.push(to),
                        _ => {}
                    }
                }
            }
            if seen[rule.end as usize] {
                null[r] = true;
                changed = true;
            }
        }
        if !changed {
            return null;
        }
    }
}
