//! Collapsing equal parser states: both stack machines (JSON, CFG) fork stacks that end up
//! behaving the same, and keep only the first of each by comparing flat encodings.

/// Reusable buffers for comparing stacks by content.
#[derive(Default)]
pub struct Scratch {
    words: Vec<u32>,
    ranges: Vec<(usize, usize)>,
    keep: Vec<u32>,
}

/// Drops every stack whose encoding (written by `encode`) equals an earlier stack's.
pub(crate) fn dedup_stacks(stacks: &mut Vec<u32>, scratch: &mut Scratch, mut encode: impl FnMut(u32, &mut Vec<u32>)) {
    if stacks.len() < 2 {
        return;
    }
    let Scratch { words, ranges, keep } = scratch;
    words.clear();
    ranges.clear();
    keep.clear();
    for &s in stacks.iter() {
        let start = words.len();
        encode(s, words);
        ranges.push((start, words.len()));
    }
    if stacks.len() <= 8 {
        for (i, &(a, b)) in ranges.iter().enumerate() {
            if !ranges[..i].iter().any(|&(c, d)| words[a..b] == words[c..d]) {
                keep.push(stacks[i]);
            }
        }
    } else {
        let mut set = rustc_hash::FxHashSet::default();
        for (i, &(a, b)) in ranges.iter().enumerate() {
            if set.insert(&words[a..b]) {
                keep.push(stacks[i]);
            }
        }
    }
    std::mem::swap(stacks, keep);
}
