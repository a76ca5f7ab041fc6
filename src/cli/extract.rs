use std::path::PathBuf;

use clap::Args;
use quarry_grammar::json::{KeywordStatus, Whitespace};

use super::ModelArgs;
use crate::engine::{Constraint, EngineRequest, FinishReason, StructuredOutputs};
use crate::sampling::SamplingParams;

#[derive(Args)]
pub struct ExtractArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// JSON Schema file the output must validate against.
    #[arg(long)]
    schema: PathBuf,
    /// Text file to extract from.
    #[arg(long)]
    document: PathBuf,
    /// Extra instructions for the model.
    #[arg(long)]
    instructions: Option<String>,
    #[arg(long, default_value_t = 512)]
    max_tokens: usize,
    /// Refuse a schema with keywords that cannot be enforced (default: enforce the rest and
    /// list what was left out on stderr).
    #[arg(long)]
    strict: bool,
}

/// Prints one JSON object that validates against the schema; any other outcome is an error
/// that names it (`truncated`, `schema_rejected`, `input_too_long`, `internal`).
pub fn run(args: ExtractArgs) -> anyhow::Result<()> {
    let read = |p: &PathBuf| std::fs::read_to_string(p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()));
    let schema: serde_json::Value = serde_json::from_str(&read(&args.schema)?)
        .map_err(|e| anyhow::anyhow!("{}: not JSON: {e}", args.schema.display()))?;
    let document = read(&args.document)?;
    let (mut engine, tokenizer) = args.model.engine()?;
    let structured = StructuredOutputs::new(&tokenizer);
    let constraint = structured
        .compile(&Constraint::Json {
            schema: schema.clone(),
            whitespace: Whitespace::Compact,
            strict: args.strict,
        })
        .map_err(|e| anyhow::anyhow!("schema_rejected: {e}"))?;
    if let Some(report) = constraint.report() {
        for k in &report.keywords {
            match &k.status {
                KeywordStatus::Approximated(how) => {
                    eprintln!("note: `{}` at {:?} approximated: {how}", k.keyword, k.pointer)
                }
                KeywordStatus::Rejected(why) => {
                    eprintln!("note: `{}` at {:?} not enforced: {why}", k.keyword, k.pointer)
                }
                _ => {}
            }
        }
    }
    let prompt = crate::extract::prompt(&tokenizer, &schema, &document, args.instructions.as_deref())?;
    engine
        .add_request(EngineRequest {
            id: 0,
            prompt,
            params: SamplingParams::greedy(args.max_tokens),
            priority: 0,
            constraint: Some(constraint),
        })
        .map_err(|e| anyhow::anyhow!("input_too_long: {e}"))?;
    let c = engine.run_until_idle(|_| {})?.remove(0);
    match c.finish {
        FinishReason::Stop => {
            let value: serde_json::Value = serde_json::from_str(&c.text)
                .map_err(|e| anyhow::anyhow!("internal: the constrained output is not JSON ({e}): {}", c.text))?;
            println!("{value}");
            let m = &c.metrics;
            eprintln!(
                "outcome: ok | prompt {} tokens, output {} tokens | {:.0} ms",
                m.prompt_tokens,
                c.tokens.len(),
                m.e2e.as_secs_f64() * 1e3
            );
            Ok(())
        }
        FinishReason::Length => anyhow::bail!(
            "truncated: the output did not close within {} tokens (raise --max-tokens); partial output: {}",
            args.max_tokens,
            c.text
        ),
        FinishReason::Aborted | FinishReason::Internal => anyhow::bail!("internal: generation ended early: {}", c.text),
    }
}
