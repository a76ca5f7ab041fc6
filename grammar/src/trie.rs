//! The vocabulary as a byte trie, stored in depth-first pre-order: a walk is a forward scan in
//! which a rejected byte skips its whole subtree by jumping to `subtree_end`. Every token that
//! shares a prefix shares the work of checking it.

use crate::vocab::TokenId;

#[derive(Clone, Copy, Debug)]
struct Node {
    byte: u8,
    depth: u16,
    /// Index one past this node's subtree.
    subtree_end: u32,
    /// Tokens whose bytes end here: `tokens[token_start..token_start + token_count]`.
    token_start: u32,
    token_count: u32,
}

pub struct TokTrie {
    nodes: Vec<Node>,
    tokens: Vec<TokenId>,
    max_depth: usize,
}

/// What a trie walk is told at each node: whether to descend into it.
pub trait TrieVisitor {
    /// Called with the node's depth (1 for a token's first byte) and byte. Returning false
    /// skips every token below.
    fn enter(&mut self, depth: usize, byte: u8) -> bool;
    /// Tokens that end at the node just entered.
    fn tokens(&mut self, tokens: &[TokenId]);
}

impl TokTrie {
    /// Builds the trie of every non-special, non-empty token.
    pub fn build(bytes: &[Vec<u8>], special: &[bool]) -> Self {
        Self::build_filtered(bytes, special, |_| true)
    }

    /// The trie of the non-special, non-empty tokens whose bytes satisfy `keep`.
    pub fn build_filtered(bytes: &[Vec<u8>], special: &[bool], keep: impl Fn(&[u8]) -> bool) -> Self {
        let mut ids: Vec<TokenId> = (0..bytes.len() as TokenId)
            .filter(|&i| !special[i as usize] && !bytes[i as usize].is_empty() && keep(&bytes[i as usize]))
            .collect();
        ids.sort_by(|&a, &b| bytes[a as usize].cmp(&bytes[b as usize]).then(a.cmp(&b)));
        let mut trie = TokTrie {
            nodes: vec![Node {
                byte: 0,
                depth: 0,
                subtree_end: 0,
                token_start: 0,
                token_count: 0,
            }],
            tokens: Vec::with_capacity(ids.len()),
            max_depth: 0,
        };
        // Sorted tokens enter the trie in pre-order; `path[d]` is the open node at depth d.
        let mut path: Vec<usize> = vec![0];
        let mut prev: &[u8] = &[];
        for &id in &ids {
            let word = bytes[id as usize].as_slice();
            let common = prev.iter().zip(word).take_while(|(a, b)| a == b).count();
            for closed in path.drain(common + 1..).rev() {
                trie.nodes[closed].subtree_end = trie.nodes.len() as u32;
            }
            for (d, &b) in word.iter().enumerate().skip(common) {
                path.push(trie.nodes.len());
                trie.nodes.push(Node {
                    byte: b,
                    depth: (d + 1) as u16,
                    subtree_end: 0,
                    token_start: 0,
                    token_count: 0,
                });
            }
            let leaf = *path.last().expect("root is always open");
            if trie.nodes[leaf].token_count == 0 {
                trie.nodes[leaf].token_start = trie.tokens.len() as u32;
            }
            trie.nodes[leaf].token_count += 1;
            trie.tokens.push(id);
            trie.max_depth = trie.max_depth.max(word.len());
            prev = word;
        }
        let end = trie.nodes.len() as u32;
        for &open in &path {
            trie.nodes[open].subtree_end = end;
        }
        trie
    }

    pub fn max_depth(&self) -> usize {
        self.max_depth
    }

    /// Visits the trie in pre-order, skipping the subtrees the visitor refuses.
    pub fn walk(&self, visitor: &mut impl TrieVisitor) {
        let mut i = 1;
        while i < self.nodes.len() {
            let n = self.nodes[i];
            if visitor.enter(n.depth as usize, n.byte) {
                if n.token_count > 0 {
                    let s = n.token_start as usize;
                    visitor.tokens(&self.tokens[s..s + n.token_count as usize]);
                }
                i += 1;
            } else {
                i = n.subtree_end as usize;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Collect<'a> {
        allowed: &'a dyn Fn(&[u8]) -> bool,
        path: Vec<u8>,
        out: Vec<TokenId>,
    }

    impl TrieVisitor for Collect<'_> {
        fn enter(&mut self, depth: usize, byte: u8) -> bool {
            self.path.truncate(depth - 1);
            self.path.push(byte);
            (self.allowed)(&self.path)
        }
        fn tokens(&mut self, tokens: &[TokenId]) {
            self.out.extend_from_slice(tokens);
        }
    }

    #[test]
    fn walk_finds_exactly_the_tokens_whose_every_prefix_is_allowed() {
        let words: Vec<Vec<u8>> = ["a", "ab", "abc", "b", "ba", "", "abd", "ab", "c", "<s>"]
            .iter()
            .map(|s| s.as_bytes().to_vec())
            .collect();
        let mut special = vec![false; words.len()];
        special[9] = true;
        let trie = TokTrie::build(&words, &special);
        assert_eq!(trie.max_depth(), 3);
        let run = |allowed: &dyn Fn(&[u8]) -> bool| {
            let mut c = Collect {
                allowed,
                path: Vec::new(),
                out: Vec::new(),
            };
            trie.walk(&mut c);
            c.out.sort();
            c.out
        };
        assert_eq!(
            run(&|_| true),
            vec![0, 1, 2, 3, 4, 6, 7, 8],
            "empty and special tokens are never offered"
        );
        assert_eq!(run(&|p| p[0] == b'a'), vec![0, 1, 2, 6, 7]);
        assert_eq!(
            run(&|p| p != b"ab"),
            vec![0, 3, 4, 8],
            "refusing `ab` drops its whole subtree"
        );
        assert_eq!(run(&|p| p.len() == 1 && p != b"a"), vec![3, 8]);
    }
}
