use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    quarry::runtime::cpu::prefer_parking();
    let cli = quarry::cli::Cli::parse();
    match quarry::cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
