//! [`Pending`]: the result of a submitted write. A caller awaits it, blocks on
//! it, or hands it a callback ([`Pending::then`]) that the committing thread
//! runs itself: a host with its own event loop (Node) resolves its promise from
//! there, without a hop through an async runtime.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use parking_lot::Mutex;

use crate::error::JobsError;

type Callback<T> = Box<dyn FnOnce(Result<T, JobsError>) + Send>;

enum Slot<T> {
    Empty,
    Waiting(Waker),
    Callback(Callback<T>),
    Done(Result<T, JobsError>),
    Taken,
}

/// The result of a write, once its transaction has committed.
#[must_use = "a write is only known to be done once its Pending resolves"]
pub struct Pending<T> {
    slot: Arc<Mutex<Slot<T>>>,
    /// What to do with a result nobody will take (see [`Pending::if_abandoned`]).
    abandoned: Option<Callback<T>>,
}

/// The writer's end of a [`Pending`]. Dropped unsettled (the store went away
/// with the write), it settles the write as unavailable.
pub(crate) struct Settle<T> {
    slot: Option<Arc<Mutex<Slot<T>>>>,
}

/// A pending result and the end that settles it.
pub(crate) fn pending<T>() -> (Settle<T>, Pending<T>) {
    let slot = Arc::new(Mutex::new(Slot::Empty));
    (Settle { slot: Some(Arc::clone(&slot)) }, Pending { slot, abandoned: None })
}

impl<T> Settle<T> {
    pub(crate) fn settle(mut self, result: Result<T, JobsError>) {
        if let Some(slot) = self.slot.take() {
            deliver(&slot, result);
        }
    }
}

impl<T> Drop for Settle<T> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            deliver(&slot, Err(JobsError::Unavailable("the store closed before the write settled".into())));
        }
    }
}

fn deliver<T>(slot: &Mutex<Slot<T>>, result: Result<T, JobsError>) {
    let mut guard = slot.lock();
    match std::mem::replace(&mut *guard, Slot::Taken) {
        Slot::Callback(callback) => {
            drop(guard);
            callback(result);
        }
        Slot::Waiting(waker) => {
            *guard = Slot::Done(result);
            drop(guard);
            waker.wake();
        }
        _ => *guard = Slot::Done(result),
    }
}

impl<T> Pending<T> {
    /// A write already settled (refused before it reached the store).
    pub(crate) fn settled(result: Result<T, JobsError>) -> Self {
        Pending { slot: Arc::new(Mutex::new(Slot::Done(result))), abandoned: None }
    }

    /// Blocks the calling thread until the write is settled.
    pub fn wait(self) -> Result<T, JobsError> {
        futures_executor::block_on(self)
    }

    /// Runs `callback` with the result: now if settled, else on the thread
    /// that settles it (the store's committer), which it must not hold up.
    pub fn then(mut self, callback: impl FnOnce(Result<T, JobsError>) + Send + 'static) {
        self.abandoned = None; // the callback takes the result
        let mut guard = self.slot.lock();
        match std::mem::replace(&mut *guard, Slot::Taken) {
            Slot::Done(result) => {
                drop(guard);
                callback(result);
            }
            _ => *guard = Slot::Callback(Box::new(callback)),
        }
    }
}

impl<T: Send + 'static> Pending<T> {
    /// Hands a successful result to `undo` if this is dropped before its
    /// result was taken: a write whose caller went away (a cancelled call, a
    /// dropped future) has still committed, and some must be given back (a
    /// lease nobody received would otherwise hold its jobs until it expires,
    /// and count as a stall).
    pub fn if_abandoned(mut self, undo: impl FnOnce(T) + Send + 'static) -> Self {
        self.abandoned = Some(Box::new(move |result| {
            if let Ok(value) = result {
                undo(value);
            }
        }));
        self
    }

    /// The result passed through `f`, on the thread that settles this one.
    pub fn map<U: Send + 'static>(self, f: impl FnOnce(T) -> U + Send + 'static) -> Pending<U> {
        let (settle, out) = pending();
        self.then(move |result| settle.settle(result.map(f)));
        out
    }

    /// Settles once every one of `parts` has, with each part's result in
    /// order, on the thread that settles the last of them (no async runtime
    /// in between, as for one write).
    pub fn all(parts: Vec<Pending<T>>) -> Pending<Vec<Result<T, JobsError>>> {
        let (settle, out) = pending();
        if parts.is_empty() {
            settle.settle(Ok(Vec::new()));
            return out;
        }
        let gather = Arc::new(Mutex::new(Gather {
            results: (0..parts.len()).map(|_| None).collect(),
            left: parts.len(),
            settle: Some(settle),
        }));
        for (i, part) in parts.into_iter().enumerate() {
            let gather = Arc::clone(&gather);
            part.then(move |result| {
                let mut g = gather.lock();
                g.results[i] = Some(result);
                g.left -= 1;
                if g.left > 0 {
                    return;
                }
                let settle = g.settle.take();
                let results = std::mem::take(&mut g.results)
                    .into_iter()
                    .map(|r| {
                        r.unwrap_or_else(|| Err(JobsError::Internal("a part of a joined write got no result".into())))
                    })
                    .collect();
                drop(g);
                if let Some(settle) = settle {
                    settle.settle(Ok(results));
                }
            });
        }
        out
    }
}

/// What [`Pending::all`] has gathered so far.
struct Gather<T> {
    results: Vec<Option<Result<T, JobsError>>>,
    left: usize,
    settle: Option<Settle<Vec<Result<T, JobsError>>>>,
}

impl<T> Drop for Pending<T> {
    fn drop(&mut self) {
        let Some(undo) = self.abandoned.take() else { return };
        let mut guard = self.slot.lock();
        match std::mem::replace(&mut *guard, Slot::Taken) {
            Slot::Taken => {}
            Slot::Done(result) => {
                drop(guard);
                undo(result);
            }
            Slot::Callback(callback) => *guard = Slot::Callback(callback),
            Slot::Empty | Slot::Waiting(_) => *guard = Slot::Callback(undo),
        }
    }
}

impl<T> Future for Pending<T> {
    type Output = Result<T, JobsError>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut guard = self.slot.lock();
        match std::mem::replace(&mut *guard, Slot::Taken) {
            Slot::Done(result) => Poll::Ready(result),
            Slot::Taken => Poll::Ready(Err(JobsError::Internal("a write's result was taken twice".into()))),
            _ => {
                *guard = Slot::Waiting(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_callback_runs_once_with_the_result_before_or_after_settling() {
        let (settle, p) = pending::<u32>();
        let (tx, rx) = std::sync::mpsc::channel();
        let tx2 = tx.clone();
        p.then(move |r| tx.send(r).unwrap());
        settle.settle(Ok(7));
        assert_eq!(rx.recv().unwrap(), Ok(7));

        let (settle, p) = pending::<u32>();
        settle.settle(Ok(8));
        p.then(move |r| tx2.send(r).unwrap());
        assert_eq!(rx.recv().unwrap(), Ok(8));
    }

    #[test]
    fn all_settles_after_its_last_part_with_every_result_in_order() {
        let (first, a) = pending::<u32>();
        let (second, b) = pending::<u32>();
        let (third, c) = pending::<u32>();
        let (tx, rx) = std::sync::mpsc::channel();
        Pending::all(vec![a, b, c]).map(|results| results.len()).then(move |r| tx.send(r).unwrap());
        third.settle(Ok(3));
        drop(first); // the store went away with it
        assert!(rx.try_recv().is_err(), "settled before its last part");
        second.settle(Err(JobsError::InvalidArgument("no".into())));
        assert_eq!(rx.recv().unwrap(), Ok(3));

        let (first, a) = pending::<u32>();
        let (second, b) = pending::<u32>();
        let joined = Pending::all(vec![a, b]);
        let waiter = std::thread::spawn(move || joined.wait());
        second.settle(Ok(2));
        first.settle(Err(JobsError::InvalidArgument("no".into())));
        let results = waiter.join().unwrap().unwrap();
        assert!(matches!(results[0], Err(JobsError::InvalidArgument(_))));
        assert_eq!(results[1], Ok(2));
        assert_eq!(Pending::<u32>::all(Vec::new()).wait(), Ok(Vec::new()));
    }

    #[test]
    fn a_dropped_writer_settles_as_unavailable() {
        let (settle, p) = pending::<u32>();
        drop(settle);
        assert!(matches!(p.wait(), Err(JobsError::Unavailable(_))));
        let (settle, p) = pending::<u32>();
        let waiter = std::thread::spawn(move || p.wait());
        std::thread::sleep(std::time::Duration::from_millis(20));
        settle.settle(Ok(1));
        assert_eq!(waiter.join().unwrap(), Ok(1));
    }

    #[test]
    fn an_abandoned_result_goes_to_its_undo_once_and_a_taken_one_never() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let undone = Arc::new(AtomicUsize::new(0));
        let undo = |undone: &Arc<AtomicUsize>| {
            let undone = Arc::clone(undone);
            move |v: usize| {
                undone.fetch_add(v, Ordering::SeqCst);
            }
        };
        // Dropped before it settled: undone when it settles.
        let (settle, p) = pending::<usize>();
        drop(p.if_abandoned(undo(&undone)));
        assert_eq!(undone.load(Ordering::SeqCst), 0);
        settle.settle(Ok(1));
        assert_eq!(undone.load(Ordering::SeqCst), 1);
        // Dropped after it settled: undone at the drop.
        let (settle, p) = pending::<usize>();
        let p = p.if_abandoned(undo(&undone));
        settle.settle(Ok(10));
        drop(p);
        assert_eq!(undone.load(Ordering::SeqCst), 11);
        // Taken by waiting, by a callback, or failed: nothing to undo.
        let (settle, p) = pending::<usize>();
        settle.settle(Ok(100));
        assert_eq!(p.if_abandoned(undo(&undone)).wait().ok(), Some(100));
        let (settle, p) = pending::<usize>();
        p.if_abandoned(undo(&undone)).then(|_| {});
        settle.settle(Ok(1000));
        let (settle, p) = pending::<usize>();
        drop(p.if_abandoned(undo(&undone)));
        settle.settle(Err(JobsError::Unavailable("gone".into())));
        assert_eq!(undone.load(Ordering::SeqCst), 11);
    }
}
