//! Helpers shared by the grammar's integration tests.
#![allow(dead_code)]

use std::io::BufRead;

/// A small deterministic generator for random walks (xorshift).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// The MaskBench corpus beside the checkout, one JSON entry per line; `None` (with a message)
/// where it is absent, as it is for users outside this project.
pub fn corpus() -> Option<impl Iterator<Item = serde_json::Value>> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/maskbench-dev.jsonl.gz");
    let Ok(file) = std::fs::File::open(&path) else {
        eprintln!(
            "skipping: {} not found (the corpus lives in ../shared beside the checkout)",
            path.display()
        );
        return None;
    };
    Some(
        std::io::BufReader::new(flate2::read::GzDecoder::new(file))
            .lines()
            .map(|l| serde_json::from_str(&l.expect("corpus line")).expect("corpus entry")),
    )
}

/// An instance written as Python's `json.dumps` writes it (", " and ": " separators,
/// non-ASCII kept), as MaskBench serializes its test instances.
pub fn python_dumps(v: &serde_json::Value) -> String {
    use serde_json::Value;
    match v {
        Value::Array(a) => format!("[{}]", a.iter().map(python_dumps).collect::<Vec<_>>().join(", ")),
        Value::Object(o) => format!(
            "{{{}}}",
            o.iter()
                .map(|(k, v)| format!("{}: {}", Value::String(k.clone()), python_dumps(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        other => other.to_string(),
    }
}
