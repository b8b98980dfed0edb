//! Generates loam.jobs.v1 from `proto/`. The descriptor set comes from the
//! protoc that `protoc-bin-vendored` ships, so a fresh clone builds with no
//! system protoc, no buf and no network.

use std::path::Path;
use std::process::Command;

const FILES: [&str; 3] = ["loam/jobs/v1/jobs.proto", "loam/jobs/v1/types.proto", "loam/jobs/v1/events.proto"];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read at run time: a build script compiled for one checkout may be reused for another.
    let proto = Path::new(&std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    for f in FILES {
        println!("cargo:rerun-if-changed={}", proto.join(f).display());
    }
    let out = std::env::var("OUT_DIR")?;
    let fds = Path::new(&out).join("loam_jobs_v1.fds");
    let status = Command::new(protoc_bin_vendored::protoc_bin_path()?)
        .arg("--include_imports")
        // Carries the proto comments into the generated Rust docs.
        .arg("--include_source_info")
        .arg(format!("--proto_path={}", proto.display()))
        .arg(format!("--descriptor_set_out={}", fds.display()))
        .args(FILES)
        .status()?;
    if !status.success() {
        return Err(format!("protoc failed: {status}").into());
    }
    connectrpc_build::Config::new().descriptor_set(&fds).files(&FILES).include_file("_connectrpc.rs").compile()?;
    Ok(())
}
