//! Parents and children: a child's link to its parent, and a parent's record of each child.

use serde::{Deserialize, Serialize};

/// A child's behaviour when it fails (BullMQ's four flow policies).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum OnChildFailure {
    /// The parent keeps waiting; the failure is recorded (BullMQ's default).
    #[default]
    Wait,
    /// `failParentOnFailure`: the parent fails too.
    FailParent,
    /// `continueParentOnFailure`: the parent is released to run now.
    ContinueParent,
    /// `ignoreDependencyOnFailure`: the failure counts as done, and is listed as ignored.
    Ignore,
    /// `removeDependencyOnFailure`: the dependency is removed.
    Remove,
}

/// A link from a child to its parent, which may live in another queue.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParentRef {
    pub queue: String,
    pub id: String,
    /// The prefix of the parent's queue, as BullMQ names it in node keys.
    #[serde(default)]
    pub prefix: String,
}

impl ParentRef {
    /// BullMQ's node key of the parent: `<prefix>:<queue>:<id>`.
    pub fn node_key(&self) -> String {
        node_key(&self.prefix, &self.queue, &self.id)
    }
}

pub fn node_key(prefix: &str, queue: &str, id: &str) -> String {
    match (prefix.is_empty(), queue.is_empty()) {
        (true, _) => format!("{queue}:{id}"),
        // A BullMQ queue key with no `:` names no queue (see the BullMQ
        // backends' `split_qualified`): its job's key is `<key>:<id>`.
        (false, true) => format!("{prefix}:{id}"),
        (false, false) => format!("{prefix}:{queue}:{id}"),
    }
}

/// How many of a parent's children are pending, and how many failed it
/// (failParentOnFailure): see [`JobRecord::children_counted`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChildCounts {
    pub pending: u32,
    pub failed: u32,
}

/// A parent's record of one child.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dependency {
    pub status: DependencyStatus,
    /// Where the child lives.
    #[serde(default)]
    pub child_queue: String,
    #[serde(default)]
    pub child_id: String,
    /// The child's return value (processed) or failure reason (failed, ignored).
    pub value: Option<String>,
}

impl Dependency {
    /// Whether this is the record of child `id` of queue `queue`. A node key
    /// joins queue and id with `:`, which both may hold, so a store written
    /// before such clashes were refused (`enqueue::record_child`) may hold
    /// another child's record under this child's key. Records from before
    /// children's queues and ids were kept name nobody, and are anyone's.
    pub fn is_of(&self, queue: &str, id: &str) -> bool {
        (self.child_queue.is_empty() && self.child_id.is_empty()) || (self.child_queue == queue && self.child_id == id)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DependencyStatus {
    Pending,
    Processed,
    Failed,
    Ignored,
}
