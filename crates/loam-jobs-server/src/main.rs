//! `loam-jobs`: see `loam-jobs --help` and `loam-jobs serve --help`.

use std::process::ExitCode;

use clap::Parser;
use loam_jobs_server::cli::{Cli, Command, LogFormat};
use tracing_subscriber::EnvFilter;

// The allocator of the binary: see the workspace Cargo.toml for why.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let Command::Serve(args) = cli.command;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match args.log_format {
        LogFormat::Json => logs.json().init(),
        LogFormat::Text => logs.init(),
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the runtime");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(loam_jobs_server::serve(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "loam-jobs stopped");
            eprintln!("loam-jobs: {e}");
            ExitCode::from(2)
        }
    }
}
