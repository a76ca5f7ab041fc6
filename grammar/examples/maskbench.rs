//! MaskBench: correctness and speed of the JSON Schema matcher on a corpus of real schemas
//! with valid and invalid instances (JSONSchemaBench's format), the same protocol as
//! scripts/peers/maskbench_peer.py so the SUMMARY lines compare directly.
//!
//!   cargo run -p quarry-grammar --release --example maskbench -- CORPUS.jsonl.gz \
//!       --tokenizer FIXTURE.json [--limit N] [--every N] [--only NAME]
//!
//! Fixtures come from scripts/grammar-fixtures. Instances are written as Python's json.dumps
//! writes them (", " and ": " separators, non-ASCII kept) and tokenized canonically; before
//! each token the mask is computed (timed) and must contain it; EOS must be allowed at the
//! end. A schema passes when it compiles and every instance behaves. Both whitespace policies
//! are run; the flexible one (which admits json.dumps' separators) prints last.
//!
//! BUDGET lines time what token budgets add: the completion cost after each accepted token
//! (the engine's check of every sampled token), and with `MASKBENCH_BUDGET=1` the mask within a
//! budget (the full walk of a request's last tokens) at every 8th step. `MASKBENCH_VERBATIM=1`
//! adds a run in which each instance's text is its document and free strings are copied from
//! it (timed only: a value with escapes is no substring of its own JSON text).

use std::io::BufRead;
use std::sync::Arc;
use std::time::Instant;

#[path = "../tests/common/mod.rs"]
mod common;

use quarry_grammar::json::{JsonGrammar, JsonMatcher, SchemaOptions, Whitespace};
use quarry_grammar::{bitmask_words, is_allowed, TokenVocab};
use serde_json::Value;

struct Args {
    corpus: String,
    tokenizer: String,
    limit: usize,
    every: usize,
    /// Only the schema with this name (to look at one pathological case).
    only: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let mut args = Args {
        corpus: String::new(),
        tokenizer: String::new(),
        limit: usize::MAX,
        every: 1,
        only: None,
    };
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match a.as_str() {
            "--tokenizer" => args.tokenizer = value("--tokenizer")?,
            "--limit" => args.limit = value("--limit")?.parse().map_err(|e| format!("--limit: {e}"))?,
            "--every" => args.every = value("--every")?.parse().map_err(|e| format!("--every: {e}"))?,
            "--only" => args.only = Some(value("--only")?),
            _ if args.corpus.is_empty() => args.corpus = a,
            other => return Err(format!("unexpected argument {other}")),
        }
    }
    if args.corpus.is_empty() || args.tokenizer.is_empty() {
        return Err(
            "usage: maskbench CORPUS.jsonl.gz --tokenizer FILE.json [--limit N] [--every N] [--only NAME]".into(),
        );
    }
    Ok(args)
}

fn load_vocab(path: &str) -> Result<(tokenizers::Tokenizer, Arc<TokenVocab>, u32), String> {
    let tok = tokenizers::Tokenizer::from_file(path).map_err(|e| format!("{path}: {e}"))?;
    let eos_name = std::fs::read_to_string(std::path::Path::new(path).with_extension("eos"))
        .map_err(|e| format!("{path} .eos sidecar: {e}"))?;
    let eos = tok
        .token_to_id(eos_name.trim())
        .ok_or("EOS token not in the vocabulary")?;
    let size = tok.get_vocab_size(true);
    let special: Vec<u32> = tok
        .get_added_tokens_decoder()
        .iter()
        .filter(|(_, t)| t.special)
        .map(|(&id, _)| id)
        .collect();
    let mut spellings: Vec<Option<String>> = vec![None; size];
    for (text, id) in tok.get_vocab(true) {
        if !special.contains(&id) {
            spellings[id as usize] = Some(text);
        }
    }
    let vocab = TokenVocab::from_byte_level(&spellings, &special, &[eos]);
    Ok((tok, vocab, eos))
}

#[derive(Default)]
struct Tally {
    schemas: usize,
    compiled: usize,
    passing: usize,
    invalid_accepted: usize,
    valid_rejected: usize,
    /// Schemas whose report says every keyword is enforced, and invalid instances accepted
    /// among them: the number that must be zero.
    fully_enforced: usize,
    enforced_invalid_accepted: usize,
    mask_us: Vec<f64>,
    /// The engine's check of each sampled token against a token budget: the completion cost
    /// after accepting it.
    cost_us: Vec<f64>,
    /// The mask within a budget (the endgame walk), at every 8th step with the budget set to
    /// the cost there (the tightest).
    within_us: Vec<f64>,
    compile_ms: Vec<f64>,
    /// The slowest single mask and the schema it came from, to find pathological cases.
    slowest: (f64, String, String),
}

/// Whether to time the mask within a budget too (`MASKBENCH_BUDGET=1`): a full walk each
/// time, so it multiplies the run's length.
fn budget_walks() -> bool {
    std::env::var_os("MASKBENCH_BUDGET").is_some()
}

fn percentile(xs: &mut [f64], q: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(f64::total_cmp);
    xs[((q * xs.len() as f64) as usize).min(xs.len() - 1)]
}

/// `verbatim`: each instance's own text is its document, and free strings must be copied
/// from it (timed, not judged: a value with an escaped quote is no substring of that text).
fn run(
    entries: &[Value],
    tok: &tokenizers::Tokenizer,
    vocab: &Arc<TokenVocab>,
    eos: u32,
    ws: Whitespace,
    verbatim: bool,
) -> Tally {
    let options = SchemaOptions {
        strict: false,
        ..Default::default()
    };
    let mut t = Tally::default();
    let mut mask = vec![0u32; bitmask_words(vocab.vocab_size())];
    for entry in entries {
        t.schemas += 1;
        let start = Instant::now();
        let Ok(grammar) = JsonGrammar::compile(&entry["schema"], &options, ws, vocab.clone()) else {
            continue;
        };
        t.compile_ms.push(start.elapsed().as_secs_f64() * 1e3);
        t.compiled += 1;
        let enforced = grammar.report().fully_enforced();
        t.fully_enforced += enforced as usize;
        let mut ok = true;
        for test in entry["tests"].as_array().into_iter().flatten() {
            let text = common::python_dumps(&test["data"]);
            let mut ids = tok
                .encode(text.as_str(), false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default();
            ids.push(eos);
            let mut m = match verbatim {
                true => JsonMatcher::new(grammar.with_document(&text, true).expect("instances are short")),
                false => JsonMatcher::new(grammar.clone()),
            };
            // As the engine does when it admits a request (its max_tokens against the minimal
            // record): the schema's value costs are worked out then, once, not per token.
            m.completion_cost();
            let mut accepted = true;
            for (step, &id) in ids.iter().enumerate() {
                if step % 8 == 4 && !verbatim && budget_walks() {
                    let budget = m.completion_cost() as usize;
                    let start = Instant::now();
                    m.fill_bitmask_within(&mut mask, budget);
                    t.within_us.push(start.elapsed().as_secs_f64() * 1e6);
                }
                let start = Instant::now();
                m.fill_bitmask(&mut mask);
                let us = start.elapsed().as_secs_f64() * 1e6;
                t.mask_us.push(us);
                if us > t.slowest.0 {
                    let before = tok.decode(&ids[..step], false).unwrap_or_default();
                    t.slowest = (us, entry["name"].as_str().unwrap_or("?").to_string(), before);
                }
                if !is_allowed(&mask, id) || m.accept(id).is_err() {
                    accepted = false;
                    break;
                }
                if !verbatim && std::env::var_os("MASKBENCH_NO_CHECK").is_none() {
                    let start = Instant::now();
                    std::hint::black_box(m.completion_cost());
                    t.cost_us.push(start.elapsed().as_secs_f64() * 1e6);
                }
            }
            match (test["valid"].as_bool() == Some(true), accepted) {
                (true, false) => {
                    t.valid_rejected += 1;
                    ok = false;
                }
                (false, true) => {
                    t.invalid_accepted += 1;
                    t.enforced_invalid_accepted += enforced as usize;
                    if enforced {
                        eprintln!("enforced schema {} accepted invalid {}", entry["name"], text);
                    }
                    ok = false;
                }
                _ => {}
            }
        }
        t.passing += ok as usize;
    }
    t
}

fn summary(name: &str, t: &mut Tally) -> String {
    let (us, schema, before) = &t.slowest;
    let tail: String = before
        .chars()
        .rev()
        .take(60)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    eprintln!("{name}: slowest mask {us:.0} us, in schema {schema}, after …{tail:?}");
    println!(
        "ENFORCED engine={name} fully_enforced={} invalid_accepted={}",
        t.fully_enforced, t.enforced_invalid_accepted
    );
    // The per-schema limits (5 s, 1 GiB): the slowest compile, and the process's peak memory,
    // which bounds any one schema's.
    let compile_max = t.compile_ms.iter().cloned().fold(0.0, f64::max);
    let peak_rss = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or("unknown".to_string(), |kib| format!("{:.0}", kib / 1024.0));
    println!("LIMITS engine={name} compile_max_ms={compile_max:.1} peak_rss_mib={peak_rss}");
    let mean_of = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len().max(1) as f64;
    let (cost_mean, within_mean) = (mean_of(&t.cost_us), mean_of(&t.within_us));
    println!(
        "BUDGET engine={name} check_mean_us={cost_mean:.2} check_p50_us={:.2} check_p99_us={:.2} within_mean_us={within_mean:.1} within_p50_us={:.1} within_p99_us={:.1}",
        percentile(&mut t.cost_us, 0.5),
        percentile(&mut t.cost_us, 0.99),
        percentile(&mut t.within_us, 0.5),
        percentile(&mut t.within_us, 0.99),
    );
    let mean = t.mask_us.iter().sum::<f64>() / t.mask_us.len().max(1) as f64;
    let max = t.mask_us.iter().cloned().fold(0.0, f64::max);
    format!(
        "SUMMARY engine={name} schemas={} compiled={} passing={} invalid_accepted={} valid_rejected={} mask_mean_us={mean:.2} mask_p50_us={:.2} mask_p99_us={:.2} mask_max_us={max:.2} compile_p50_ms={:.3} compile_p99_ms={:.3}",
        t.schemas, t.compiled, t.passing, t.invalid_accepted, t.valid_rejected,
        percentile(&mut t.mask_us, 0.5), percentile(&mut t.mask_us, 0.99),
        percentile(&mut t.compile_ms, 0.5), percentile(&mut t.compile_ms, 0.99),
    )
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let (tok, _, eos) = match load_vocab(&args.tokenizer) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let file = match std::fs::File::open(&args.corpus) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("{}: {e}", args.corpus);
            std::process::exit(2);
        }
    };
    let entries: Vec<Value> = std::io::BufReader::new(flate2::read::GzDecoder::new(file))
        .lines()
        .map_while(Result::ok)
        .enumerate()
        .filter(|(i, _)| i % args.every == 0)
        .filter_map(|(_, l)| serde_json::from_str::<Value>(&l).ok())
        .filter(|e| args.only.as_ref().is_none_or(|n| e["name"].as_str() == Some(n)))
        .take(args.limit)
        .collect();
    // Each run starts from a fresh vocabulary, so it finds no DFAs or masks the other cached.
    let fresh = || load_vocab(&args.tokenizer).expect("loaded once already").1;
    let mut compact = run(&entries, &tok, &fresh(), eos, Whitespace::Compact, false);
    println!("{}", summary("quarry-compact", &mut compact));
    if std::env::var_os("MASKBENCH_VERBATIM").is_some() {
        let mut verbatim = run(&entries, &tok, &fresh(), eos, Whitespace::Flexible { max_run: 4 }, true);
        println!("{}", summary("quarry-verbatim", &mut verbatim));
    }
    let mut flexible = run(
        &entries,
        &tok,
        &fresh(),
        eos,
        Whitespace::Flexible { max_run: 4 },
        false,
    );
    println!("{}", summary("quarry", &mut flexible));
}
