//! BullMQ's shapes ⇄ the core's types.
//!
//! Inputs arrive as JSON text (BullMQ's `JobJson`, its long-form `opts`, its
//! `KeepJobs`) and are parsed here with serde; outputs leave as JSON text in
//! exactly the shapes BullMQ's callers consume (`JobJson`, the next-job tuple),
//! so the JavaScript side does one `JSON.parse` per call and no reshaping.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use loam_jobs::{
    Backoff, Dedup, EnqueueRequest, Event, JobError, JobRecord, Keep, Lease, Leased, OnChildFailure, ParentRef,
    Retention, as_text,
};

/// A count or a length of time BullMQ passes, which JavaScript may hand over
/// as a float, a negative or a non-finite number. Rust's cast saturates:
/// negatives and NaN become 0, `Infinity` and anything past `u64::MAX` become
/// `u64::MAX`, so "for ever" or "keep all" stays that (read as 0, `Infinity`
/// turned a delay into none, and a retention age into "remove all").
pub fn whole(n: f64) -> u64 {
    n as u64
}

/// BullMQ's `backoff`: a number (fixed delay) or `{type, delay, jitter}`.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum BackoffOpt {
    Delay(f64),
    Spec {
        #[serde(rename = "type")]
        kind: String,
        delay: Option<f64>,
        jitter: Option<f64>,
    },
}

impl BackoffOpt {
    /// None for custom strategies: their delays are computed in JavaScript and
    /// arrive with each retry.
    pub fn to_core(&self) -> Option<Backoff> {
        match self {
            BackoffOpt::Delay(d) => Some(Backoff::Fixed { delay_ms: whole(*d), jitter: 0.0 }),
            BackoffOpt::Spec { kind, delay, jitter } => {
                let delay_ms = whole(delay.unwrap_or(0.0));
                let jitter = jitter.unwrap_or(0.0);
                match kind.as_str() {
                    "fixed" => Some(Backoff::Fixed { delay_ms, jitter }),
                    "exponential" => Some(Backoff::Exponential { delay_ms, jitter, max_ms: None }),
                    _ => None,
                }
            }
        }
    }
}

/// BullMQ's `removeOnComplete` / `removeOnFail`: `true`, `false`, a count, or
/// `KeepJobs {age (seconds), count, limit}`.
#[derive(Deserialize, Debug, Clone, Copy)]
#[serde(untagged)]
pub enum KeepOpt {
    Flag(bool),
    Count(f64),
    Keep { age: Option<f64>, count: Option<f64>, limit: Option<f64> },
}

impl KeepOpt {
    pub fn to_core(self) -> Retention {
        // BullMQ's `count: -1` (and any negative count) means "keep all".
        let count = |c: Option<f64>| c.filter(|c| *c >= 0.0).map(whole);
        match self {
            KeepOpt::Flag(true) => Retention::RemoveImmediately,
            KeepOpt::Flag(false) => Retention::KeepAll,
            KeepOpt::Count(n) if n < 0.0 => Retention::KeepAll,
            KeepOpt::Count(n) => Retention::Keep(Keep { count: Some(whole(n)), age_ms: None, limit: None }),
            KeepOpt::Keep { age, count: c, limit } => {
                let keep = Keep { count: count(c), age_ms: age.map(|a| whole(a * 1000.0)), limit: limit.map(whole) };
                if keep == Keep::default() { Retention::KeepAll } else { Retention::Keep(keep) }
            }
        }
    }

    /// Parses the JSON text JavaScript sends for a `KeepJobs` option; `null`,
    /// empty or malformed text means "not set".
    pub fn parse(json: Option<&str>) -> Option<Retention> {
        let json = json?;
        from_json::<Option<KeepOpt>>(json).ok().flatten().map(KeepOpt::to_core)
    }
}

#[derive(Deserialize, Debug, Clone, Default)]
#[serde(rename_all = "camelCase")]
pub struct DedupOpt {
    pub id: Option<String>,
    pub ttl: Option<f64>,
    #[serde(default)]
    pub extend: bool,
    #[serde(default)]
    pub replace: bool,
    #[serde(default)]
    pub keep_last_if_active: bool,
    #[serde(default)]
    pub reschedule: bool,
}

#[derive(Deserialize, Debug, Clone)]
pub struct ParentOpt {
    pub id: String,
    /// The parent queue's qualified name, `<prefix>:<queue>`.
    pub queue: String,
}

/// The options of BullMQ's `JobsOptions` that the core acts on. Everything
/// else in the document is kept verbatim (the core stores `opts` as text).
#[derive(Deserialize, Debug, Clone, Default)]
#[serde(rename_all = "camelCase")]
pub struct JobOpts {
    pub job_id: Option<String>,
    pub delay: Option<f64>,
    pub priority: Option<f64>,
    pub lifo: Option<bool>,
    pub attempts: Option<f64>,
    pub backoff: Option<BackoffOpt>,
    pub remove_on_complete: Option<KeepOpt>,
    pub remove_on_fail: Option<KeepOpt>,
    pub deduplication: Option<DedupOpt>,
    pub parent: Option<ParentOpt>,
    #[serde(default)]
    pub fail_parent_on_failure: bool,
    #[serde(default)]
    pub continue_parent_on_failure: bool,
    #[serde(default)]
    pub ignore_dependency_on_failure: bool,
    #[serde(default)]
    pub remove_dependency_on_failure: bool,
    pub keep_logs: Option<f64>,
    pub timestamp: Option<f64>,
}

impl JobOpts {
    pub fn on_child_failure(&self) -> OnChildFailure {
        if self.fail_parent_on_failure {
            OnChildFailure::FailParent
        } else if self.continue_parent_on_failure {
            OnChildFailure::ContinueParent
        } else if self.ignore_dependency_on_failure {
            OnChildFailure::Ignore
        } else if self.remove_dependency_on_failure {
            OnChildFailure::Remove
        } else {
            OnChildFailure::Wait
        }
    }

    pub fn dedup(&self) -> Option<Dedup> {
        let d = self.deduplication.as_ref()?;
        Some(Dedup {
            id: d.id.clone()?,
            ttl_ms: d.ttl.map(whole).filter(|t| *t > 0),
            extend: d.extend,
            replace: d.replace,
            keep_last_if_active: d.keep_last_if_active,
            reschedule: d.reschedule,
        })
    }
}

/// BullMQ's `job.parent`: `{id, queueKey}` (plus failure flags we take from opts).
#[derive(Deserialize, Serialize, Debug, Clone)]
#[serde(rename_all = "camelCase")]
pub struct JobParent {
    pub id: String,
    pub queue_key: String,
}

/// Splits a qualified queue name `<prefix>:<queue>` (BullMQ queue names
/// cannot contain `:`, so the last colon separates them). A key with no `:`
/// is all prefix and names no queue, as on Redis, where no BullMQ queue's
/// keys take that form: a parent given so (`'pq'` for `'bull:pq'`) is
/// missing (-5), where it was taken for queue `pq`.
pub fn split_qualified(queue_key: &str) -> (&str, &str) {
    queue_key.rsplit_once(':').unwrap_or((queue_key, ""))
}

pub fn parent_ref(queue_key: &str, id: &str) -> ParentRef {
    let (prefix, queue) = split_qualified(queue_key);
    ParentRef { queue: queue.to_string(), id: id.to_string(), prefix: prefix.to_string() }
}

/// One job as `Queue.add` / `addBulk` / `FlowProducer` hand it to the backend:
/// BullMQ's `JobJson` plus the backend arguments (`jobId`, `parentKeyOpts`).
#[derive(Deserialize, Debug)]
#[serde(rename_all = "camelCase")]
pub struct NewJob {
    pub name: String,
    /// JSON text of the payload.
    #[serde(default)]
    pub data: Option<String>,
    pub opts: Option<Box<RawValue>>,
    /// The `jobId` argument; empty = auto id.
    pub job_id: Option<String>,
    pub timestamp: Option<f64>,
    pub delay: Option<f64>,
    pub priority: Option<f64>,
    pub parent: Option<JobParent>,
    pub parent_key: Option<String>,
    pub repeat_job_key: Option<String>,
    /// A flow parent: stored in waiting-children until its children finish.
    #[serde(default)]
    pub add_to_waiting_children: bool,
    /// addFlow only: the node's queue name (its prefix is in `parent`/`opts`).
    pub queue_name: Option<String>,
}

impl NewJob {
    /// The core request for this job. Errors are malformed `opts` documents.
    pub fn to_request(&self) -> Result<EnqueueRequest, String> {
        let opts_text = self.opts.as_ref().map_or("{}", |o| o.get());
        let opts: JobOpts =
            from_json(opts_text).map_err(|e| format!("job options are not valid BullMQ options: {e}"))?;
        // An empty custom id means "no custom id" (BullMQ generates one).
        let job_id = self.job_id.clone().or_else(|| opts.job_id.clone()).filter(|s| !s.is_empty());
        let parent = match (&self.parent, &opts.parent) {
            (Some(p), _) => Some(parent_ref(&p.queue_key, &p.id)),
            (None, Some(p)) => Some(parent_ref(&p.queue, &p.id)),
            (None, None) => None,
        };
        if let Some(p) = opts.priority {
            priority(p)?;
        }
        let base = opts.to_request();
        Ok(EnqueueRequest {
            name: self.name.clone(),
            data: self.data.clone().unwrap_or_else(|| "{}".into()).into_bytes(),
            opts: opts_text.to_string(),
            job_id,
            delay_ms: self.delay.map_or(base.delay_ms, whole),
            priority: self.priority.map(priority).transpose()?.unwrap_or(base.priority),
            parent,
            timestamp: self.timestamp.map(whole).or(base.timestamp),
            scheduler_id: self.repeat_job_key.clone(),
            ..base
        })
    }

    /// The per-job settings of a scheduler's iterations, from its template
    /// options (`JobsOptions` JSON); the core fills in the rest per iteration.
    pub fn template(opts: &str) -> Result<EnqueueRequest, String> {
        let opts: JobOpts =
            from_json(opts).map_err(|e| format!("job scheduler template options are not valid: {e}"))?;
        Ok(opts.to_request())
    }
}

fn small(n: f64) -> u32 {
    whole(n).min(u64::from(u32::MAX)) as u32
}

/// A priority a caller gives now (an add, a change of priority). BullMQ's
/// own check stops only those above its limit (which the core refuses too);
/// one below 0 is refused here rather than taken as 0, which Redis takes as
/// a priority above every other. Options stored earlier (a scheduler's
/// template) are read as before, below 0 as 0: refusing them would stop the
/// scheduler at its next iteration.
pub fn priority(n: f64) -> Result<u32, String> {
    // NaN too: Redis refuses it, and read as 0 it dropped the priority.
    if n.is_nan() || n < 0.0 {
        return Err(format!("priority must be between 0 and {}, got {n}", loam_jobs::MAX_PRIORITY));
    }
    Ok(small(n))
}

impl JobOpts {
    /// Everything the options alone decide (no name, data or parent link).
    pub fn to_request(&self) -> EnqueueRequest {
        EnqueueRequest {
            dedup: self.dedup(),
            delay_ms: whole(self.delay.unwrap_or(0.0)),
            priority: small(self.priority.unwrap_or(0.0)),
            lifo: self.lifo.unwrap_or(false),
            attempts: small(self.attempts.unwrap_or(0.0)),
            backoff: self.backoff.as_ref().and_then(BackoffOpt::to_core),
            on_child_failure: self.on_child_failure(),
            remove_on_complete: self.remove_on_complete.map(KeepOpt::to_core),
            remove_on_fail: self.remove_on_fail.map(KeepOpt::to_core),
            keep_logs: self.keep_logs.map(whole),
            timestamp: self.timestamp.map(whole),
            ..Default::default()
        }
    }
}

/// A scheduler as BullMQ's `getJobScheduler` reads it: the Redis hash
/// `repeat:<id>` (string values, absent fields omitted).
pub fn scheduler_hash(r: &loam_jobs::SchedulerRecord) -> serde_json::Map<String, serde_json::Value> {
    let mut h = serde_json::Map::new();
    let mut put = |k: &str, v: String| {
        h.insert(k.to_string(), serde_json::Value::String(v));
    };
    put("name", r.name.clone());
    put("ic", r.iteration_count.to_string());
    if let Some(v) = r.limit {
        put("limit", v.to_string());
    }
    if let Some(v) = r.start_date {
        put("startDate", v.to_string());
    }
    if let Some(v) = r.end_date {
        put("endDate", v.to_string());
    }
    if let Some(v) = &r.tz {
        put("tz", v.clone());
    }
    if let Some(v) = &r.pattern {
        put("pattern", v.clone());
    }
    if let Some(v) = r.every_ms {
        put("every", v.to_string());
    }
    if let Some(v) = r.offset_ms {
        put("offset", v.to_string());
    }
    if !r.template_data.is_empty() && r.template_data != "{}" {
        put("data", r.template_data.clone());
    }
    if !r.template_opts.is_empty() && r.template_opts != "{}" {
        put("opts", r.template_opts.clone());
    }
    h
}

/// BullMQ's `fieldsToUpdate` on a failure or retry: the reason and the whole
/// stack trace array (JSON text) after JavaScript appended and trimmed it.
#[derive(Deserialize, Debug, Default)]
#[serde(rename_all = "camelCase")]
pub struct FailureFields {
    pub failed_reason: Option<String>,
    pub stacktrace: Option<String>,
}

impl FailureFields {
    /// BullMQ's array replaces the job's stack traces whole, as on Redis.
    pub fn to_error(&self, reason: Option<&str>) -> JobError {
        let traces = self.stacktrace.as_deref().map(|s| {
            from_json::<Vec<Option<String>>>(s).map(|v| v.into_iter().flatten().collect()).unwrap_or_default()
        });
        JobError {
            message: reason.or(self.failed_reason.as_deref()).unwrap_or_default().to_string(),
            stacktraces: traces,
            ..JobError::default()
        }
    }
}

// ---- outputs ---------------------------------------------------------------

/// Stored JSON text as a raw JSON value, or `fallback` when it is missing or
/// not JSON (a job added by a client that stores other options).
fn raw_or<'a>(text: Option<&'a str>, fallback: &'static str) -> &'a RawValue {
    let parse = |t: &'a str| serde_json::from_str::<&'a RawValue>(t).ok();
    text.and_then(parse).or_else(|| parse(fallback)).unwrap_or(RawValue::NULL)
}

#[derive(Serialize)]
struct ParentJson<'a> {
    id: &'a str,
    #[serde(rename = "queueKey")]
    queue_key: String,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    fpof: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    cpof: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    idof: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    rdof: bool,
}

/// BullMQ's `JobJson`, as `getJobData` and the next-job tuple return it.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct JobJson<'a> {
    id: &'a str,
    name: &'a str,
    data: std::borrow::Cow<'a, str>,
    opts: &'a RawValue,
    progress: &'a RawValue,
    delay: u64,
    priority: u32,
    timestamp: u64,
    attempts_made: u32,
    attempts_started: u32,
    stalled_counter: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    finished_on: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    processed_on: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    processed_by: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    failed_reason: Option<&'a str>,
    stacktrace: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    returnvalue: Option<std::borrow::Cow<'a, str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parent_key: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parent: Option<ParentJson<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    repeat_job_key: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    deduplication_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    deferred_failure: Option<&'a str>,
}

impl<'a> JobJson<'a> {
    pub fn new(job: &'a JobRecord) -> Self {
        let parent = job.parent.as_ref().map(|p| {
            let policy = job.on_child_failure;
            ParentJson {
                id: &p.id,
                queue_key: if p.prefix.is_empty() { p.queue.clone() } else { format!("{}:{}", p.prefix, p.queue) },
                fpof: policy == OnChildFailure::FailParent,
                cpof: policy == OnChildFailure::ContinueParent,
                idof: policy == OnChildFailure::Ignore,
                rdof: policy == OnChildFailure::Remove,
            }
        });
        JobJson {
            id: &job.id,
            name: &job.name,
            data: as_text(&job.data),
            opts: raw_or(Some(&job.opts), "{}"),
            progress: raw_or(job.progress.as_deref(), "0"),
            delay: job.delay,
            priority: job.priority,
            timestamp: job.timestamp,
            attempts_made: job.attempts_made,
            attempts_started: job.attempts_started,
            stalled_counter: job.stalled_counter,
            finished_on: job.finished_on,
            processed_on: job.processed_on,
            processed_by: job.processed_by.as_deref(),
            failed_reason: job.failed_reason.as_deref(),
            stacktrace: serde_json::to_string(&job.stacktrace).unwrap_or_else(|_| "[]".into()),
            returnvalue: job.return_value.as_deref().map(as_text),
            parent_key: job.parent.as_ref().map(ParentRef::node_key),
            parent,
            repeat_job_key: job.scheduler_id.as_deref(),
            deduplication_id: job.dedup.as_ref().map(|d| d.id.as_str()),
            deferred_failure: job.deferred_failure.as_deref(),
        }
    }
}

pub fn job_json(job: &JobRecord) -> String {
    serde_json::to_string(&JobJson::new(job)).unwrap_or_else(|_| "null".into())
}

/// BullMQ's next-job tuple `[jobJson | null, id, rateLimitDelayMs, delayUntilMs]`
/// for the first lease of `leased` (the core leases one job per BullMQ fetch);
/// without a job the id is `0`, as Redis's scripts return it.
#[derive(Serialize)]
pub struct NextJob<'a>(Option<JobJson<'a>>, NextJobId<'a>, u64, u64);

#[derive(Serialize)]
#[serde(untagged)]
pub enum NextJobId<'a> {
    Id(&'a str),
    None(u8),
}

impl<'a> NextJob<'a> {
    pub fn new(leased: &'a Leased) -> Self {
        match leased.leases.first() {
            Some(Lease { job, .. }) => NextJob(Some(JobJson::new(job)), NextJobId::Id(&job.id), 0, 0),
            None if leased.info.rate_limit_ms > 0 => NextJob(None, NextJobId::None(0), leased.info.rate_limit_ms, 0),
            None => NextJob(None, NextJobId::None(0), 0, leased.info.next_due.unwrap_or(0)),
        }
    }
}

pub fn next_job_json(leased: &Leased) -> String {
    serde_json::to_string(&NextJob::new(leased)).unwrap_or_else(|_| "[null,0,0,0]".into())
}

/// `{result?, finishedOn}` of moveToCompleted / moveToFailed.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Finished<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<NextJob<'a>>,
    pub finished_on: u64,
}

/// One stream entry as Redis XREAD shapes it: `[id, [k1, v1, ...]]`, with the
/// `event` field first.
#[derive(Serialize)]
pub struct StreamEntry(pub String, pub Vec<String>);

impl From<Event> for StreamEntry {
    fn from(e: Event) -> Self {
        let mut fields = Vec::with_capacity(2 + 2 * e.fields.len());
        fields.push("event".to_string());
        fields.push(e.name.clone());
        for (k, v) in e.fields.iter() {
            fields.push(k.clone());
            fields.push(v.clone());
        }
        StreamEntry(e.id(), fields)
    }
}

/// JSON `text` read as a `T`, with any escaped lone UTF-16 surrogate taken as
/// U+FFFD (see [`without_lone_surrogates`]): every JSON text BullMQ hands the
/// addon is read so. A stack trace read otherwise was dropped whole, and a
/// deduplication id refused.
pub fn from_json<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, JsonError> {
    serde_json::from_str(text).or_else(|e| match without_lone_surrogates(text) {
        Some(fixed) => serde_json::from_str(&fixed).map_err(|e| JsonError::located::<T>(&fixed, e)),
        None => Err(JsonError::located::<T>(text, e)),
    })
}

/// Why a JSON text did not read as the type asked for, said by the field it
/// failed at (`attempts: invalid type: string "3", expected a number`):
/// "at line 1 column 15" of a text BullMQ wrote told its user nothing.
#[derive(Debug)]
pub struct JsonError {
    /// `attempts`, `repeat.every`; empty at the top.
    path: String,
    error: serde_json::Error,
}

impl JsonError {
    /// The path of the field `error` came from, found by reading `text`
    /// again, following the path, only once it failed: followed on every
    /// read, it would cost each add.
    fn located<T: serde::de::DeserializeOwned>(text: &str, error: serde_json::Error) -> Self {
        let path = match serde_path_to_error::deserialize::<_, T>(&mut serde_json::Deserializer::from_str(text)) {
            Err(e) if e.path().iter().next().is_some() => e.path().to_string(),
            _ => String::new(),
        };
        JsonError { path, error }
    }
}

impl std::fmt::Display for JsonError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = self.error.to_string();
        if self.path.is_empty() {
            return f.write_str(&text);
        }
        // A value of the wrong type: where in the text adds nothing to its field's name.
        let position = format!(" at line {} column {}", self.error.line(), self.error.column());
        let message = text.strip_suffix(&position).unwrap_or(&text);
        // Said in the terms of the JSON the user wrote, not of the Rust types read.
        if message.starts_with("data did not match any variant of untagged enum") {
            return write!(f, "{}: not a value this option takes", self.path);
        }
        let message = ["f64", "f32", "u64", "u32", "u16", "u8", "i64", "i32"]
            .iter()
            .fold(message.to_string(), |m, number| m.replace(&format!("expected {number}"), "expected a number"));
        write!(f, "{}: {message}", self.path)
    }
}

/// `text` (JSON) with each escaped lone UTF-16 surrogate replaced by U+FFFD,
/// or None if it has none. `JSON.stringify` writes a string cut inside a
/// surrogate pair (an emoji cut short) with such an escape, which serde
/// refuses; Redis stores that text with U+FFFD in its place, and so does
/// this (a processor's error message cut so was refused, and its job's
/// failure lost).
fn without_lone_surrogates(text: &str) -> Option<String> {
    let unit = |at: usize| {
        let hex = text.get(at..at + 6)?.strip_prefix("\\u")?;
        u16::from_str_radix(hex, 16).ok()
    };
    let (mut out, mut copied, mut fixed, mut i) = (String::with_capacity(text.len()), 0, false, 0);
    let bytes = text.as_bytes();
    while i < bytes.len() {
        if bytes[i] != b'\\' {
            i += 1;
            continue;
        }
        let Some(first) = unit(i) else {
            i += 2; // an escaped character: `\\`, `\"`, ...
            continue;
        };
        let paired = (0xD800..0xDC00).contains(&first) && unit(i + 6).is_some_and(|u| (0xDC00..0xE000).contains(&u));
        if paired {
            i += 12;
        } else if (0xD800..0xE000).contains(&first) {
            out.push_str(&text[copied..i]);
            out.push_str("\\ufffd");
            i += 6;
            copied = i;
            fixed = true;
        } else {
            i += 6;
        }
    }
    fixed.then(|| out + &text[copied..])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn new_job(opts: &str) -> NewJob {
        serde_json::from_str(&format!(r#"{{"name":"n","data":"{{}}","opts":{opts},"timestamp":5}}"#)).unwrap()
    }

    #[test]
    fn an_option_of_the_wrong_type_is_named_in_the_error() {
        let refused = |opts: &str| new_job(opts).to_request().unwrap_err();
        assert_eq!(
            refused(r#"{"attempts":"3"}"#),
            r#"job options are not valid BullMQ options: attempts: invalid type: string "3", expected a number"#
        );
        assert_eq!(
            refused(r#"{"delay":1,"backoff":{"type":"fixed","delay":"soon"}}"#),
            "job options are not valid BullMQ options: backoff: not a value this option takes"
        );
    }

    #[test]
    fn opts_map_to_the_request() {
        let req = new_job(
            r#"{"jobId":"j","delay":10,"priority":3,"attempts":4,"backoff":{"type":"exponential","delay":100,"jitter":0.5},
                "removeOnComplete":{"age":60,"count":5},"removeOnFail":true,"keepLogs":7,
                "deduplication":{"id":"d","ttl":1000,"extend":true},"parent":{"id":"p","queue":"bull:pq"},
                "ignoreDependencyOnFailure":true,"telemetry":{"x":1}}"#,
        )
        .to_request()
        .unwrap();
        assert_eq!(req.job_id.as_deref(), Some("j"));
        assert_eq!((req.delay_ms, req.priority, req.attempts, req.timestamp), (10, 3, 4, Some(5)));
        assert_eq!(req.backoff, Some(Backoff::Exponential { delay_ms: 100, jitter: 0.5, max_ms: None }));
        assert_eq!(
            req.remove_on_complete,
            Some(Retention::Keep(Keep { count: Some(5), age_ms: Some(60_000), limit: None }))
        );
        assert_eq!(req.remove_on_fail, Some(Retention::RemoveImmediately));
        assert_eq!(req.keep_logs, Some(7));
        let d = req.dedup.unwrap();
        assert_eq!((d.id.as_str(), d.ttl_ms, d.extend, d.replace), ("d", Some(1000), true, false));
        let p = req.parent.unwrap();
        assert_eq!((p.prefix.as_str(), p.queue.as_str(), p.id.as_str()), ("bull", "pq", "p"));
        assert_eq!(p.node_key(), "bull:pq:p");
        assert_eq!(req.on_child_failure, OnChildFailure::Ignore);
        assert!(req.opts.contains("telemetry"), "opts are kept verbatim");
        assert_eq!(new_job(r#"{"jobId":""}"#).to_request().unwrap().job_id, None);
    }

    #[test]
    fn backoff_and_keep_forms() {
        assert_eq!(BackoffOpt::Delay(50.0).to_core(), Some(Backoff::Fixed { delay_ms: 50, jitter: 0.0 }));
        let custom: BackoffOpt = serde_json::from_str(r#"{"type":"mine","delay":3}"#).unwrap();
        assert_eq!(custom.to_core(), None);
        assert_eq!(KeepOpt::parse(Some("false")), Some(Retention::KeepAll));
        assert_eq!(KeepOpt::parse(Some("-1")), Some(Retention::KeepAll));
        assert_eq!(KeepOpt::parse(Some("3")), Some(Retention::Keep(Keep { count: Some(3), ..Keep::default() })));
        assert_eq!(KeepOpt::parse(Some("null")), None);
        assert_eq!(KeepOpt::parse(None), None);
    }

    #[test]
    fn failure_fields_rebuild_the_stack_array() {
        let f = FailureFields { failed_reason: Some("boom".into()), stacktrace: Some(r#"["a","b"]"#.into()) };
        let e = f.to_error(None);
        assert_eq!((e.message.as_str(), e.stacktraces), ("boom", Some(vec!["a".into(), "b".into()])));
        let empty = FailureFields { failed_reason: None, stacktrace: Some("[]".into()) }.to_error(Some("r"));
        assert_eq!((empty.message.as_str(), empty.stacktraces), ("r", Some(vec![])));
        let none = FailureFields { failed_reason: Some("x".into()), stacktrace: None }.to_error(None);
        assert_eq!(none.stacktraces, None);
    }

    #[test]
    fn events_take_the_xread_shape() {
        let e = Event { seq: 7, ts: 100, name: "completed".into(), fields: vec![("jobId".into(), "1".into())] };
        let json = serde_json::to_string(&StreamEntry::from(e)).unwrap();
        assert_eq!(json, r#"["100-7",["event","completed","jobId","1"]]"#);
    }

    #[test]
    fn lone_surrogate_escapes_become_the_replacement_character() {
        let fixed = |t: &str| super::without_lone_surrogates(t);
        assert_eq!(
            fixed(r#"{"a":"Zo\u00eb \ud83d","b":"\ude00x"}"#).as_deref(),
            Some(r#"{"a":"Zo\u00eb \ufffd","b":"\ufffdx"}"#)
        );
        // A pair, an escaped backslash before `u`, and plain text stay.
        assert_eq!(fixed(r#"{"a":"\ud83d\ude00","b":"\\ud83d","c":"é\n"}"#), None);
        let text = fixed(r#"["\ud83d"]"#).unwrap();
        assert_eq!(serde_json::from_str::<Vec<String>>(&text).unwrap(), ["\u{fffd}"]);
    }
}
