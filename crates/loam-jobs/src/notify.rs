//! In-process wake-ups: a waiter registers before it looks, a writer notifies
//! after its commit, so no wake-up is lost and nobody polls.

use std::collections::HashMap;
use std::sync::Arc;

use event_listener::{Event, EventListener};
use parking_lot::Mutex;

use crate::keys::QueueId;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Channel {
    /// A job may have become ready.
    Jobs,
    /// An event was written.
    Events,
}

#[derive(Default)]
pub struct Notifier {
    events: Mutex<HashMap<(QueueId, Channel), Arc<Event>>>,
    /// Woken by every channel of every queue, and by close.
    any: Event,
}

impl Notifier {
    fn event(&self, queue: &QueueId, channel: Channel) -> Arc<Event> {
        let mut map = self.events.lock();
        Arc::clone(map.entry((queue.clone(), channel)).or_default())
    }

    pub fn listen(&self, queue: &QueueId, channel: Channel) -> EventListener {
        self.event(queue, channel).listen()
    }

    pub fn notify(&self, queue: &QueueId, channel: Channel) {
        let event = self.events.lock().get(&(queue.clone(), channel)).cloned();
        if let Some(event) = event {
            event.notify(usize::MAX);
        }
        self.any.notify(usize::MAX);
    }

    /// Wakes every waiter of every queue (close, interrupt).
    pub fn notify_all(&self) {
        let events: Vec<Arc<Event>> = self.events.lock().values().cloned().collect();
        for e in events {
            e.notify(usize::MAX);
        }
        self.any.notify(usize::MAX);
    }

    pub fn listen_any(&self) -> EventListener {
        self.any.listen()
    }
}
