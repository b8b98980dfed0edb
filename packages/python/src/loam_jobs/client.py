"""`Client` (blocking) and `AsyncClient` (asyncio) for a `loam-jobs serve` server.

Both speak the Connect protocol (binary protobuf over HTTP/1.1, the
connectrpc default; gRPC would need HTTP/2) through the generated
`JobsServiceClientSync` / `JobsServiceClient` stubs, and share every
operation (`_ops.Operations`); they differ only in how a call is performed.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from queue import Empty, Full, Queue, SimpleQueue
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar, cast

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from pyqwest import SyncClient, SyncHTTPTransport

from ._gen.loam.jobs.v1.jobs_connect import JobsServiceClient, JobsServiceClientSync
from ._gen.loam.jobs.v1.jobs_pb import CompleteRequest, LeaseRequest, WatchRequest
from ._ops import (
    DEFAULT_RETRY_FOR_MS,
    BulkKeys,
    Call,
    Op,
    Operations,
    Pause,
    _retried,
    complete,
    last_event_seq,
    own_key_ttl_ms,
    retry_pause,
)
from .errors import (
    ClientClosedError,
    DeadlineExceededError,
    ForkedProcessError,
    InvalidArgumentError,
    LoamJobsError,
    QueuePausedError,
    UnavailableError,
    from_connect_error,
)
from .models import LeaseBatch, LeasedJob, QueueEvent, Release, optional_ms_not_zero, whole_ms

__all__ = ["AsyncClient", "AsyncWatch", "Client", "Watch", "DEFAULT_URL"]

DEFAULT_URL = "http://127.0.0.1:7720"
# The longest the server lets a watch's stream go without a message (a
# heartbeat when there is no event): `WATCH_HEARTBEAT` in the server's
# service/watch.rs, a constant, not a setting.
SERVER_WATCH_HEARTBEAT_MS = 5_000
# How long a watch's stream may bring nothing before it is taken for dead:
# four of the server's heartbeats.
DEFAULT_WATCH_IDLE_TIMEOUT_MS = 4 * SERVER_WATCH_HEARTBEAT_MS
# The shortest idle timeout a watch takes: a heartbeat, and a second for the
# server's read of the log and the network to deliver it.
MIN_WATCH_IDLE_TIMEOUT_MS = SERVER_WATCH_HEARTBEAT_MS + 1_000
# The header the server reads the namespace from when tokens are off (and
# checks against the token's namespace when they are on).
NAMESPACE_HEADER = "loam-namespace"

T = TypeVar("T")
S = TypeVar("S", JobsServiceClientSync, JobsServiceClient)


def _header_value(name: str, value: str) -> str:
    """`value`, refused unless a header can carry it as given: printable
    ASCII (a newline would end the header, and other bytes are sent as
    whatever the HTTP library makes of them)."""
    if not all(" " <= c <= "~" for c in value):
        raise InvalidArgumentError(f"the {name} must be printable ASCII: {value!r}")
    return value


def _headers(token: str | None, namespace: str | None) -> dict[str, str]:
    """The headers of every call, checked once when the client is made."""
    headers: dict[str, str] = {}
    if token:
        headers["authorization"] = f"Bearer {_header_value('token', token)}"
    if namespace:
        headers[NAMESPACE_HEADER] = _header_value("namespace", namespace)
    return headers


# Whether a client was made in this process, and whether the process was
# forked after one was: the HTTP runtime under the clients does not survive
# fork, and every call in the child hung, nothing raised (gunicorn --preload,
# multiprocessing's default start method on Linux).
_client_made = False
_forked_after_client = False


def _after_fork_in_child() -> None:
    global _forked_after_client, _idle_helpers_lock
    _forked_after_client = _forked_after_client or _client_made
    # The parent's helper threads are not in the child: work handed to one would wait for ever.
    _idle_helpers.clear()
    _idle_helpers_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


# When an AsyncClient call last ended. The HTTP runtime's threads still call
# into Python for a few ms after an asyncio call returns (they settle its
# futures through the event loop); one that does as the interpreter finalizes
# aborts the process (SIGABRT: pyqwest over PyO3 on Python before 3.14,
# PyO3 issue 6084). So the process waits out that moment before it finalizes.
_async_call_ended = 0.0
_SETTLE_SECONDS = 0.1


def _async_call_settled(_: asyncio.Future[Any]) -> None:
    global _async_call_ended
    _async_call_ended = time.monotonic()


@atexit.register
def _let_async_calls_settle() -> None:
    remaining = _SETTLE_SECONDS - (time.monotonic() - _async_call_ended)
    if _async_call_ended and remaining > 0:
        time.sleep(remaining)


def _usable() -> None:
    """Refuses a client this process cannot use."""
    global _client_made
    _not_forked()
    _client_made = True


def _callable(client: Client | AsyncClient) -> None:
    """Refuses a call on a client that was closed, or in a forked process."""
    _not_forked()
    if client._closed:
        raise _client_closed()


def _client_closed() -> ClientClosedError:
    return ClientClosedError("this loam_jobs client was closed; make a new one for further calls")


def _not_forked() -> None:
    if _forked_after_client:
        raise ForkedProcessError(
            "this process was forked after a loam_jobs client was made: the HTTP runtime under the clients "
            "does not survive fork, and every call would hang. Make clients only after forking"
        )


def _idle_seconds(idle_timeout_ms: int | None) -> float | None:
    """A watch's `idle_timeout_ms` in seconds: None, or a whole number of ms
    (a bool or a float would be read some other way than meant) of at least
    `MIN_WATCH_IDLE_TIMEOUT_MS`. Shorter, it takes the stream of an idle queue,
    whose first message is a heartbeat after 5 s, for dead: every stream
    fails, none resets the reconnect count, and the watch gives up on a
    healthy server. No server talks more often: the heartbeat is fixed."""
    if idle_timeout_ms is None:
        return None
    ms = whole_ms(idle_timeout_ms, "idle_timeout_ms")
    if ms < MIN_WATCH_IDLE_TIMEOUT_MS:
        raise InvalidArgumentError(
            f"request not sent: idle_timeout_ms must be at least {MIN_WATCH_IDLE_TIMEOUT_MS} (None: no "
            f"timeout), the server's heartbeat interval on an idle watch ({SERVER_WATCH_HEARTBEAT_MS} ms) "
            f"and a second for it to arrive: a shorter one can take every stream of an idle queue for dead"
        )
    return ms / 1000


def _client_timeout(timeout_ms: int | None) -> int | None:
    """`timeout_ms` as a client takes it (0 failed every call before it was
    sent, and with retries only after the whole retry budget)."""
    return optional_ms_not_zero(timeout_ms, "timeout_ms", "no bound", "fail every call")


def _timeout(client_timeout_ms: int | None, call: Call) -> int | None:
    # A long-poll is held by the server on purpose: the client's timeout
    # counts from when the server may answer, not from the request.
    if client_timeout_ms is None:
        return None
    return client_timeout_ms + call.wait_ms


def _stub(kind: type[S], url: str, compress_requests: bool, http_client: Any = None) -> S:
    if compress_requests:
        return kind(url, http_client=http_client)  # connectrpc's default: gzip every request
    # Most requests are a few hundred bytes, where gzip costs more CPU than
    # it saves; responses are still compressed when the server chooses to.
    return kind(url, send_compression=None, http_client=http_client)


# How long a watch's cancelled read may take to end.
_READ_CANCEL_SECONDS = 1.0
# How long a cancelled long-poll lease may go on to answer (it does at once
# when jobs are ready) before it is cancelled too.
_LONG_POLL_GRACE_SECONDS = 0.25


def _takes_jobs(call: Call) -> bool:
    """Whether `call` may lease jobs: a lease, or a completion that fetches
    the next ones."""
    return call.rpc == "lease" or _fetches_next(call)


def _fetches_next(call: Call) -> bool:
    """Whether `call` is a completion that fetches the next jobs: keyed, so
    sent again after its answer was lost it tells what it fetched."""
    if call.rpc != "complete":
        return False
    options = cast(CompleteRequest, call.request).options
    return options is not None and options.has_field("fetch_next")


def _taken(call: Call, response: Any) -> list[LeasedJob]:
    """The jobs `call` leased, by its `response`."""
    if call.rpc == "lease":
        return LeaseBatch.from_proto(cast(LeaseRequest, call.request).queue, response.leased).jobs
    if call.rpc == "complete" and response.has_field("completed"):
        return LeaseBatch.from_proto(cast(CompleteRequest, call.request).queue, response.completed.next).jobs
    return []


def _release(leased: LeasedJob, key_ttl_ms: int | None) -> Op[Any]:
    """Gives back a job its caller gave up on: it runs again at once, no
    attempt spent. Also once the client was closed (a `with` block left by
    the interruption): its connections open again for this. Its key lives
    as long as the client's own writes' do (`own_key_ttl_ms`), not a day."""
    return complete(leased.queue, leased.id, leased.fence(), Release(), key_ttl_ms=key_ttl_ms)


def _retry_budget(retry_for_ms: int) -> int:
    return whole_ms(retry_for_ms, "retry_for_ms")


def _pause_within(pause: Pause, retry_for_ms: int) -> float | None:
    """How long to wait before the retry `pause` comes before: no later than
    the end of the budget counted from its operation's first failure, with
    one last try then; None once the budget is spent (the retries are over)."""
    if pause.cause is None:
        return pause.seconds
    left = pause.since + retry_for_ms / 1000 - time.monotonic()
    return min(pause.seconds, left) if left > 0 else None


def _take_outcome(done: asyncio.Future[Any]) -> None:
    if not done.cancelled():
        done.exception()


def _cancellation(err: ConnectError) -> asyncio.CancelledError | None:
    """The asyncio cancellation that connectrpc reported as a `canceled`
    error, if that is what `err` is: it must reach the caller as itself, or
    `wait_for`, `asyncio.timeout` and `Task.cancel` stop working."""
    cause = err.__cause__
    return cause if isinstance(cause, asyncio.CancelledError) else None


def _silent_stream(seconds: float) -> ConnectError:
    """What a watch stream that brought nothing for its idle timeout fails with."""
    return ConnectError(Code.UNAVAILABLE, f"the watch stream brought nothing for {seconds:g} s")


# How long a helper thread with nothing to do waits for more before it ends.
_HELPER_IDLE_SECONDS = 1.0
# The helper threads waiting for something to do; a handoff to one costs
# a tenth of starting a thread.
_idle_helpers: list[_Helper] = []
_idle_helpers_lock = threading.Lock()


class _Helper(threading.Thread):
    """A daemon thread that runs what it is handed, one thing at a time, and
    ends once it has waited `_HELPER_IDLE_SECONDS` for more."""

    def __init__(self) -> None:
        super().__init__(name="loam-jobs helper", daemon=True)
        self._inbox: SimpleQueue[Callable[[], None]] = SimpleQueue()

    @staticmethod
    def start_soon(work: Callable[[], None]) -> None:
        """Runs `work` on an idle helper thread, or on a new one."""
        with _idle_helpers_lock:
            helper = _idle_helpers.pop() if _idle_helpers else None
        if helper is None:
            helper = _Helper()
            helper.start()
        helper._inbox.put(work)

    def run(self) -> None:
        while True:
            try:
                work = self._inbox.get(timeout=_HELPER_IDLE_SECONDS)
            except Empty:
                with _idle_helpers_lock:
                    if self in _idle_helpers:
                        _idle_helpers.remove(self)
                        return
                continue  # taken from the idle list as it timed out: its work is on the way
            work()
            with _idle_helpers_lock:
                _idle_helpers.append(self)


class _Waits:
    """Long-polls that run on helper threads while their callers wait where
    they can leave at once: on Ctrl-C (the HTTP runtime's blocking call holds
    signals off until it returns, up to 30 s), or when `close()` is called
    from another thread. A call left so runs on, and `abandoned` gets its
    outcome as it ends, on a helper thread (to give back the jobs it took).
    A watch's reads have their own (`_Pump`)."""

    def __init__(self, closed_error: Callable[[], BaseException]) -> None:
        self._closed_error = closed_error
        self._lock = threading.Lock()
        self._closed = False
        # Set as each waiting call ends, or by `close()`.
        self._waiting: set[threading.Event] = set()

    def close(self) -> None:
        """Ends every wait under way and refuses later ones, each with `closed_error()`."""
        with self._lock:
            self._closed = True
            waiting = list(self._waiting)
        for done in waiting:
            done.set()

    def run(self, send: Callable[[], Any], abandoned: Callable[[tuple[bool, Any]], None]) -> tuple[bool, Any]:
        """`send()`'s outcome: (True, what it returned) or (False, what it
        raised). Raises what ended the wait when the caller left first (a
        KeyboardInterrupt, `closed_error()`)."""
        done = threading.Event()
        lock = threading.Lock()
        outcome: list[tuple[bool, Any]] = []
        given_up = False
        with self._lock:
            if self._closed:
                raise self._closed_error()
            self._waiting.add(done)

        def call() -> None:
            try:
                answer = (True, send())
            except BaseException as err:  # noqa: BLE001 - handed to the waiting caller
                answer = (False, err)
            with lock:
                outcome.append(answer)
                left = given_up
            done.set()
            if left:
                abandoned(answer)

        try:
            _Helper.start_soon(call)
            done.wait()
            if self._closed:
                # An answer in as the waits closed is not handed out either.
                raise self._closed_error()
        except BaseException:
            with lock:
                given_up = True
                answered = outcome[0] if outcome else None
            if answered is not None:
                _Helper.start_soon(functools.partial(abandoned, answered))
            raise
        finally:
            with self._lock:
                self._waiting.discard(done)
        return outcome[0]


# The most messages a watch's pump reads ahead of its iterating thread: the
# server's flow control paces the stream beyond that.
_PUMP_AHEAD = 256
# How often a pump held up by a full queue looks whether it was stopped.
_PUMP_STOP_POLL_SECONDS = 0.1


class _Pump:
    """Reads a blocking watch's stream on a helper thread, ahead of the thread
    iterating the watch, which waits for each message where `close()` from
    another thread and Ctrl-C reach it at once (the HTTP runtime's blocking
    read holds both off until the server's next message: a heartbeat, up to
    5 s away, or for ever from a frozen server). Reading ahead, the stream
    costs a hand-off between threads only when the iterating thread waits
    (one per message cut a watch's rate to a third). Stopped, the read under
    way ends on its own thread, which then closes the stream, and the
    connections handed to `stop`."""

    def __init__(self, stream: Iterator[Any]) -> None:
        self._stream = stream
        # (True, message), or (False, what ended the stream: StopIteration, an error).
        self._messages: Queue[tuple[bool, Any]] = Queue(maxsize=_PUMP_AHEAD)
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._ended = False
        self._transport: SyncHTTPTransport | None = None
        _Helper.start_soon(self._run)

    def _run(self) -> None:
        try:
            ended = False
            while not ended and not self._stopped.is_set():
                try:
                    item: tuple[bool, Any] = (True, next(self._stream))
                except BaseException as err:  # noqa: BLE001 - handed to the iterating thread
                    item, ended = (False, err), True
                while not self._stopped.is_set():
                    try:
                        self._messages.put(item, timeout=_PUMP_STOP_POLL_SECONDS)
                        break
                    except Full:
                        continue
        finally:
            with contextlib.suppress(Exception):
                close = getattr(self._stream, "close", None)
                if close is not None:
                    close()
            with self._lock:
                self._ended = True
                transport, self._transport = self._transport, None
            if transport is not None:
                transport.close()

    def next_message(self) -> Any:
        """The stream's next message; raises what ended it (StopIteration, a
        ConnectError), or `_WatchStopped` once stopped."""
        ok, value = self._messages.get()
        if ok:
            return value
        raise value

    def stop(self, transport: SyncHTTPTransport | None = None) -> None:
        """Ends the pump, and wakes a thread waiting in `next_message`;
        `transport` is closed once the read under way has ended."""
        self._stopped.set()
        with self._lock:
            ended = self._ended
            if not ended:
                self._transport = transport
        if ended and transport is not None:
            transport.close()
        with contextlib.suppress(Full):
            self._messages.put_nowait((False, _WatchStopped()))


class _WatchStopped(Exception):
    """What a stopped pump hands a thread waiting for its next message."""


class _Reconnect:
    """When a watch reconnects: after a transport failure, with a growing
    pause, until `max_attempts` failures in a row. Any message resets it:
    the server sends one at least every few seconds (a heartbeat when there
    is no event), so a stream that reconnected and works is soon known to."""

    def __init__(self, max_attempts: int | None) -> None:
        self.max_attempts = max_attempts
        self.failures = 0

    def pause_after(self, err: LoamJobsError) -> float:
        """Seconds to wait before reconnecting; re-raises `err` when it is not
        worth another try."""
        if not isinstance(err, UnavailableError) or isinstance(err, QueuePausedError):
            # A refusal (a bad queue name, a token the server does not know):
            # reconnecting changes nothing. Unavailable is a server that is
            # unreachable or shutting down, which a reconnect outlasts.
            raise err
        self.failures += 1
        if self.max_attempts is not None and self.failures > self.max_attempts:
            raise err
        # Doubling from 50 ms reaches the 2 s cap at the seventh failure; the
        # exponent stops there, or a watch kept reconnecting through a long
        # outage would overflow a float at its 1,025th. Jittered as a write's
        # retries are, so that the watches a restart cut off do not all come
        # back at once, and never sooner than the server asked (a namespace
        # with no room for another waiting call asks for 1 s).
        return retry_pause(min(0.05 * 2.0 ** min(self.failures - 1, 6), 2.0), err)


def _receive(watch: Watch | AsyncWatch, response: Any) -> QueueEvent | None:
    """Takes a message of a watch's stream: the stream works (the reconnect
    count starts over) and the cursor moves to where the server read; the
    event, or None for a heartbeat."""
    watch._reconnect.failures = 0
    watch.cursor = max(watch.cursor or 0, response.cursor)
    if not response.has_field("event"):
        return None
    event = QueueEvent.from_proto(response.event)
    watch.cursor = max(watch.cursor, event.seq)
    return event


class Client(Operations):
    """A blocking client.

    >>> with Client("http://127.0.0.1:7720") as jobs:
    ...     jobs.enqueue("emails", "send", {"to": "a@b.c"})

    `token` is sent as `Authorization: Bearer <token>` (required when the
    server has tokens; the namespace is then the token's). `namespace` is
    sent in the `loam-namespace` header (without tokens it picks the
    namespace; default `default`). `timeout_ms` bounds each call (None: no
    bound); long-polls get their wait on top. A call that a repeat cannot do
    twice (a keyed write, a read, ...: see the README) and whose outcome is
    unknown (the server unreachable, busy or not answering in time) is sent
    again after pauses growing from 0.1 s to 2 s, the last one at the end of
    `retry_for_ms` (20 s, as the TypeScript client waits for a server that
    is away) from its first failure; 0 sends every call once. `compress_requests` gzips
    request bodies (worth it for large payloads over slow links).
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        token: str | None = None,
        namespace: str | None = None,
        *,
        timeout_ms: int | None = 30_000,
        retry_for_ms: int = DEFAULT_RETRY_FOR_MS,
        compress_requests: bool = False,
    ) -> None:
        _usable()
        self.url = url.rstrip("/")
        self.namespace = namespace
        self._headers = _headers(token, namespace)
        self._timeout_ms = _client_timeout(timeout_ms)
        self._retry_for_ms = _retry_budget(retry_for_ms)
        self._bulk_keys = BulkKeys()
        self._compress_requests = compress_requests
        self._closed = False
        # The long-polls under way, which `close()` ends.
        self._waits = _Waits(_client_closed)
        self.stub = _stub(JobsServiceClientSync, self.url, compress_requests)

    def _call(self, call: Call) -> Any:
        _not_forked()
        method = getattr(self.stub, call.rpc)
        timeout_ms = _timeout(self._timeout_ms, call)
        try:
            if call.wait_ms > 0:
                # A long-poll is waited for where Ctrl-C and `close()` reach the
                # caller at once (`_Waits`); a lease so given up runs on, and
                # the jobs it takes are given back (`Release`) as it returns,
                # if the process lives on (else they run again once their
                # locks expire).
                ok, answer = self._waits.run(
                    lambda: method(call.request, headers=self._headers, timeout_ms=timeout_ms),
                    functools.partial(self._give_back, call),
                )
                if ok:
                    return answer
                raise answer
            return method(call.request, headers=self._headers, timeout_ms=timeout_ms)
        except ConnectError as err:
            raise from_connect_error(err, call.request) from None

    def _give_back(self, call: Call, answer: tuple[bool, Any]) -> None:
        """Releases the jobs of a lease whose caller gave up waiting for it."""
        ok, response = answer
        if not ok:
            return
        for leased in _taken(call, response):
            with contextlib.suppress(LoamJobsError):
                self._drive(_release(leased, self._key_ttl_ms()))

    def _run(self, op: Op[T]) -> T:
        # Checked as an operation starts: one under way (its retries, its
        # further pages) ends as it would have.
        _callable(self)
        return self._drive(op)

    def _drive(self, op: Op[T]) -> T:
        # As `AsyncClient._drive`: a completion fetching the next job whose
        # outcome is unknown (its answer lost), while the operation pauses to
        # send it again.
        unknown: Call | None = None
        try:
            step = next(op)
            while True:
                if isinstance(step, Pause):
                    wait = _pause_within(step, self._retry_for_ms)
                    if wait is None and step.cause is not None:
                        step = op.throw(step.cause)
                        continue
                    try:
                        time.sleep(wait or 0)
                    except KeyboardInterrupt:
                        # Ctrl-C in the pause: the caller will not have the
                        # jobs the lost try may have fetched, so they go back.
                        if unknown is not None:
                            _Helper.start_soon(functools.partial(self._take_back, unknown))
                        raise
                    step = op.send(None)
                    continue
                unknown = None
                try:
                    response = self._call(step)
                except LoamJobsError as err:
                    if _fetches_next(step):
                        unknown = step
                    step = op.throw(err)
                else:
                    step = op.send(response)
        except StopIteration as done:
            return cast(T, done.value)

    def _take_back(self, call: Call) -> None:
        """As `AsyncClient._take_back`, on a helper thread: `call` sent again
        under its key, and the jobs its answer names given back."""
        with contextlib.suppress(LoamJobsError):
            self._give_back(call, (True, self._drive(_retried(call))))

    def watch(
        self,
        queue: str,
        *,
        after: int | None = None,
        job_id: str | None = None,
        max_reconnects: int | None = 10,
        idle_timeout_ms: int | None = DEFAULT_WATCH_IDLE_TIMEOUT_MS,
    ) -> Watch:
        """The queue's events from sequence `after` (None: from now on), live.

        Iterate it; it blocks for each new event. Its `cursor` is how far it
        has read the log: after a dropped connection it resumes from there by
        itself (up to `max_reconnects` failures in a row), and a later
        `watch(after=w.cursor)` continues where this one stopped. A stream
        that brings nothing for `idle_timeout_ms` is taken for dead (a frozen
        server, a connection lost without a word: the server sends a
        heartbeat at least every 5 s, so it must be at least 6 000) and the
        watch reconnects, as after any failure; None waits for ever. `job_id`
        keeps only that job's events (the cursor still moves past the
        others'). Close it (or use `with`) to stop; a `close()` from another
        thread ends the iteration at once (as Ctrl-C does), and an event that
        arrives meanwhile is neither handed out nor counted in the cursor.
        An iteration that ends with an error closes the watch's own
        connections too (iterated again, it opens new ones). `after=0` starts
        at the oldest event the log holds; a cursor the log has trimmed past
        raises `EventsTrimmedError` (events were lost).
        """
        idle = _idle_seconds(idle_timeout_ms)
        if after is None:
            # "From now on" is now, not the first iteration; a sequence also
            # lets a reconnect before the first event resume without a gap.
            after = self.last_event_seq(queue)
        return Watch(self, queue, after, job_id, _Reconnect(max_reconnects), idle)

    def close(self) -> None:
        """Ends the client. A long-poll under way (`lease`, `events` or
        `wait_for_job` with a wait, from another thread) raises
        `ClientClosedError` at once, and the jobs such a lease takes are
        given back; any other operation under way ends as it would have. One
        started later, or a watch's reconnect, raises `ClientClosedError`.
        Its connections are the process's pool, shared by every client (see
        the README's "Processes, signals and closing")."""
        self._closed = True
        self._waits.close()
        self.stub.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Watch(Iterator[QueueEvent]):
    """A live, resumable iterator over a queue's events (see `Client.watch`)."""

    def __init__(
        self,
        client: Client,
        queue: str,
        after: int | None,
        job_id: str | None,
        reconnect: _Reconnect,
        idle_timeout: float | None = None,
    ) -> None:
        self.queue = queue
        self.job_id = job_id
        # The last sequence seen (at first, the one it started after).
        self.cursor = after
        self._client = client
        # With an idle timeout, connections of its own whose every read gives
        # up after it (a blocking read cannot be abandoned any other way):
        # made as a stream opens, and closed when the iteration ends, by
        # `close()` or by an error (`_let_go`).
        self._idle_timeout = idle_timeout
        self._transport: SyncHTTPTransport | None = None
        self._own_stub: JobsServiceClientSync | None = None
        self._reconnect = reconnect
        # The open stream, read on a thread of its own (`_Pump`), which a
        # watch dropped without `close()` (a `for` loop left with `break`)
        # stops as it is collected, as its stream was closed then.
        self._pump: _Pump | None = None
        self._pump_finalizer: weakref.finalize[Any, Any] | None = None
        # The request of the stream opened last, for the error a refusal to encode it raises.
        self._request: WatchRequest | None = None
        self._closed = False
        # Set by `close()`: ends a pause before a reconnect at once.
        self._stopped = threading.Event()
        # Guards `_closed`, `_pump` and the connections together: a stream
        # must not open once `close()` has run, and each is let go once, by
        # whichever thread gets there first.
        self._lock = threading.Lock()
        # Held by the thread taking the next event: threads that iterate one
        # watch take its events in turns, each event once. Not `_lock`, which
        # `close()` takes while a thread waits for the next message.
        self._turn = threading.Lock()

    def _open(self) -> _Pump:
        """A stream from the cursor on; called under `_lock`."""
        request = self._request = WatchRequest(queue=self.queue, after=self.cursor, job_id=self.job_id)
        _callable(self._client)
        stub = self._client.stub
        if self._idle_timeout is not None:
            if self._own_stub is None:
                self._transport = SyncHTTPTransport(read_timeout=self._idle_timeout)
                client = self._client
                http_client = SyncClient(self._transport)
                self._own_stub = _stub(
                    JobsServiceClientSync, client.url, client._compress_requests, http_client
                )
            stub = self._own_stub
        pump = _Pump(stub.watch(request, headers=self._client._headers, timeout_ms=None))
        if self._pump_finalizer is not None:
            self._pump_finalizer.detach()  # its pump has ended
        self._pump_finalizer = weakref.finalize(self, pump.stop)
        return pump

    def __next__(self) -> QueueEvent:
        # Before the turn, and before anything is let go: in a process forked
        # while a stream was open, its pump is the parent's (no thread here
        # to fill it) and so are its connections, and the turn may have been
        # held by a thread of the parent's.
        _not_forked()
        # The turn is held until the stream is let go too: let go after it,
        # a failing thread could close the stream another thread had opened.
        with self._turn:
            return self._next_in_turn()

    def _next_in_turn(self) -> QueueEvent:
        try:
            return self._next_event()
        except BaseException:
            # The iteration is over: closed (StopIteration), or ended by an
            # error (a refusal, too many reconnects, a closed client, Ctrl-C).
            # The stream and the connections go now, not when the watch is
            # collected, which a traceback that holds it puts off; iterated
            # again after an error, it opens new ones. A failure to close
            # them does not stand in for the error that ended the iteration.
            with contextlib.suppress(Exception):
                self._let_go()
            raise

    def _next_event(self) -> QueueEvent:
        while True:
            try:
                with self._lock:
                    if self._closed:
                        break
                    if self._pump is None:
                        self._pump = self._open()
                    pump = self._pump
                response = pump.next_message()
            except _WatchStopped:
                break
            except StopIteration:
                # The server ended the stream (it is shutting down): reconnect.
                self._pump = None
                if self._closed:
                    break
                self._stopped.wait(self._reconnect.pause_after(UnavailableError("the watch stream ended")))
                continue
            except ConnectError as err:
                self._pump = None
                if self._closed:
                    break
                if err.code == Code.DEADLINE_EXCEEDED and self._idle_timeout is not None:
                    # The stream has no deadline: a read ran past the idle timeout.
                    err = _silent_stream(self._idle_timeout)
                self._stopped.wait(self._reconnect.pause_after(from_connect_error(err, self._request)))
                continue
            # A message read as the watch was closed (from another thread)
            # is dropped, and the cursor stays before it: an event is not
            # handed out after `close()` returned, and a watch from the
            # cursor brings it.
            with self._lock:
                if self._closed:
                    break
                event = _receive(self, response)
            if event is not None:
                return event
        raise StopIteration

    def close(self) -> None:
        """Stops the watch, from the thread iterating it or another: an
        iteration waiting for the server's next message ends at once
        (StopIteration), and the cursor stays before that message. Closing
        again does nothing."""
        with self._lock:
            self._closed = True
        self._stopped.set()
        self._let_go()

    def _let_go(self) -> None:
        """Stops the stream's pump, and closes the watch's own connections
        once its read under way has ended; each once, whichever threads get
        here."""
        with self._lock:
            pump, self._pump = self._pump, None
            transport, self._transport = self._transport, None
            self._own_stub = None
            finalizer, self._pump_finalizer = self._pump_finalizer, None
        if finalizer is not None:
            finalizer.detach()
        if pump is not None:
            pump.stop(transport)
        elif transport is not None:
            transport.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


if TYPE_CHECKING:
    # The same operations, declared as coroutines (generated from _ops.py).
    from ._gen.async_operations import AsyncOperations
else:
    AsyncOperations = Operations


def _as_coroutine_functions(cls: type[T]) -> type[T]:
    """Makes each operation `cls` inherits a coroutine function: a bad
    argument then raises where the call is awaited, as in any async API, not
    where the coroutine is made (in a `gather`, that left the others made
    before it never awaited)."""
    for name, method in vars(Operations).items():
        if name.startswith("_") or not callable(method) or name in vars(cls):
            continue

        def operation(method: Any) -> Any:
            @functools.wraps(method)
            async def call(self: Any, *args: Any, **kwargs: Any) -> Any:
                return await method(self, *args, **kwargs)

            return call

        setattr(cls, name, operation(method))
    return cls


@_as_coroutine_functions
class AsyncClient(AsyncOperations):
    """The asyncio client: the same methods as `Client`, each returning an
    awaitable, and `watch` returning an async iterator.

    >>> async with AsyncClient("http://127.0.0.1:7720") as jobs:
    ...     await jobs.enqueue("emails", "send", {"to": "a@b.c"})
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        token: str | None = None,
        namespace: str | None = None,
        *,
        timeout_ms: int | None = 30_000,
        retry_for_ms: int = DEFAULT_RETRY_FOR_MS,
        compress_requests: bool = False,
    ) -> None:
        _usable()
        self.url = url.rstrip("/")
        self.namespace = namespace
        self._headers = _headers(token, namespace)
        self._timeout_ms = _client_timeout(timeout_ms)
        self._retry_for_ms = _retry_budget(retry_for_ms)
        self._bulk_keys = BulkKeys()
        self._closed = False
        self.stub = _stub(JobsServiceClient, self.url, compress_requests)
        # Calls given up on that run on to give back what they take (with
        # each, its call), and the give-backs: held here, as asyncio holds
        # tasks only weakly.
        self._abandoned: dict[asyncio.Future[Any], Call] = {}
        self._giving_back: set[asyncio.Future[Any]] = set()
        # The long-polls under way, which `close()` gives up: set to end its
        # caller's wait, and the call it waits for.
        self._long_polls: dict[asyncio.Future[None], tuple[Call, asyncio.Future[Any]]] = {}

    async def _call(self, call: Call) -> Any:
        _not_forked()
        method = getattr(self.stub, call.rpc)
        if call.wait_ms > 0 and self._closed:
            # A long-poll of an operation under way as the client closed.
            raise _client_closed()
        # The request runs as a task of its own, so that a cancellation
        # reaches the caller at once, as itself: on Python 3.11 connectrpc's
        # `asyncio.wait_for` could swallow one that came with the answer, and
        # the caller went on as if never cancelled.
        sent = asyncio.ensure_future(
            method(call.request, headers=self._headers, timeout_ms=_timeout(self._timeout_ms, call))
        )
        sent.add_done_callback(_async_call_settled)
        # Set by `close()`, which gives up a long-poll under way as a
        # cancellation does (`_abandon`): its caller raises ClientClosedError.
        closing: asyncio.Future[None] | None = None
        try:
            if call.wait_ms > 0:
                closing = asyncio.get_running_loop().create_future()
                self._long_polls[closing] = (call, sent)
                try:
                    await asyncio.wait([sent, closing], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    del self._long_polls[closing]
                if closing.done():
                    raise _client_closed()
            return await asyncio.shield(sent)
        except asyncio.CancelledError:
            if closing is None or not closing.done():  # else `close()` gave it up already
                self._abandon(call, sent)
            raise
        except ConnectError as err:
            if cancelled := _cancellation(err):
                raise cancelled from None
            raise from_connect_error(err, call.request) from None

    def _abandon(self, call: Call, sent: asyncio.Future[Any]) -> None:
        """Gives up `call`, `sent` as `sent`, for a caller that no longer waits for it."""
        if _takes_jobs(call):
            # Its answer may be on its way, and a job leased to nobody
            # would wait for its lock to expire (and count a stall): let
            # it end, and give back what it took (`Release`).
            self._give_back_once_answered(call, sent)
        else:
            sent.cancel()
            sent.add_done_callback(_take_outcome)

    def _give_back_once_answered(self, call: Call, sent: asyncio.Future[Any]) -> None:
        if call.wait_ms > 0:
            # A long-poll answers at once when jobs are ready; else the
            # server waits, and a wait cancelled catches nothing. Left to run
            # for its whole wait, it would take jobs only to give them back
            # (each a lease started, and rate-limit budget spent).
            asyncio.get_running_loop().call_later(_LONG_POLL_GRACE_SECONDS, sent.cancel)

        def answered(done: asyncio.Future[Any]) -> None:
            self._abandoned.pop(done, None)
            if done.cancelled():
                return
            if (err := done.exception()) is not None:
                # Its answer lost on the way (the server may have applied it):
                # a keyed completion is sent again to learn what it fetched.
                unknown = isinstance(err, ConnectError) and isinstance(
                    from_connect_error(err, call.request), (UnavailableError, DeadlineExceededError)
                )
                if unknown and _fetches_next(call):
                    self._take_back(call)
                return
            self._give_back(_taken(call, done.result()))

        self._abandoned[sent] = call
        sent.add_done_callback(answered)

    def _take_back(self, call: Call) -> None:
        """Sends `call` again, with the retries of any keyed call (its outcome
        unknown most often because the server is away), and gives back the
        jobs its answer names. It is keyed (only keyed calls are sent again),
        so the server answers with what the lost try did, the jobs it fetched
        among it; left unsent, those jobs would be held by nobody until their
        locks expired, and count a stall."""

        async def again() -> None:
            with contextlib.suppress(LoamJobsError):
                self._give_back(_taken(call, await self._drive(_retried(call))))

        task = asyncio.ensure_future(again())
        self._giving_back.add(task)
        task.add_done_callback(self._giving_back.discard)

    def _give_back(self, jobs: list[LeasedJob]) -> None:
        """Releases `jobs`, which their caller gave up on, each in a task of
        its own that `close()` waits for."""
        for leased in jobs:
            release = asyncio.ensure_future(self._release_quietly(leased))
            self._giving_back.add(release)
            release.add_done_callback(self._giving_back.discard)

    async def _release_quietly(self, leased: LeasedJob) -> None:
        with contextlib.suppress(LoamJobsError):
            await self._drive(_release(leased, own_key_ttl_ms(self._timeout_ms, self._retry_for_ms)))

    async def _drive(self, op: Op[T]) -> T:
        # The calls of this operation that leased jobs, with their answers:
        # cancelled before it returns them (while it fails those that
        # stalled too often), it gives them back.
        leased: list[tuple[Call, Any]] = []
        # A keyed call that may have taken jobs (a completion fetching the
        # next) and failed with its outcome unknown (its answer lost), while
        # the operation pauses to send it again: cancelled then, it is sent
        # once more anyway (see `_take_back`). A lease has no key: sent again,
        # it would take other jobs, for nobody.
        unknown: Call | None = None
        try:
            step = next(op)
            while True:
                if isinstance(step, Pause):
                    wait = _pause_within(step, self._retry_for_ms)
                    if wait is None and step.cause is not None:
                        step = op.throw(step.cause)
                        continue
                    await asyncio.sleep(wait or 0)
                    step = op.send(None)
                    continue
                unknown = None
                try:
                    response = await self._call(step)
                except LoamJobsError as err:
                    if _fetches_next(step):
                        unknown = step
                    step = op.throw(err)
                else:
                    if _takes_jobs(step):
                        leased.append((step, response))
                    step = op.send(response)
        except StopIteration as done:
            return cast(T, done.value)
        except asyncio.CancelledError:
            for call, response in leased:
                self._give_back(_taken(call, response))
            if unknown is not None:
                self._take_back(unknown)
            raise

    def _run(self, op: Op[T]) -> Any:
        _callable(self)  # as `Client._run`
        return self._drive(op)

    def watch(
        self,
        queue: str,
        *,
        after: int | None = None,
        job_id: str | None = None,
        max_reconnects: int | None = 10,
        idle_timeout_ms: int | None = DEFAULT_WATCH_IDLE_TIMEOUT_MS,
    ) -> AsyncWatch:
        """Like `Client.watch`, as an async iterator. With `after=None`, "now"
        is when `async with` enters it (or, without `async with`, the first
        iteration), not this call: `after=await client.last_event_seq(queue)`
        starts from the call. A stream that brings nothing for `idle_timeout_ms` is taken
        for dead (a frozen server, a connection lost without a word: the
        server sends a heartbeat at least every 5 s, so it must be at least
        6 000) and the watch reconnects, as after any failure; None waits for
        ever."""
        idle = _idle_seconds(idle_timeout_ms)
        return AsyncWatch(self, queue, after, job_id, _Reconnect(max_reconnects), idle)

    async def close(self) -> None:
        """Like `Client.close`: a long-poll under way raises
        `ClientClosedError` at once, and is cancelled a moment later (the
        jobs it took meanwhile are given back). Also cancels the long-polls
        that cancelled calls left to answer (a job one took at that moment
        waits for its lock to expire), and waits for the other calls they
        left (a lease that does not wait, a completion fetching the next job:
        the server has them, and the jobs they took must go back) and for the
        give-backs of what they took."""
        self._closed = True
        for abandoned, call in list(self._abandoned.items()):
            if call.wait_ms > 0:
                abandoned.cancel()
        # The long-polls under way: their callers raise ClientClosedError now,
        # and each is given up as a cancelled one is, let run for a moment
        # (an answer on its way brings jobs to give back), then cancelled.
        for closing, (call, sent) in list(self._long_polls.items()):
            if not closing.done():  # else a close() under way gave it up
                closing.set_result(None)
                self._abandon(call, sent)
        # The give-backs end before the client does: a request still in
        # flight when the interpreter exits lets the HTTP runtime's thread
        # call into it as it finalizes, which aborts the process. A call that
        # ends may start give-backs, hence the loop. (A watch goes on until
        # its own close().)
        loop = asyncio.get_running_loop()
        deadline = None if self._timeout_ms is None else loop.time() + self._timeout_ms / 1000
        while self._abandoned or self._giving_back:
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                break
            await asyncio.wait([*self._abandoned, *self._giving_back], timeout=remaining)
        await self.stub.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


class AsyncWatch(AsyncIterator[QueueEvent]):
    """A live, resumable async iterator over a queue's events (see `AsyncClient.watch`)."""

    def __init__(
        self,
        client: AsyncClient,
        queue: str,
        after: int | None,
        job_id: str | None,
        reconnect: _Reconnect,
        idle_timeout: float | None = None,
    ) -> None:
        self.queue = queue
        self.job_id = job_id
        # The last sequence seen; None until the watch is entered or first iterated.
        self.cursor = after
        self._client = client
        self._reconnect = reconnect
        self._idle_timeout = idle_timeout
        self._stream: AsyncIterator[Any] | None = None
        self._request: WatchRequest | None = None  # as `Watch._request`
        self._closed = False
        # Set by `close()`: ends a pause before a reconnect at once.
        self._stopped = asyncio.Event()
        # The read under way, in a task of its own so that `close()` from
        # another task can cancel it (an async generator that is running
        # cannot be closed).
        self._read: asyncio.Future[Any] | None = None
        # Held by the task taking the next event, as `Watch._turn`: a second
        # task's read of the stream under way raised "asynchronous generator
        # is already running".
        self._turn = asyncio.Lock()

    def _open(self) -> AsyncIterator[Any]:
        request = self._request = WatchRequest(queue=self.queue, after=self.cursor, job_id=self.job_id)
        _callable(self._client)
        return self._client.stub.watch(request, headers=self._client._headers, timeout_ms=None)

    async def _next_message(self, stream: AsyncIterator[Any]) -> Any:
        read = self._read = asyncio.ensure_future(anext(stream))
        read.add_done_callback(_async_call_settled)
        # A read given up (cancelled, or past the idle timeout) ends with an
        # error nobody awaits: take it here, or asyncio logs it as lost.
        read.add_done_callback(_take_outcome)
        try:
            done, _ = await asyncio.wait([read], timeout=self._idle_timeout)
        except asyncio.CancelledError:
            # This task is cancelled (a timeout around `anext`, a shutdown):
            # so is its read, which ends before this task does (left pending,
            # `asyncio.run` reports it at shutdown as an unhandled error), and
            # the stream with it. The caller gave up, not the stream: the next
            # `anext` opens another from the cursor, with no pause and no
            # reconnect counted (counted, a loop that polls with a timeout
            # gave up on a healthy server after `max_reconnects` timeouts).
            read.cancel()
            await asyncio.wait([read], timeout=_READ_CANCEL_SECONDS)
            if self._stream is stream:
                self._stream = None
            raise
        finally:
            self._read = None
        if not done:
            read.cancel()
            await asyncio.wait([read])
            raise _silent_stream(self._idle_timeout or 0)
        if read.cancelled():
            # `close()` cancelled a read that had not started: its stream
            # never ran to turn the cancel into connectrpc's `canceled`. The
            # stream is over, and this task was not cancelled.
            raise StopAsyncIteration
        return read.result()

    async def __anext__(self) -> QueueEvent:
        async with self._turn:
            return await self._next_event()

    async def _next_event(self) -> QueueEvent:
        while not self._closed:
            try:
                if self._stream is None:
                    await self._pin_once()
                    if self._closed:
                        # Closed while the cursor was pinned: no stream to open.
                        break
                    self._stream = self._open()
                response = await self._next_message(self._stream)
            except StopAsyncIteration:
                self._stream = None
                if self._closed:
                    break
                await self._pause(self._reconnect.pause_after(UnavailableError("the watch stream ended")))
                continue
            except ConnectError as err:
                self._stream = None
                if cancelled := _cancellation(err):
                    if self._closed:
                        break
                    raise cancelled from None
                if self._closed:
                    break
                await self._pause(self._reconnect.pause_after(from_connect_error(err, self._request)))
                continue
            except LoamJobsError as err:
                # From pinning the cursor (last_event_seq), before the stream opens.
                await self._pause(self._reconnect.pause_after(err))
                continue
            # As `Watch`: nothing handed out after `close()`, and the cursor
            # stays before what was not.
            if self._closed:
                break
            if (event := _receive(self, response)) is not None:
                return event
        raise StopAsyncIteration

    async def _pause(self, seconds: float) -> None:
        """Waits `seconds` before a reconnect, or until `close()`."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopped.wait(), seconds)

    async def _pin(self) -> None:
        # "From now on" becomes a sequence, so that a reconnect before the
        # first event resumes without a gap.
        if self.cursor is None:
            self.cursor = await self._client.last_event_seq(self.queue)

    async def _pin_once(self) -> None:
        """`_pin` on the way to a stream: one try, which `close()` cuts short
        as it does a read; the watch's reconnects are its retries. Retried as
        a call, each reconnect to a server that was down took the client's
        whole retry budget (about 20 s), and `close()` waited for it."""
        if self.cursor is not None:
            return
        pin = self._read = asyncio.ensure_future(self._client._run(last_event_seq(self.queue, retried=False)))
        pin.add_done_callback(_take_outcome)
        try:
            await asyncio.wait([pin])
        except asyncio.CancelledError:
            pin.cancel()
            await asyncio.wait([pin], timeout=_READ_CANCEL_SECONDS)
            raise
        finally:
            self._read = None
        if not pin.cancelled():
            self.cursor = pin.result()

    async def close(self) -> None:
        """Stops the watch, from its own task or another: an iteration under
        way ends (StopAsyncIteration) instead of waiting for an event."""
        self._closed = True
        self._stopped.set()
        read = self._read
        if read is not None:
            read.cancel()
            await asyncio.wait([read])
        stream, self._stream = self._stream, None
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(RuntimeError):
                await aclose()

    async def __aenter__(self) -> Self:
        await self._pin()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
