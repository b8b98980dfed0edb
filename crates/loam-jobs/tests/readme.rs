//! The README's Rust example ("From Rust"), run as it is printed there; and a
//! check that the README still prints what runs here, so neither can drift.

use std::error::Error;
use std::path::Path;

const BEGIN: &str = "// README: begin";
const END: &str = "// README: end";

/// Runs the README's example in `dir` (it opens `jobs.redb` in the current
/// directory) and answers how many jobs it completed.
fn readme_example(dir: &Path) -> Result<usize, Box<dyn Error>> {
    std::env::set_current_dir(dir)?;
    let mut completed = 0;
    // README: begin
    use loam_jobs::{CompleteOptions, Config, EnqueueRequest, Fence, Jobs, LeaseRequest, Outcome};
    use std::time::Duration;

    let jobs = Jobs::open("jobs.redb".as_ref(), Config::default())?;
    let data = br#"{"to":"a@b.c"}"#.to_vec();
    let email = EnqueueRequest { name: "send".into(), data, attempts: 3, ..Default::default() };
    jobs.enqueue("default", "emails", email).wait()?;

    let batch = LeaseRequest { max: 10, ..Default::default() };
    let leased = jobs.lease_wait_blocking("default", "emails", batch, Duration::from_secs(5))?;
    for lease in leased.leases {
        // ... run the job ...
        let (id, fence, ok) = (&lease.job.id, Fence::Epoch(lease.epoch), Outcome::Ok { result: None });
        jobs.complete("default", "emails", id, fence, ok, CompleteOptions::default()).wait()?;
        completed += 1;
    }
    // README: end
    Ok(completed)
}

#[test]
fn the_readme_example_runs() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(readme_example(dir.path()).unwrap(), 1);
}

#[test]
fn the_readme_prints_the_example_that_runs() {
    let here = include_str!("readme.rs");
    let start = here.find(&format!("    {BEGIN}\n")).expect("begin marker") + BEGIN.len() + 5;
    let end = here.find(&format!("    {END}\n")).expect("end marker");
    let ran: Vec<&str> = here[start..end]
        .lines()
        .filter(|line| !line.contains("completed += 1"))
        .map(|line| line.strip_prefix("    ").unwrap_or(line))
        .collect();

    let readme = include_str!("../../../README.md");
    let block = readme.split("```rust\n").nth(1).expect("the README has a rust block");
    let printed: Vec<&str> = block[..block.find("```").expect("the block ends")].lines().collect();
    assert_eq!(printed, ran, "README.md's Rust example differs from the one tests/readme.rs runs");
}
