//! A cache bounded in bytes that forgets the least recently used entries in bulk: entries live
//! in a current and a previous generation; a hit in the previous one moves the entry forward,
//! and when the current generation is full the previous one is dropped. Hot entries therefore
//! survive every turnover, so a long run never pays for recomputing everything at once.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::Hash;

pub struct GenerationalCache<K, V> {
    current: HashMap<K, (V, usize)>,
    previous: HashMap<K, (V, usize)>,
    current_bytes: usize,
    /// Bytes one generation may hold: the cache holds at most twice this.
    generation_bytes: usize,
}

impl<K: Hash + Eq, V: Clone> GenerationalCache<K, V> {
    pub fn new(max_bytes: usize) -> Self {
        GenerationalCache {
            current: HashMap::new(),
            previous: HashMap::new(),
            current_bytes: 0,
            generation_bytes: max_bytes / 2,
        }
    }

    pub fn get<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if let Some((v, _)) = self.current.get(key) {
            return Some(v.clone());
        }
        let (k, (v, bytes)) = self.previous.remove_entry(key)?;
        self.insert(k, v.clone(), bytes);
        Some(v)
    }

    /// Adds an entry of `bytes` (an entry already present keeps its value, which is returned).
    pub fn insert(&mut self, key: K, value: V, bytes: usize) -> V {
        if let Some((v, _)) = self.current.get(&key) {
            return v.clone();
        }
        if self.current_bytes + bytes > self.generation_bytes && !self.current.is_empty() {
            self.previous = std::mem::take(&mut self.current);
            self.current_bytes = 0;
        }
        self.current_bytes += bytes;
        self.current.insert(key, (value.clone(), bytes));
        value
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hot_entries_survive_turnover_and_memory_stays_bounded() {
        let mut c: GenerationalCache<u32, u32> = GenerationalCache::new(40);
        for k in 0..1000 {
            c.insert(k, k * 2, 1);
            // Key 7 is used all the time: it must never be lost.
            assert_eq!(c.get(&7), (k >= 7).then_some(14));
            assert!(c.len() <= 41, "{} entries", c.len());
        }
        assert_eq!(c.get(&998), Some(1996));
        assert_eq!(c.get(&3), None, "a cold entry is forgotten");
    }
}
