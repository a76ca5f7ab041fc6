//! What the binary logs, through `tracing` on stderr: as text, each line the message alone
//! (`quarry: listening on ...`, the lines scripts read), prefixed with the request's id where a
//! request is being served; or as JSON, one object a line with its time, level, fields and the
//! request's span (`{"span": {"id": ..., "method": ..., "path": ...}}`), for log collectors.
//! User-facing output of the command line (progress, records, notes) stays plain stderr.

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Sends `tracing` events at INFO and above to stderr in `format`; once per process (later
/// calls, as in tests, change nothing).
pub fn init(format: LogFormat) {
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false);
    let _ = match format {
        LogFormat::Text => builder.without_time().with_level(false).with_target(false).try_init(),
        LogFormat::Json => builder.json().with_current_span(true).with_span_list(false).try_init(),
    };
}
