use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = quarry::cli::Cli::parse();
    match quarry::cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
