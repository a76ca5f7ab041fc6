//! `quarry bench quality`: extraction quality on cases with gold records. Each case
//! (`{id, schema, document, expected}`) goes through the same extraction path as `/extract`;
//! the table gives its outcome, whether the record validates, whether it matches the gold
//! exactly and how many of the gold's fields it got right. `--score FILE` scores another
//! engine's answers (`{id, text}` lines) the same way, so scripts/bench-quality can print a
//! peer beside us; `--save-prompts` writes the prompts it would send, for that peer.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use serde_json::{json, Value};

use super::calibration::{auroc, auroc_interval, ece, reliability, Scored};
use super::score::{same, score, FieldScore};
use crate::cli::ModelArgs;
use crate::engine::EngineClient;
use crate::extract::confidence::Candidates;
use crate::extract::validate::{violations, Validators};
use crate::extract::{Extractor, PromptLayout, Task, PRETTY};
use crate::sampling::DryParams;
use quarry_grammar::json::Whitespace;

#[derive(Args)]
pub struct QualityArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// JSONL of cases: {"id", "schema", "document", "expected"} per line.
    #[arg(long)]
    cases: PathBuf,
    #[arg(long, default_value_t = 512)]
    max_tokens: usize,
    /// Score the answers in this JSONL file ({"id", "text"} per line, another engine's)
    /// instead of running the model.
    #[arg(long)]
    score: Option<PathBuf>,
    /// The name the table gives the engine whose answers are scored.
    #[arg(long, default_value = "quarry")]
    engine: String,
    /// Write each case's prompt (token ids), schema and token budget as JSON lines.
    #[arg(long)]
    save_prompts: Option<PathBuf>,
    /// Print each case's answer under its row.
    #[arg(long)]
    show: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// With --show (or in --json's rows), also give every sampled token with its
    /// log-probability and this many alternatives (the model's own, before mask and biases):
    /// where a wrong value was a near-tie and where the model was sure.
    #[arg(long)]
    logprobs: Option<usize>,
    /// Where the schema and the document sit in the prompt.
    #[arg(long, value_enum)]
    layout: Option<PromptLayout>,
    /// Write declared properties in schema order (true) or in any order (false).
    #[arg(long)]
    ordered: Option<bool>,
    /// Whitespace inside the JSON: compact (none) or pretty (runs of up to 8).
    #[arg(long)]
    pretty: Option<bool>,
    /// Copy free strings from the document (each a substring of it).
    #[arg(long)]
    verbatim: Option<bool>,
    /// Logit bonus for tokens that continue a run copied from the document.
    #[arg(long)]
    copy_bias: Option<f32>,
    /// Context-aware decoding's weight (0 turns it off).
    #[arg(long)]
    contrast: Option<f32>,
    /// DRY multiplier (0 turns DRY off).
    #[arg(long)]
    dry_multiplier: Option<f32>,
    #[arg(long)]
    dry_base: Option<f32>,
    #[arg(long)]
    dry_allowed_length: Option<usize>,
    /// DRY sequence breakers, comma-separated (`,` itself as `comma`).
    #[arg(long)]
    dry_breakers: Option<String>,
}

struct Case {
    id: String,
    schema: Value,
    document: String,
    expected: Value,
}

/// How one answer did.
struct Row {
    id: String,
    outcome: String,
    valid: bool,
    fields: FieldScore,
    tokens: usize,
    ms: f64,
    text: String,
    /// One line per sampled token, when --logprobs asked for them.
    trace: Vec<String>,
    /// Each scored leaf of the answer: its pointer, confidence candidates and whether it is
    /// right.
    confidence: Vec<(String, Candidates, bool)>,
}

pub fn run(args: QualityArgs) -> anyhow::Result<()> {
    let cases = load_cases(&args.cases)?;
    let rows = match &args.score {
        Some(answers) => score_answers(&cases, answers)?,
        None => run_cases(&args, &cases)?,
    };
    report(&args, &rows);
    Ok(())
}

fn load_cases(path: &Path) -> anyhow::Result<Vec<Case>> {
    let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let mut cases = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).map_err(|e| anyhow::anyhow!("{}:{}: {e}", path.display(), i + 1))?;
        let field = |k: &str| {
            v.get(k)
                .cloned()
                .ok_or_else(|| anyhow::anyhow!("{}:{}: no `{k}`", path.display(), i + 1))
        };
        cases.push(Case {
            id: field("id")?.as_str().unwrap_or_default().to_string(),
            schema: field("schema")?,
            document: field("document")?
                .as_str()
                .ok_or_else(|| anyhow::anyhow!("{}:{}: `document` is not a string", path.display(), i + 1))?
                .to_string(),
            expected: field("expected")?,
        });
    }
    anyhow::ensure!(!cases.is_empty(), "{}: no cases", path.display());
    Ok(cases)
}

fn run_cases(args: &QualityArgs, cases: &[Case]) -> anyhow::Result<Vec<Row>> {
    let (engine, tokenizer) = args.model.engine()?;
    let extractor = Arc::new(Extractor::new(EngineClient::start(engine), tokenizer.clone()));
    let tasks: Vec<Task> = cases
        .iter()
        .map(|c| {
            let base = Task::new(c.schema.clone(), c.document.clone());
            Task {
                max_tokens: args.max_tokens,
                layout: args.layout.unwrap_or(base.layout),
                ordered_properties: args.ordered.unwrap_or(base.ordered_properties),
                whitespace: match args.pretty {
                    Some(true) => PRETTY,
                    Some(false) => Whitespace::Compact,
                    None => base.whitespace,
                },
                dry: dry(args, base.dry.clone()),
                verbatim: args.verbatim.unwrap_or(base.verbatim),
                copy_bias: args.copy_bias.unwrap_or(base.copy_bias),
                contrast: args.contrast.unwrap_or(base.contrast),
                logprobs: args.logprobs,
                ..base
            }
        })
        .collect();
    if let Some(path) = &args.save_prompts {
        let mut lines = Vec::new();
        for (c, t) in cases.iter().zip(&tasks) {
            let prompt =
                crate::extract::prompt(&tokenizer, t.layout, &t.schema, &t.document, t.instructions.as_deref())?;
            lines.push(
                json!({"id": c.id, "prompt": prompt, "schema": c.schema, "max_tokens": t.max_tokens}).to_string(),
            );
        }
        std::fs::write(path, lines.join("\n") + "\n").map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let started = Instant::now();
    let results = runtime.block_on(async {
        let mut set = tokio::task::JoinSet::new();
        for (i, t) in tasks.into_iter().enumerate() {
            let x = extractor.clone();
            set.spawn(async move { (i, x.run(t).await) });
        }
        let mut out: Vec<_> = set.join_all().await;
        out.sort_by_key(|(i, _)| *i);
        out
    });
    extractor.client.shutdown();
    eprintln!("{} cases in {:.1} s", cases.len(), started.elapsed().as_secs_f64());
    let validators = Validators::default();
    let mut rows = Vec::new();
    for ((_, result), case) in results.into_iter().zip(cases) {
        rows.push(match result {
            Ok(x) => {
                let valid = x.data.as_ref().is_some_and(|d| is_valid(&validators, &case.schema, d));
                Row {
                    id: case.id.clone(),
                    outcome: x.outcome.name().into(),
                    valid,
                    fields: score(&case.expected, x.data.as_ref()),
                    tokens: x.completion_tokens,
                    ms: x.metrics.e2e.as_secs_f64() * 1e3,
                    trace: trace(&tokenizer, &x.sampled),
                    confidence: judged(&case.expected, &x),
                    text: x.text,
                }
            }
            Err(e) => Row {
                id: case.id.clone(),
                outcome: e.kind().as_str().into(),
                valid: false,
                fields: score(&case.expected, None),
                tokens: 0,
                ms: 0.0,
                text: e.to_string(),
                trace: Vec::new(),
                confidence: Vec::new(),
            },
        });
    }
    Ok(rows)
}

/// Each leaf of an answer with a confidence, and whether it is right: the gold has a leaf at
/// its pointer equal to it as `score` counts equal. Leaves the gold lacks (invented keys, extra
/// items) are wrong; gold fields the answer lacks have no confidence to judge.
fn judged(expected: &Value, x: &crate::extract::Extraction) -> Vec<(String, Candidates, bool)> {
    let Some(record) = x.data.clone().or_else(|| serde_json::from_str(&x.text).ok()) else {
        return Vec::new();
    };
    let is_leaf = |v: &Value| match v {
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        _ => true,
    };
    x.fields
        .iter()
        .filter_map(|f| {
            let got = record.pointer(&f.pointer)?;
            let right = expected.pointer(&f.pointer).is_some_and(|e| is_leaf(e) && same(e, got));
            Some((f.pointer.clone(), f.candidates?, right))
        })
        .collect()
}

/// A confidence candidate: its name and how it reads the candidates.
type Candidate = (&'static str, fn(&Candidates) -> f64);

/// The candidates by name.
const CANDIDATES: [Candidate; 6] = [
    ("product", |c| c.product),
    ("geometric mean", |c| c.geometric),
    ("minimum", |c| c.min),
    ("first token", |c| c.first),
    ("product, existence", |c| c.product_existence),
    ("minimum, existence", |c| c.min_existence),
];

/// Per candidate: AUROC with its bootstrap interval over documents, ECE, the reliability table.
fn confidence_report(rows: &[Row]) -> Value {
    let mut out = Vec::new();
    for (name, get) in CANDIDATES {
        let documents: Vec<Vec<Scored>> = rows
            .iter()
            .map(|r| r.confidence.iter().map(|(_, c, right)| (get(c), *right)).collect())
            .collect();
        let all: Vec<Scored> = documents.concat();
        let interval = auroc_interval(&documents, 2000);
        out.push(json!({
            "candidate": name, "fields": all.len(), "right": all.iter().filter(|f| f.1).count(),
            "auroc": auroc(&all), "auroc_95": interval.map(|(a, b)| [a, b]), "ece": ece(&all),
            "reliability": reliability(&all),
        }));
    }
    Value::Array(out)
}

fn print_confidence(report: &Value) {
    let Some(first) = report.get(0) else { return };
    println!(
        "\nconfidence of {} answer fields ({} right): AUROC right against wrong (95% interval, {} bootstraps over documents), calibration error over 10 bins",
        first["fields"], first["right"], 2000
    );
    println!("{:<22}{:>8}{:>18}{:>8}", "candidate", "AUROC", "interval", "ECE");
    let f = |v: &Value| v.as_f64().map_or("-".to_string(), |x| format!("{x:.3}"));
    for c in report.as_array().into_iter().flatten() {
        let interval = match c["auroc_95"].as_array() {
            Some(a) => format!("[{}, {}]", f(&a[0]), f(&a[1])),
            None => "-".into(),
        };
        println!(
            "{:<22}{:>8}{:>18}{:>8}",
            c["candidate"].as_str().unwrap_or(""),
            f(&c["auroc"]),
            interval,
            f(&c["ece"])
        );
    }
    println!("reliability (fields / mean confidence / accuracy per bin of 0.1):");
    for c in report.as_array().into_iter().flatten() {
        let bins: Vec<String> = c["reliability"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|b| {
                format!(
                    "{} {:.2}/{:.2}",
                    b["fields"],
                    b["mean_confidence"].as_f64().unwrap_or(0.0),
                    b["accuracy"].as_f64().unwrap_or(0.0)
                )
            })
            .collect();
        println!("  {:<20}{}", c["candidate"].as_str().unwrap_or(""), bins.join(" | "));
    }
}

/// The DRY settings the flags ask for, over the extraction default.
fn dry(args: &QualityArgs, default: Option<DryParams>) -> Option<DryParams> {
    let mut d = default.unwrap_or(DryParams {
        multiplier: 0.0,
        ..Default::default()
    });
    d.multiplier = args.dry_multiplier.unwrap_or(d.multiplier);
    d.base = args.dry_base.unwrap_or(d.base);
    d.allowed_length = args.dry_allowed_length.unwrap_or(d.allowed_length);
    if let Some(b) = &args.dry_breakers {
        d.breakers = b
            .split(',')
            .filter(|s| !s.is_empty())
            .map(|s| if s == "comma" { ",".into() } else { s.to_string() })
            .collect();
    }
    (d.multiplier > 0.0).then_some(d)
}

fn is_valid(validators: &Validators, schema: &Value, record: &Value) -> bool {
    validators.get(schema).is_ok_and(|v| violations(&v, record).is_empty())
}

/// Another engine's answers, scored as ours are: an answer that is no JSON object is
/// `invalid_json`, one that does not validate `schema_violation`.
fn score_answers(cases: &[Case], path: &Path) -> anyhow::Result<Vec<Row>> {
    let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let mut answers = std::collections::HashMap::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        answers.insert(v["id"].as_str().unwrap_or_default().to_string(), v);
    }
    let validators = Validators::default();
    Ok(cases
        .iter()
        .map(|c| {
            let answer = answers.get(&c.id);
            let text = answer.and_then(|a| a["text"].as_str()).unwrap_or_default().to_string();
            let record = serde_json::from_str::<Value>(&text).ok();
            let valid = record.as_ref().is_some_and(|r| is_valid(&validators, &c.schema, r));
            let outcome = match (answer, &record) {
                (None, _) => "missing",
                (Some(a), _) if a["finish_reason"] == "length" => "truncated",
                (_, None) => "invalid_json",
                (_, Some(_)) if !valid => "schema_violation",
                _ => "ok",
            };
            // A record that fails its schema is no record, for the peer as for us.
            let data = record.filter(|_| valid);
            Row {
                id: c.id.clone(),
                outcome: outcome.into(),
                valid,
                fields: score(&c.expected, data.as_ref()),
                tokens: answer.and_then(|a| a["tokens"].as_u64()).unwrap_or(0) as usize,
                ms: answer.and_then(|a| a["ms"].as_f64()).unwrap_or(0.0),
                text,
                trace: Vec::new(),
                confidence: Vec::new(),
            }
        })
        .collect())
}

fn report(args: &QualityArgs, rows: &[Row]) {
    let mut total = FieldScore::default();
    for r in rows {
        total.add(r.fields);
    }
    let count = |f: &dyn Fn(&Row) -> bool| rows.iter().filter(|r| f(r)).count();
    let ok = count(&|r| r.outcome == "ok");
    let valid = count(&|r| r.valid);
    let exact = count(&|r| r.valid && r.fields.exact());
    let macro_acc = rows.iter().map(|r| r.fields.accuracy()).sum::<f64>() / rows.len() as f64;
    if args.json {
        let cases: Vec<Value> = rows
            .iter()
            .map(|r| {
                let mut row = json!({"id": r.id, "outcome": r.outcome, "valid": r.valid,
                       "exact": r.valid && r.fields.exact(), "fields_correct": r.fields.correct,
                       "fields": r.fields.total, "tokens": r.tokens, "ms": r.ms, "text": r.text});
                // With --logprobs: where two runs' records part, and by what margin.
                if !r.trace.is_empty() {
                    row["trace"] = json!(r.trace);
                }
                row
            })
            .collect();
        let summary = json!({
            "engine": args.engine, "cases": rows.len(), "ok": ok, "valid": valid, "exact": exact,
            "fields_correct": total.correct, "fields": total.total, "field_accuracy": total.accuracy(),
            "case_accuracy_mean": macro_acc, "rows": cases, "confidence": confidence_report(rows),
        });
        println!("{summary}");
        return;
    }
    println!(
        "{:<34}{:>18}{:>7}{:>7}{:>9}{:>8}{:>9}",
        "case", "outcome", "valid", "exact", "fields", "tokens", "ms"
    );
    for r in rows {
        println!(
            "{:<34}{:>18}{:>7}{:>7}{:>9}{:>8}{:>9.0}",
            r.id,
            r.outcome,
            if r.valid { "yes" } else { "no" },
            if r.valid && r.fields.exact() { "yes" } else { "no" },
            format!("{}/{}", r.fields.correct, r.fields.total),
            r.tokens,
            r.ms
        );
        if args.show {
            println!("    {}", r.text);
            for (pointer, c, right) in &r.confidence {
                println!(
                    "      {pointer:<40} {} product {:.3} geometric {:.3} min {:.3} first {:.3} with existence {:.3} {:.3}",
                    if *right { "right" } else { "wrong" },
                    c.product,
                    c.geometric,
                    c.min,
                    c.first,
                    c.product_existence,
                    c.min_existence
                );
            }
            for line in &r.trace {
                println!("      {line}");
            }
        }
    }
    println!(
        "{}: {} cases, {} ok, {} valid, {} exact; fields {}/{} = {:.1}% (mean per case {:.1}%)",
        args.engine,
        rows.len(),
        ok,
        valid,
        exact,
        total.correct,
        total.total,
        100.0 * total.accuracy(),
        100.0 * macro_acc
    );
    if rows.iter().any(|r| !r.confidence.is_empty()) {
        print_confidence(&confidence_report(rows));
    }
}

/// `"tok" -0.12 | "alt" -1.50 "alt2" -2.31`, one line per token; forced tokens are marked.
fn trace(tokenizer: &crate::tokenizer::Tokenizer, sampled: &[crate::sampling::SampledToken]) -> Vec<String> {
    let text = |id: u32| format!("{:?}", tokenizer.decode(&[id], false).unwrap_or_default());
    sampled
        .iter()
        .filter(|s| s.logprob.is_some())
        .map(|s| {
            if s.forced {
                return format!("{} forced", text(s.token));
            }
            let alts: Vec<String> = s
                .top
                .iter()
                .map(|t| format!("{} {:.2}", text(t.token), t.logprob))
                .collect();
            format!("{} {:.2} | {}", text(s.token), s.logprob.unwrap_or(0.0), alts.join(" "))
        })
        .collect()
}
