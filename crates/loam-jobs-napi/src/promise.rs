//! Promises that the core's threads settle. Each is made with
//! `napi_create_promise`; its result goes to the JavaScript thread through one
//! thread-safe function per Node environment, which delivers every result
//! waiting when it runs.
//!
//! napi-rs's `create_deferred` makes a thread-safe function per promise (a uv
//! handle, a clean-up hook and their locks) and closes it once settled. On a
//! one-at-a-time `add` the JavaScript thread spent much of its time there, and
//! slept on the function's lock whenever a store thread settled at the same
//! moment. Here a promise costs a V8 resolver, and a burst of results one
//! wake-up of the JavaScript thread.
#![allow(
    unsafe_code,
    reason = "promises are made and settled through Node-API's C functions, which napi-rs wraps only with a thread-safe function per promise"
)]

use std::cell::RefCell;
use std::marker::PhantomData;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use napi::bindgen_prelude::*;
use napi::sys;
use napi::threadsafe_function::{ThreadsafeCallContext, ThreadsafeFunction, ThreadsafeFunctionCallMode};
use parking_lot::Mutex;

/// Delivers a result to its promise, on the JavaScript thread.
type Delivery = Box<dyn FnOnce(sys::napi_env) + Send>;

/// Wakes the JavaScript thread to deliver what is waiting. Weak (it does not
/// keep Node's loop alive by itself); referenced while promises are
/// outstanding, as a pending I/O request would be.
type Wake = ThreadsafeFunction<(), (), (), Status, false, true, 0>;

/// One Node environment's promises in flight.
struct Promises {
    waiting: Mutex<Vec<Delivery>>,
    /// Promises made and not yet settled; only the JavaScript thread changes it.
    outstanding: AtomicUsize,
    /// Of those, the promises of writes (see [`caller_waits`]).
    writes: AtomicUsize,
    wake: Wake,
    /// The environment, used only on its JavaScript thread.
    env: RawEnv,
}

struct RawEnv(sys::napi_env);

// SAFETY: used only on the environment's JavaScript thread (see `Promises::here`).
unsafe impl Send for RawEnv {}
// SAFETY: as for `Send`: other threads hold it but never use it.
unsafe impl Sync for RawEnv {}

thread_local! {
    /// The promises of the environment whose JavaScript thread this is (a
    /// worker thread is an environment of its own). An embedder may run
    /// another environment on this thread after the first ended: the first's
    /// function is then aborted, and a new one is made.
    static PROMISES: RefCell<Option<Arc<Promises>>> = const { RefCell::new(None) };
}

impl Promises {
    /// This environment's; `env` is the one whose JavaScript thread calls.
    fn of(env: &Env) -> Result<Arc<Self>> {
        PROMISES.with(|cell| {
            if let Some(promises) = cell.borrow().as_ref().filter(|p| !p.wake.aborted()) {
                return Ok(Arc::clone(promises));
            }
            let wake = env
                .create_function_from_closure::<(), (), _>("loamDeliver", |_| Ok(()))?
                .build_threadsafe_function::<()>()
                .callee_handled::<false>()
                .weak::<true>()
                .build_callback(|ctx: ThreadsafeCallContext<()>| {
                    // The wake-up runs on the JavaScript thread, whose promises these are.
                    let promises = PROMISES.try_with(|cell| cell.borrow().clone()).ok().flatten();
                    if let Some(promises) = promises {
                        promises.deliver(ctx.env.raw());
                    }
                    Ok(())
                })?;
            let promises = Arc::new(Promises {
                waiting: Mutex::new(Vec::new()),
                outstanding: AtomicUsize::new(0),
                writes: AtomicUsize::new(0),
                wake,
                env: RawEnv(env.raw()),
            });
            *cell.borrow_mut() = Some(Arc::clone(&promises));
            Ok(promises)
        })
    }

    /// Counts a new promise; the first one outstanding keeps the loop alive.
    fn made(&self, env: sys::napi_env, kind: Kind) {
        if kind == Kind::Write {
            self.writes.fetch_add(1, Ordering::Relaxed);
        }
        if self.outstanding.fetch_add(1, Ordering::Relaxed) == 0 {
            // SAFETY: on the JavaScript thread of the environment that made the function.
            unsafe { sys::napi_ref_threadsafe_function(env, self.wake.raw()) };
        }
    }

    /// Whether this is the JavaScript thread of these promises' environment.
    fn here(self: &Arc<Self>) -> bool {
        PROMISES.try_with(|cell| cell.borrow().as_ref().is_some_and(|p| Arc::ptr_eq(p, self))).unwrap_or(false)
    }

    /// From any thread.
    fn post(&self, delivery: Delivery) {
        let mut waiting = self.waiting.lock();
        let first = waiting.is_empty();
        waiting.push(delivery);
        drop(waiting);
        // One wake-up per non-empty mailbox: it delivers everything posted
        // before it runs. If the environment is gone the call fails, and the
        // delivery waits with nobody left to tell.
        if first {
            self.wake.call((), ThreadsafeFunctionCallMode::NonBlocking);
        }
    }

    /// A promise of `kind` was settled (on the JavaScript thread).
    fn settled(&self, kind: Kind) {
        if kind == Kind::Write {
            self.writes.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// On the JavaScript thread.
    fn deliver(&self, env: sys::napi_env) {
        let waiting = std::mem::take(&mut *self.waiting.lock());
        let count = waiting.len();
        for delivery in waiting {
            delivery(env);
        }
        self.released(env, count);
    }

    /// `count` promises were settled, on the JavaScript thread of `env`: the
    /// last one outstanding lets the loop go.
    fn released(&self, env: sys::napi_env, count: usize) {
        if count > 0 && self.outstanding.fetch_sub(count, Ordering::Relaxed) == count {
            // SAFETY: on the JavaScript thread of the environment that made the function.
            unsafe { sys::napi_unref_threadsafe_function(env, self.wake.raw()) };
        }
    }
}

/// Whether the calling thread is a JavaScript thread with at most one other
/// write of its own in flight (BullMQ's worker asks for its next job while it
/// completes the last): it would wait idle for the answer of the write it is
/// making, so the core may run that write here
/// (`RedbOptions::run_on_callers_thread`).
pub fn caller_waits() -> bool {
    PROMISES
        .try_with(|cell| cell.borrow().as_ref().is_some_and(|p| p.writes.load(Ordering::Relaxed) <= 1))
        .unwrap_or(false)
}

/// What a promise is for. A wait (for a job) is outstanding while its caller
/// goes on with other work, so it does not make the caller look busy the way
/// a write in flight does.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Write,
    Wait,
}

/// A promise's V8 resolver, which only its JavaScript thread touches.
struct Deferred(sys::napi_deferred);

// SAFETY: moved to other threads only to come back: it is used in a delivery,
// which runs on the JavaScript thread that made it.
unsafe impl Send for Deferred {}

/// The end that settles a promise made by [`promise`], from any thread, once.
/// Dropped unsettled, it rejects the promise, so none is left pending (which
/// would also keep Node's loop alive).
pub struct Resolver<T: ToNapiValue + Send + 'static> {
    deferred: Option<Deferred>,
    promises: Arc<Promises>,
    kind: Kind,
    _value: PhantomData<fn(T)>,
}

/// A promise for JavaScript and its [`Resolver`]. Call on the JavaScript thread.
pub fn promise<T: ToNapiValue + Send + 'static>(env: &Env, kind: Kind) -> Result<(Resolver<T>, PromiseRaw<'_, T>)> {
    let promises = Promises::of(env)?;
    let mut deferred = std::ptr::null_mut();
    let mut promise = std::ptr::null_mut();
    // SAFETY: `env` is live on this thread; both out-pointers are valid.
    check_status!(unsafe { sys::napi_create_promise(env.raw(), &mut deferred, &mut promise) })?;
    promises.made(env.raw(), kind);
    Ok((
        Resolver { deferred: Some(Deferred(deferred)), promises, kind, _value: PhantomData },
        PromiseRaw::new(env.raw(), promise),
    ))
}

impl<T: ToNapiValue + Send + 'static> Resolver<T> {
    /// Settles the promise. On its JavaScript thread (a write the core ran on
    /// the caller's thread, or one refused at once) it is settled now: its
    /// `await` goes on in this turn of the event loop, where a posted result
    /// would wait for the next one.
    pub fn settle(mut self, result: Result<T>) {
        let Some(deferred) = self.deferred.take() else { return };
        let env = self.promises.env.0;
        // A call that left an exception pending must see it, not have a
        // settlement take it (`settle_now` rejects with a pending exception).
        // SAFETY: `here` means this is `env`'s JavaScript thread.
        if self.promises.here() && unsafe { no_exception_pending(env) } {
            settle_now(env, deferred, result);
            self.promises.settled(self.kind);
            self.promises.released(env, 1);
            return;
        }
        self.post(deferred, result);
    }

    /// Settles on the JavaScript thread, from the mailbox.
    fn post(&self, deferred: Deferred, result: Result<T>) {
        let (promises, kind) = (Arc::clone(&self.promises), self.kind);
        self.promises.post(Box::new(move |env| {
            settle_now(env, deferred, result);
            promises.settled(kind);
        }));
    }
}

/// A promise that several parties race to settle (a wait, and the write that
/// wakes it, each on its own thread): the first settles it, the rest do
/// nothing.
pub struct FirstSettles<T: ToNapiValue + Send + 'static>(Arc<Mutex<Option<Resolver<T>>>>);

impl<T: ToNapiValue + Send + 'static> FirstSettles<T> {
    pub fn new(resolver: Resolver<T>) -> Self {
        Self(Arc::new(Mutex::new(Some(resolver))))
    }

    /// Settles the promise, unless it was settled already.
    pub fn settle(&self, result: Result<T>) {
        let resolver = self.0.lock().take();
        if let Some(resolver) = resolver {
            resolver.settle(result);
        }
    }
}

impl<T: ToNapiValue + Send + 'static> Clone for FirstSettles<T> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<T: ToNapiValue + Send + 'static> Drop for Resolver<T> {
    fn drop(&mut self) {
        if let Some(deferred) = self.deferred.take() {
            let dropped = Err(Error::new(
                Status::GenericFailure,
                "[loam:internal] the operation ended without a result".to_string(),
            ));
            self.post(deferred, dropped);
        }
    }
}

/// Resolves or rejects on the JavaScript thread, in a handle scope of its
/// own (a burst of results would otherwise keep every value alive until the
/// last is delivered).
fn settle_now<T: ToNapiValue>(env: sys::napi_env, deferred: Deferred, result: Result<T>) {
    let mut scope = std::ptr::null_mut();
    // SAFETY: on the JavaScript thread of `env`; closed below.
    unsafe { sys::napi_open_handle_scope(env, &mut scope) };
    // A conversion must not unwind into Node, nor leave its promise pending.
    let converted = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: on the JavaScript thread of `env`.
        result.and_then(|value| unsafe { T::to_napi_value(env, value) })
    }))
    .unwrap_or_else(|panic| Err(crate::error::panicked(panic)));
    // SAFETY: on the JavaScript thread of `env`, which made `deferred`; each
    // deferred is settled once (its resolver is consumed). A failed
    // conversion may leave a JavaScript exception pending, which would fail
    // every later call into Node: the promise is rejected with it instead.
    unsafe {
        match (take_exception(env), converted) {
            (Some(exception), _) => {
                sys::napi_reject_deferred(env, deferred.0, exception);
            }
            (None, Ok(value)) => {
                sys::napi_resolve_deferred(env, deferred.0, value);
            }
            (None, Err(error)) => {
                let reason = match ToNapiValue::to_napi_value(env, error) {
                    Ok(reason) => reason,
                    Err(_) => take_exception(env).unwrap_or_else(|| {
                        let mut undefined = std::ptr::null_mut();
                        sys::napi_get_undefined(env, &mut undefined);
                        undefined
                    }),
                };
                sys::napi_reject_deferred(env, deferred.0, reason);
            }
        }
        sys::napi_close_handle_scope(env, scope);
    }
}

/// Whether no JavaScript exception is pending on `env`.
///
/// # Safety
/// On the JavaScript thread of `env`.
unsafe fn no_exception_pending(env: sys::napi_env) -> bool {
    let mut pending = false;
    // SAFETY: the caller's.
    unsafe { sys::napi_is_exception_pending(env, &mut pending) };
    !pending
}

/// The JavaScript exception pending on `env`, cleared.
///
/// # Safety
/// On the JavaScript thread of `env`.
unsafe fn take_exception(env: sys::napi_env) -> Option<sys::napi_value> {
    // SAFETY: the caller's.
    unsafe {
        if no_exception_pending(env) {
            return None;
        }
        let mut exception = std::ptr::null_mut();
        sys::napi_get_and_clear_last_exception(env, &mut exception);
        Some(exception)
    }
}
