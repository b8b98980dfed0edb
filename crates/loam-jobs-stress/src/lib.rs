//! What the writer (`src/main.rs`) and the crash test (`tests/crash.rs`)
//! must agree on.

/// The result the writer completes job `id` with: its id, and for one job in
/// ten 3 KB more, so that its `completed` event keeps its fields out of its
/// event page (the crash test reads both kinds back).
pub fn result_of(id: &str) -> Vec<u8> {
    let mut result = id.as_bytes().to_vec();
    if id.ends_with('0') {
        result.resize(result.len() + 3072, b'r');
    }
    result
}

/// The data the writer adds job `id` with: its id, and for one job in five
/// enough more to be kept apart from its record
/// ([`loam_jobs::DATA_APART_BYTES`]), so that the crash test reads both
/// kinds back.
pub fn data_of(id: &str) -> Vec<u8> {
    let mut data = id.as_bytes().to_vec();
    if id.ends_with(['1', '6']) {
        data.resize(data.len() + loam_jobs::DATA_APART_BYTES, b'd');
    }
    data
}
