//! In-process wake-ups: a waiter registers before it looks, a writer notifies
//! after its commit, so no wake-up is lost and nobody polls.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

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
    }

    /// Wakes every waiter of every queue (close, interrupt).
    pub fn notify_all(&self) {
        let events: Vec<Arc<Event>> = self.events.lock().values().cloned().collect();
        for e in events {
            e.notify(usize::MAX);
        }
    }
}

/// Called on the thread of the write that notifies a listener (see
/// [`Telling`]).
pub type Tell = Arc<dyn Fn() + Send + Sync>;

/// A listener that, as it is notified, also calls its [`Tell`] on the
/// notifying thread, before whoever awaits it is polled again. A host with an
/// event loop of its own (Node) answers its waiter there: when the write ran
/// on the host's own thread, in the same turn of its loop, with no wake-up of
/// the runtime that polls the wait and none of the host's thread after it.
pub struct Telling {
    listener: EventListener,
    tell: Option<Tell>,
}

impl Telling {
    pub fn new(listener: EventListener, tell: Option<&Tell>) -> Self {
        Self { listener, tell: tell.cloned() }
    }
}

impl Future for Telling {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let Some(tell) = self.tell.clone() else { return Pin::new(&mut self.listener).poll(cx) };
        let waker = Waker::from(Arc::new(TellingWaker { tell, then: cx.waker().clone() }));
        Pin::new(&mut self.listener).poll(&mut Context::from_waker(&waker))
    }
}

struct TellingWaker {
    tell: Tell,
    then: Waker,
}

impl Wake for TellingWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        (self.tell)();
        self.then.wake_by_ref();
    }
}
