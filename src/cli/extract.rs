//! `quarry extract`: one document (`--document`, the record on stdout) or a batch
//! (`--input FILE.jsonl|csv`, results to `--output FILE.jsonl|csv` in input order) through the
//! service, as `POST /extract` would run it, offline.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::Args;
use serde_json::Value;

use super::progress::Progress;
use super::ModelArgs;
use crate::extract::records::{self, Format, Record, RecordResult};
use crate::extract::table::Table;
use crate::extract::{Extractor, Outcome};
use crate::service::api::{ExtractOptions, ExtractRequest, ExtractResponse};
use crate::service::schemas::SchemaRegistry;
use crate::service::{Service, ServiceError, MAX_MAX_TOKENS};

#[derive(Args)]
pub struct ExtractArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// JSON Schema file the output must validate against.
    #[arg(long)]
    schema: PathBuf,
    /// Text file to extract from; the record is printed on stdout.
    #[arg(long, required_unless_present = "input", conflicts_with = "input")]
    document: Option<PathBuf>,
    /// A batch: JSONL (one {"id"?, "document"} per line) or CSV (`.csv`, with a header row).
    #[arg(long)]
    input: Option<PathBuf>,
    /// Where batch results go: `.csv` gets schema-shaped columns, anything else JSONL
    /// [default: JSONL on stdout].
    #[arg(long, requires = "input")]
    output: Option<PathBuf>,
    /// The CSV input column holding the text.
    #[arg(long, default_value = "document", requires = "input")]
    text_column: String,
    /// For CSV output, the dotted path of one array of the schema to spread over one row per
    /// element.
    #[arg(long, requires = "output")]
    explode: Option<String>,
    /// Documents in flight at once in a batch.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Extra instructions for the model.
    #[arg(long)]
    instructions: Option<String>,
    /// Most output tokens (1 to 4096).
    #[arg(long, default_value_t = 512)]
    max_tokens: usize,
    /// Refuse a schema with keywords that cannot be enforced (default: enforce the rest and
    /// list what was left out on stderr).
    #[arg(long)]
    strict: bool,
    /// Let objects that do not mention `additionalProperties` take keys they do not declare
    /// (default: closed to their declared properties).
    #[arg(long)]
    open_objects: bool,
    /// Every free string of the record (no enum, const, format, pattern or minLength) must be a
    /// substring of the document.
    #[arg(long)]
    verbatim: bool,
    /// Context-aware decoding's weight: each token is drawn from `1 + w` times the model's
    /// logits minus `w` times its logits without the document (0 turns it off) [default: the
    /// extraction default]
    #[arg(long)]
    contrast: Option<f32>,
    /// Sample a record that fails validation again, up to this many times (at most 4).
    #[arg(long, default_value_t = 0)]
    retries: usize,
    /// Also give each field's confidence (the model's probability of it as written, 0 to 1):
    /// on stderr after the record, as `fields` in each JSONL result line, or as a
    /// `<column>__confidence` column after each CSV column.
    #[arg(long)]
    confidence: bool,
}

pub fn run(args: ExtractArgs) -> anyhow::Result<()> {
    let schema: Value = serde_json::from_str(&read(&args.schema)?)
        .map_err(|e| anyhow::anyhow!("{}: not JSON: {e}", args.schema.display()))?;
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    // Bad input and output options fail before the model loads.
    let batch = match &args.input {
        Some(input) => {
            let body = std::fs::read(input).map_err(|e| anyhow::anyhow!("{}: {e}", input.display()))?;
            let items = records::parse(&body, Format::of_path(input), Some(&args.text_column))
                .map_err(|e| anyhow::anyhow!("{}: {e}", input.display()))?;
            let table = match &args.output {
                Some(out) if Format::of_path(out) == Format::Csv => {
                    Some(Table::from_schema(&schema, args.explode.as_deref())?.with_confidence(args.confidence))
                }
                _ => None,
            };
            Some((items, table))
        }
        None => None,
    };
    anyhow::ensure!(
        (1..=MAX_MAX_TOKENS).contains(&args.max_tokens),
        "--max-tokens must be 1 to {MAX_MAX_TOKENS}"
    );
    anyhow::ensure!(
        args.contrast.is_none_or(|w| w.is_finite() && w >= 0.0),
        "--contrast must be a number >= 0"
    );
    // Every document's request: the options as `POST /extract` takes them.
    let request = ExtractRequest {
        schema: Some(schema),
        schema_id: None,
        document: String::new(),
        instructions: args.instructions.clone(),
        options: ExtractOptions {
            max_tokens: Some(args.max_tokens),
            strict: Some(args.strict),
            open_objects: Some(args.open_objects),
            verbatim: Some(args.verbatim),
            contrast: args.contrast,
            retries: Some(args.retries),
            ..Default::default()
        },
        grounding: false,
    };
    let (client, tokenizer, device) = args.model.client()?;
    let extractor = Arc::new(Extractor::new(client, tokenizer));
    let service = Arc::new(Service::new(
        args.model.model_name(),
        device,
        extractor,
        SchemaRegistry::default(),
        usize::MAX,
    ));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    // Compile once up front: a schema that cannot compile is one error, not one per item.
    let notes = runtime
        .block_on(service.compile_report(&request))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    for k in notes {
        let detail = k.detail.unwrap_or_default();
        match k.status.as_str() {
            "approximated" => eprintln!("note: `{}` at {:?} approximated: {detail}", k.keyword, k.pointer),
            "narrowed" => eprintln!("note: `{}` at {:?} narrowed: {detail}", k.keyword, k.pointer),
            "rejected" => eprintln!("note: `{}` at {:?} not enforced: {detail}", k.keyword, k.pointer),
            _ => {}
        }
    }
    let result = match (batch, &args.document) {
        (Some((items, table)), _) => {
            let sink = Sink::open(args.output.as_deref(), table)?;
            runtime.block_on(run_batch(
                &service,
                &request,
                items,
                sink,
                args.concurrency,
                args.confidence,
            ))
        }
        (None, Some(document)) => {
            let request = ExtractRequest {
                document: read(document)?,
                ..request
            };
            let x = runtime.block_on(service.extract(request));
            print_one(x, args.max_tokens, args.confidence)
        }
        (None, None) => unreachable!("clap requires --document or --input"),
    };
    service.shutdown();
    result
}

fn read(p: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))
}

/// Prints the record; any other outcome is an error that names it (`truncated`,
/// `input_too_long`, `internal`).
fn print_one(x: Result<ExtractResponse, ServiceError>, max_tokens: usize, confidence: bool) -> anyhow::Result<()> {
    let x = x.map_err(|e| anyhow::anyhow!("{e}"))?;
    let partial = x.partial.unwrap_or_default();
    match x.outcome {
        Outcome::Ok => {
            println!("{}", x.data.unwrap_or_default());
            if confidence {
                eprintln!("confidence (the model's probability of each field as written):");
                for f in &x.fields {
                    let shown = f.confidence.map_or("-".to_string(), |c| format!("{c:.3}"));
                    eprintln!("  {shown:>6}  {}", f.pointer);
                }
            }
            let u = &x.usage;
            eprintln!(
                "outcome: ok | prompt {} tokens ({} cached), output {} tokens | {:.0} ms",
                u.prompt_tokens, u.cached_tokens, u.completion_tokens, x.timings.total_ms
            );
            Ok(())
        }
        Outcome::Truncated => anyhow::bail!(
            "truncated: the output did not close within {max_tokens} tokens (raise --max-tokens); partial output: {partial}"
        ),
        Outcome::SchemaViolation => {
            let found: Vec<String> = x
                .violations
                .iter()
                .map(|v| format!("`{}` at {:?}: {}", v.keyword, v.instance_pointer, v.message))
                .collect();
            anyhow::bail!(
                "schema_violation: the record fails the schema where the grammar could not enforce it ({}): {partial}",
                found.join("; ")
            )
        }
        o => anyhow::bail!("{}: generation ended early: {partial}", o.name()),
    }
}

/// The item's result, with its fields where `confidence` asks for them.
fn record_result(x: Result<ExtractResponse, ServiceError>, confidence: bool) -> RecordResult {
    match x {
        Ok(x) => {
            let r = RecordResult::finished(
                x.outcome,
                x.data,
                x.partial.unwrap_or_default(),
                x.usage.completion_tokens,
                &x.violations,
            );
            if confidence {
                r.with_fields(x.fields)
            } else {
                r
            }
        }
        Err(e) => RecordResult::failed(e.kind.as_str(), e.message),
    }
}

/// Runs every item, `concurrency` at a time, writing results in input order as soon as all
/// earlier ones are written.
async fn run_batch(
    service: &Arc<Service>,
    request: &ExtractRequest,
    items: Vec<Record>,
    mut sink: Sink,
    concurrency: usize,
    confidence: bool,
) -> anyhow::Result<()> {
    let mut progress = Progress::new(items.len());
    let mut tasks = tokio::task::JoinSet::new();
    let mut finished: BTreeMap<usize, RecordResult> = BTreeMap::new();
    let mut next_out = 0;
    let mut pending = items.iter().enumerate();
    loop {
        while tasks.len() < concurrency {
            let Some((i, item)) = pending.next() else { break };
            let (service, request) = (
                service.clone(),
                ExtractRequest {
                    document: item.document.clone(),
                    ..request.clone()
                },
            );
            tasks.spawn(async move { (i, record_result(service.extract(request).await, confidence)) });
        }
        let Some(joined) = tasks.join_next().await else { break };
        let (i, result) = joined?;
        progress.item_done(result.ok());
        finished.insert(i, result);
        while let Some(r) = finished.remove(&next_out) {
            sink.write(&items[next_out].id, &r)?;
            next_out += 1;
        }
    }
    sink.close()?;
    progress.finish();
    Ok(())
}

enum Sink {
    Jsonl(Box<dyn Write>),
    Csv(Box<csv::Writer<Box<dyn Write>>>, Table),
}

impl Sink {
    fn open(path: Option<&Path>, table: Option<Table>) -> anyhow::Result<Sink> {
        let out: Box<dyn Write> = match path {
            Some(p) => Box::new(std::io::BufWriter::new(
                std::fs::File::create(p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?,
            )),
            None => Box::new(std::io::BufWriter::new(std::io::stdout())),
        };
        Ok(match table {
            Some(table) => {
                let mut w = csv::Writer::from_writer(out);
                w.write_record(table.header())?;
                Sink::Csv(Box::new(w), table)
            }
            None => Sink::Jsonl(out),
        })
    }

    fn write(&mut self, id: &str, r: &RecordResult) -> anyhow::Result<()> {
        match self {
            Sink::Jsonl(w) => writeln!(w, "{}", r.json_line(id))?,
            Sink::Csv(w, table) => {
                for row in table.rows(id, r) {
                    w.write_record(row)?;
                }
            }
        }
        Ok(())
    }

    fn close(self) -> anyhow::Result<()> {
        match self {
            Sink::Jsonl(mut w) => w.flush()?,
            Sink::Csv(mut w, _) => w.flush()?,
        }
        Ok(())
    }
}
