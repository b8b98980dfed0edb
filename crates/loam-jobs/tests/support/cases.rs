//! How many cases the property tests run, and where their failures go.

use proptest::test_runner::Config;

/// 64 cases, or `PROPTEST_CASES`; no regression files, so that a test run
/// writes nothing into the source tree.
pub fn config() -> Config {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64);
    Config { cases, failure_persistence: None, ..Config::default() }
}
