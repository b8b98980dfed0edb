//! The Node binding of the Loam Jobs core: BullMQ 6.7's `IQueueBackend`
//! operations over an embedded redb store, for the `@loam/bullmq` package.
//!
//! [`backend::LoamQueue`] is the class JavaScript drives (one per BullMQ
//! backend); [`store`] shares one open core per data dir per process;
//! [`convert`] maps BullMQ's JSON shapes to the core's types and back;
//! [`error`] maps the core's errors to BullMQ's codes and texts; [`promise`]
//! settles the promises of writes from the core's threads.

pub mod backend;
pub mod convert;
pub mod error;
pub mod promise;
pub mod store;

// The addon's own allocations (Node keeps its allocator): see the workspace
// Cargo.toml for why.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[cfg(test)]
mod tests {
    /// A panic that unwinds out of a synchronous `#[napi]` method crosses
    /// napi's `extern "C"` frame, where Rust aborts the process: each one needs
    /// `catch_unwind`, which napi-rs turns into a thrown error. (napi-rs catches
    /// async methods' panics itself, and the core's closures are caught where
    /// they run.) `panicInCallForTest` shows the attribute working, in
    /// `test/errors.test.ts`; this shows no synchronous method lacks it.
    #[test]
    fn every_synchronous_method_catches_panics() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut synchronous = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let source = std::fs::read_to_string(&path).unwrap();
            let lines: Vec<&str> = source.lines().map(str::trim).collect();
            for (at, line) in lines.iter().enumerate() {
                if !line.starts_with("#[napi") {
                    continue;
                }
                // The attribute, which may span lines, and the item it is on,
                // past other attributes.
                let close = lines[at..].iter().position(|l| l.ends_with(']')).map_or(at, |end| at + end);
                let attribute = lines[at..=close].join(" ");
                let Some(item) = lines[close + 1..].iter().find(|l| l.starts_with("pub ") || l.starts_with("impl "))
                else {
                    continue;
                };
                if item.starts_with("pub fn ") || item.starts_with("pub unsafe fn ") {
                    synchronous += 1;
                    let file = path.file_name().unwrap().to_string_lossy();
                    assert!(attribute.contains("catch_unwind"), "{file}:{}: {item} lacks `catch_unwind`", at + 1);
                }
            }
        }
        assert!(synchronous >= 40, "found {synchronous} synchronous methods; has the crate's layout changed?");
    }
}
