"""Every client operation, written once for the sync and the async client.

An operation is a generator: it yields a `Call` (which RPC, which request)
and is sent the response; its return value is what the public method
returns. `Client` drives it with blocking calls and `AsyncClient` with
awaited ones, so the two clients cannot drift apart, and operations that
take several calls (obliterate in chunks, a lease wait longer than the
server's 30 s cap) are written once too.
"""

from __future__ import annotations

import inspect
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, TypeVar, Unpack, overload

from protobuf import Message, Oneof

from ._gen.loam.jobs.v1.events_pb import EventField
from ._gen.loam.jobs.v1.jobs_pb import (
    CompleteRequest,
    EnqueueBulkRequest,
    EnqueueRequest,
    EnqueueResponse,
    ExtendItem,
    ExtendRequest,
    ExtendResponse,
    FlowRequest,
    JobAdminRequest,
    JobAdminResponse,
    LeaseRequest,
    QueryRequest,
    QueueAdminRequest,
    QueueAdminResponse,
    ReportRequest,
    ReportResponse,
    ResultDeleteRequest,
    ResultDeleteResponse,
    ResultExpireRequest,
    ResultExpireResponse,
    ResultGetRequest,
    ResultGetResponse,
    ResultIncrRequest,
    ResultMGetRequest,
    ResultSetRequest,
    SchedulerAdvance,
    ScheduleRequest,
    UnscheduleRequest,
    UnscheduleResponse,
)
from ._gen.loam.jobs.v1.types_pb import (
    CompleteOptions,
    Dependency,
    DependencyStatus,
    Enqueued,
    Fence,
    FlowNode,
    Idempotency,
    Job,
    JobSpec,
    JobState,
    Keep,
    LeaseOptions,
    Metrics,
    QueueConfig,
    RateLimit,
    Retention,
    Scheduler,
    SchedulerSpec,
    ServerSchedule,
)
from .errors import (
    UNENCODABLE,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    LoamJobsError,
    NotFoundError,
    QueuePausedError,
    UnavailableError,
    from_bulk_error,
)
from .models import (
    CompleteResult,
    JobOptions,
    LeaseBatch,
    LeasedJob,
    OutcomeSpec,
    QueueEvent,
    Success,
    TickJobOptions,
    WorkerSeen,
    decode_json,
    encode_data,
    encode_json,
    idempotent,
    job,
    lease_options,
    optional_ms_not_zero,
    own_key,
    retention,
    text_list,
    whole_ms,
)

# The server caps one long-poll at 30 s; longer waits are several calls.
SERVER_MAX_WAIT_MS = 30_000
# BullMQ's default length of a queue's event log (its maxLenEvents); the
# server trims to whatever a publish names, 0 included.
DEFAULT_MAX_EVENTS = 10_000

T = TypeVar("T")


class NotGiven(Enum):
    """The default of a keyword for which None is a value (JSON null)."""

    NOT_GIVEN = "not given"


NOT_GIVEN = NotGiven.NOT_GIVEN


@dataclass(frozen=True)
class Call:
    # The generated stub's method name (`enqueue`, `queue_admin`, ...).
    rpc: str
    request: Message
    # How long the server may hold the call on purpose (a long-poll), on top
    # of the client's own timeout.
    wait_ms: int = 0


@dataclass(frozen=True)
class Pause:
    # A wait between two calls of an operation (before a retry): the blocking
    # client sleeps, the async one awaits.
    seconds: float
    # Before a retry: the failure it follows, and when the operation's first
    # failure was (`time.monotonic()`). A client whose retry budget
    # (`retry_for_ms`) is spent throws `cause` back instead.
    cause: LoamJobsError | None = None
    since: float = 0.0


# An operation: it yields calls (and pauses) and is sent each call's
# response; a call that fails is thrown into it as its `LoamJobsError`, so an
# operation can retry or carry on past a failure it expects.
Op = Generator[Call | Pause, Any, T]

# The longest pauses before each retry of a call whose outcome is unknown
# (the server was unreachable, busy, or did not answer in time), in seconds;
# each is drawn at random (`retry_pause`). Only calls that are safe to repeat
# are retried: those that carry idempotency keys (an enqueue, a bulk one, a
# completion, a report, a flow's nodes), reads that do not wait, lock
# extensions (fenced: a repeat sets the same lock, or is refused once the
# lease is gone) and leases, except after a timeout (a job whose lease answer
# was lost stays active until its lock lapses and it is found stalled, as
# when a worker dies holding it), administration that a repeat leaves as it
# was (`_REPEATABLE_ADMIN`), and the result store's sets and expiries. Other
# writes raise: telling a try the server never read from one whose answer was
# lost needs more than the HTTP library says.
RETRY_PAUSES = (0.1, 0.4, 1.6)
# The longest pause before each later retry, while the client's budget lasts.
LATER_RETRY_PAUSE = 2.0
# How long a client goes on sending again a call whose outcome is unknown,
# from its first failure: as long as the TypeScript client waits for a server
# that is away (`reconnectTimeoutMs`), so that both ride out a restart.
DEFAULT_RETRY_FOR_MS = 20_000
# The longest server's retry-after (seconds) a retry or a watch's reconnect
# waits out: the server asks for 0.1 s (busy) or 1 s (too many waiting calls),
# and a longer ask would hold a write past what its key's TTL counts on.
MAX_RETRY_AFTER = 2.0

# Jitter from the OS, not from `random`'s shared generator: a program that
# seeds that one (`random.seed(0)` in each of its processes) would draw the
# same pauses in every process, in step again.
_jitter = random.SystemRandom()


def retry_pause(pause: float, err: LoamJobsError) -> float:
    """How long to wait before sending again a call that failed with `err`,
    `pause` being the longest this retry waits unless the server asks for
    more: a random point of the upper half of `pause`, and no less than the
    server's retry-after (up to `MAX_RETRY_AFTER`)."""
    # Equal jitter (the upper half) rather than full jitter (0 to `pause`):
    # clients refused together (a restart, an overload) still spread over
    # half of each pause, and no two draw the same, while one client's tries
    # keep at least half their spacing (1.05 s of a write's 2.1 s, enough to
    # outlast a short restart), where full jitter could spend all four within
    # a few ms of the first refusal.
    jittered = pause * (1 + _jitter.random()) / 2
    return max(jittered, min(err.retry_after_ms / 1000, MAX_RETRY_AFTER))


def own_key_ttl_ms(timeout_ms: int | None, retry_for_ms: int = DEFAULT_RETRY_FOR_MS) -> int | None:
    """How long the server keeps the idempotency key an enqueue gets of its
    own: past the last retry of a call bounded by `timeout_ms` (the first
    try fails within `timeout_ms`, the last starts within `retry_for_ms` of
    that failure and reaches the server within `timeout_ms` more), with a
    minute to spare (for clocks). Kept for the server's default of a
    day, the keys of a client adding a thousand jobs a second were 86 million
    live records. Calls without a bound (None) keep that default, and so do
    calls whose bound is past what the request's 64-bit field holds
    (`sys.maxsize`, as good as none: it failed every write with an
    unencodable TTL)."""
    if timeout_ms is None:
        return None
    ttl_ms = 2 * timeout_ms + retry_for_ms + 60_000
    return ttl_ms if ttl_ms < 1 << 63 else None


@dataclass(frozen=True)
class ScheduleResult:
    # The pending iteration's job; None when the schedule has run out.
    job_id: str | None
    delay_ms: int


@dataclass(frozen=True)
class IncrResult:
    # Members counted so far.
    count: int
    # Whether this call added the member (False for a repeat).
    added: bool


@dataclass(frozen=True)
class LogPage:
    logs: list[str]
    count: int


@dataclass(frozen=True)
class Dependencies:
    # The page asked for.
    dependencies: list[Dependency]
    # With `with_jobs`: each child's job (None when it no longer exists).
    jobs: list[Job | None]
    # How many children of the status asked for there are, in and out of the page.
    total: int = 0


def _present(message: Message, name: str) -> Any:
    """An optional field's value, or None when unset."""
    return getattr(message, name) if message.has_field(name) else None


def _fence(target: LeasedJob | str, epoch: int | None, token: str | None, unchecked: bool) -> Fence:
    given = sum(x is not None for x in (epoch, token)) + (1 if unchecked else 0)
    if given > 1:
        raise InvalidArgumentError("give at most one of epoch, token and unchecked")
    if epoch is not None:
        return Fence(kind=Oneof[Literal["epoch"], int]("epoch", epoch))
    if token is not None:
        return Fence(kind=Oneof[Literal["token"], str]("token", token))
    if unchecked:
        return Fence(kind=Oneof[Literal["unchecked"], bool]("unchecked", True))
    if isinstance(target, LeasedJob):
        return target.fence()
    raise InvalidArgumentError("a job id needs a fence: epoch=, token= or unchecked=True")


def _target(target: LeasedJob | str, queue: str | None) -> tuple[str, str]:
    """The queue and job id a fenced call is about."""
    if isinstance(target, LeasedJob):
        return queue or target.queue, target.id
    if not queue:
        raise InvalidArgumentError("a job id needs its queue: pass queue=")
    return queue, target


def _job_slot_list(slots: Iterable[Any]) -> list[Job | None]:
    return [slot.job if slot.has_field("job") else None for slot in slots]


# Producing


def _answered(value: T) -> Op[T]:
    """An operation answered without a call: `value`, from either driver."""
    return value
    yield  # a generator, as every operation is


def _once(call: Call) -> Op[Any]:
    """`call`, not sent again whatever becomes of it."""
    return (yield call)


def _retried(
    call: Call | Callable[[], Call],
    unknown: tuple[type[LoamJobsError], ...] = (UnavailableError, DeadlineExceededError),
    key: Idempotency | None = None,
) -> Op[Any]:
    """`call` (or a call made anew for each try), tried again after a pause
    (`RETRY_PAUSES`, then `LATER_RETRY_PAUSE`, each drawn by `retry_pause`)
    while it fails with one of `unknown` (its outcome unknown), until the
    client's retry budget, counted from the first failure, is spent: counted
    from the first try, a try that ran out its own timeout spent it all, and
    the call that most needs a retry got none. The caller makes sure a repeat
    cannot do the work twice; `key` is the write's idempotency key, which the
    error it ends with carries."""
    first_try = time.monotonic()
    first_failure: float | None = None
    tries = 0
    while True:
        tries += 1
        try:
            return (yield call if isinstance(call, Call) else call())
        except unknown as err:
            # A paused queue is an answer, not an unknown outcome.
            if isinstance(err, QueuePausedError):
                raise _tried(err, tries, key, None) from None
            if first_failure is None:
                first_failure = time.monotonic()
            bound = RETRY_PAUSES[tries - 1] if tries <= len(RETRY_PAUSES) else LATER_RETRY_PAUSE
            try:
                yield Pause(retry_pause(bound, err), err, first_failure)
            except LoamJobsError as spent:
                raise _tried(spent, tries, key, first_try) from None
        except LoamJobsError as err:
            raise _tried(err, tries, key, None) from None


def _tried(
    err: LoamJobsError, tries: int, key: Idempotency | None, given_up_since: float | None
) -> LoamJobsError:
    """`err`, the last try's, with how many tries were made and, when a try
    may have been applied (its outcome unknown), the write's key. Once
    the retries are over (`given_up_since`, the first try's time) its message
    says so, and how long the key lets the write be sent again under it
    (`idempotency_key=`) and still be applied at most once."""
    err.tries = tries
    if key is not None and (tries > 1 or given_up_since is not None):
        err.idempotency_key = key.key
    if given_up_since is None:
        return err
    seconds = time.monotonic() - given_up_since
    tried = f"{tries} {'try' if tries == 1 else 'tries'} over {seconds:.1f} s"
    again = ""
    if err.idempotency_key is not None and key is not None:
        if key.has_field("ttl_ms"):
            left = max(key.ttl_ms / 1000 - seconds, 0)
            within = f"within {left:.0f} s (the server then forgets the key)"
        else:
            within = "within a day (the server's default for a key)"
        again = (
            f"; an earlier try may have been applied: send it again with "
            f"idempotency_key={err.idempotency_key!r} {within}"
        )
    err.message = f"{err.message} (gave up after {tried}{again})"
    return err


def enqueue(queue: str, spec: JobSpec, key_ttl_ms: int | None = None) -> Op[Enqueued]:
    keyed = idempotent(spec, key_ttl_ms)
    resp: EnqueueResponse = yield from _retried(
        Call("enqueue", EnqueueRequest(queue=queue, job=keyed)),
        key=keyed.idempotency,
    )
    if resp.enqueued is None:
        raise InternalError("the server answered an enqueue with no job")
    return resp.enqueued


# What building or encoding a request raises for a value the wire cannot
# carry (a wrong type, a number out of range; NaN in JSON is our own
# InvalidArgumentError).
_UNSENDABLE = (*UNENCODABLE, InvalidArgumentError)

# The keys of a job given to enqueue_bulk as a mapping: enqueue's parameters,
# which are job()'s.
_JOB_KEYS = frozenset(inspect.signature(job).parameters)


def _bulk_job_spec(index: int, item: JobSpec | Mapping[str, Any]) -> JobSpec:
    """Job `index` of an enqueue_bulk as a JobSpec: a mapping is built by
    job(), as enqueue builds its job, and refused as enqueue would refuse its
    keywords: TypeError for a key it does not take, InvalidArgumentError for
    a value the wire cannot carry, naming the index and the key."""
    if isinstance(item, JobSpec):
        return item
    if not isinstance(item, Mapping):
        raise TypeError(f"enqueue_bulk: job {index} is a {type(item).__name__}, not a JobSpec or a mapping")
    if unknown := [key for key in item if key not in _JOB_KEYS]:
        raise TypeError(f"enqueue_bulk: job {index} has an unknown key {unknown[0]!r}")
    if "name" not in item:
        raise TypeError(f"enqueue_bulk: job {index} has no 'name'")
    try:
        spec = job(**item)
        # The stub only says that the whole request cannot be encoded; this
        # says which job, before any is sent.
        spec.to_binary()
    except _UNSENDABLE as err:
        key = next((key for key in item if not _sendable({"name": "", key: item[key]})), None)
        at = f"job {index}" if key is None else f"job {index}, key {key!r}"
        raise InvalidArgumentError(f"request not sent: enqueue_bulk {at}: {err.__cause__ or err}") from err
    return spec


def _sendable(fields: Mapping[str, Any]) -> bool:
    try:
        job(**fields).to_binary()
    except _UNSENDABLE:
        return False
    return True


@dataclass
class BulkKeys:
    """What a client learned of its server: whether it keeps a bulk add's key
    for the whole call (`EnqueueBulkResponse.key_kept`)."""

    kept: bool = False


def enqueue_bulk(
    queue: str,
    specs: Iterable[JobSpec],
    all_or_nothing: bool = False,
    key_ttl_ms: int | None = None,
    keys: BulkKeys | None = None,
) -> Op[list[Enqueued | LoamJobsError]]:
    # One key for the call: the server keeps one record for it, where a key
    # for each job cost one a job. Jobs with keys of their own keep them, and
    # every job gets one too until the server has said it keeps the call's
    # (`keys`): a server from before such keys ignores them.
    kept = keys is not None and keys.kept
    jobs = list(specs) if kept else [idempotent(spec, key_ttl_ms) for spec in specs]
    request = EnqueueBulkRequest(
        queue=queue, jobs=jobs, all_or_nothing=all_or_nothing, idempotency=own_key(key_ttl_ms)
    )
    resp = yield from _retried(Call("enqueue_bulk", request))
    if keys is not None and resp.key_kept:
        keys.kept = True
    results: list[Enqueued | LoamJobsError] = []
    for item in resp.results:
        match item.result:
            case Oneof(field="enqueued", value=enqueued):
                results.append(enqueued)
            case Oneof(field="error", value=error):
                results.append(from_bulk_error(error))
            case _:
                results.append(InternalError("the server returned an empty bulk result"))
    return results


def flow(nodes: Sequence[FlowNode], key_ttl_ms: int | None = None) -> Op[list[Enqueued]]:
    # Each node under a key of its own, as an enqueue: the flow is retried,
    # and a repeat answers the jobs the first try made.
    keyed = [
        FlowNode(
            queue=node.queue,
            job=None if node.job is None else idempotent(node.job, key_ttl_ms),
            wait_children=node.wait_children,
        )
        for node in nodes
    ]
    resp = yield from _retried(Call("flow", FlowRequest(nodes=keyed)))
    return list(resp.enqueued)


# Working


def lease(queue: str, options: LeaseOptions, wait_ms: int) -> Op[LeaseBatch]:
    # Wait in server-sized slices until a job comes or the caller's wait ends.
    deadline = time.monotonic() + wait_ms / 1000

    def remaining_ms() -> int:
        return max(0, int((deadline - time.monotonic()) * 1000))

    def one_slice() -> Call:
        # A retry waits only for what is left of the caller's wait.
        slice_ms = min(remaining_ms(), SERVER_MAX_WAIT_MS)
        request = LeaseRequest(queue=queue, options=_failing_deferred(options), wait_ms=slice_ms)
        return Call("lease", request, wait_ms=slice_ms)

    while True:
        remaining = remaining_ms()
        started = time.monotonic()
        # Not after a timeout: the server is then most likely slow, not
        # gone, and applies the first try too; each repeat would hold up to
        # `max` more jobs for nobody until their locks lapse.
        resp = yield from _retried(one_slice, (UnavailableError,))
        batch = LeaseBatch.from_proto(queue, resp.leased)
        if batch.jobs or remaining <= SERVER_MAX_WAIT_MS:
            return batch
        if (time.monotonic() - started) * 1000 < SERVER_MAX_WAIT_MS - _EARLY_END_MS:
            # The server ended the wait early with nothing (it is shutting
            # down): answered as a wait of one slice is, not sent again into
            # a server that is going away.
            return batch


# How much sooner than asked an empty lease must end to have been cut short.
_EARLY_END_MS = 1_000


def _failing_deferred(options: LeaseOptions) -> LeaseOptions:
    """`options`, given `fail_deferred`: the server fails the jobs marked
    with a `deferred_failure` (stalled more often than the queue's
    `max_stalled` allows, or a parent whose child failed under
    fail_parent_on_failure) in the lease's own transaction, where a client
    that failed them itself, as BullMQ's worker does, would leave them held
    until their locks lapsed if it died in between."""
    # Set on the caller's options, not a copy: copying means encoding them,
    # which the call's own encoding must be first to refuse when a value
    # does not fit the wire.
    options.fail_deferred = True
    return options


def extend_one(target: LeasedJob, duration_ms: int, fence: Fence) -> Op[int]:
    item = ExtendItem(job_id=target.id, fence=fence)
    resp: ExtendResponse = yield from _retried(
        Call("extend", ExtendRequest(queue=target.queue, items=[item], duration_ms=duration_ms))
    )
    target.deadline = resp.deadline
    return resp.deadline


def extend_many(queue: str, items: Sequence[tuple[str, Fence]], duration_ms: int) -> Op[list[str]]:
    request = ExtendRequest(
        queue=queue,
        items=[ExtendItem(job_id=job_id, fence=fence) for job_id, fence in items],
        duration_ms=duration_ms,
    )
    try:
        resp = yield from _retried(Call("extend", request))
    except (FailedPreconditionError, NotFoundError):
        if len(items) == 1:
            # With one item the server answers with that item's refusal, not a list.
            return [items[0][0]]
        raise
    return list(resp.failed_job_ids)


def complete(
    queue: str,
    job_id: str,
    fence: Fence,
    outcome: OutcomeSpec,
    fetch_next: LeaseOptions | None = None,
    remove_on_complete: Retention | None = None,
    remove_on_fail: Retention | None = None,
    metrics_max_points: int | None = None,
    rate_limit_ttl_for: RateLimit | None = None,
    key_ttl_ms: int | None = None,
) -> Op[CompleteResult]:
    # Keyed, the completion is safe to send again: the server answers a
    # repeat with what it first did (and the jobs it fetched then), where an
    # unkeyed repeat of a completion that was made finds its lease gone.
    options = CompleteOptions(
        fetch_next=None if fetch_next is None else _failing_deferred(fetch_next),
        remove_on_complete=remove_on_complete,
        remove_on_fail=remove_on_fail,
        metrics_max_points=metrics_max_points,
        idempotency=own_key(key_ttl_ms),
    )
    request = CompleteRequest(
        queue=queue,
        job_id=job_id,
        fence=fence,
        outcome=outcome.to_proto(),
        options=options,
        rate_limit_ttl_for=rate_limit_ttl_for,
    )
    resp = yield from _retried(Call("complete", request))
    completed = resp.completed
    following = LeaseBatch.from_proto(queue, completed.next if completed else None)
    return CompleteResult(
        state=completed.state if completed else JobState.UNSPECIFIED,
        finished_on=_present(completed, "finished_on") if completed else None,
        moved=completed.moved if completed else False,
        next=following,
        rate_limit_ttl_ms=_present(resp, "rate_limit_ttl_ms"),
    )


ReportBody = (
    Oneof[Literal["progress"], str] | Oneof[Literal["log"], ReportRequest.Log] | Oneof[Literal["data"], bytes]
)


def _chosen(field_name: str, value: Any) -> Any:
    """A oneof whose member the caller names at run time, which no static
    type can follow: the admin and query helpers take the field by name."""
    return Oneof(field_name, value)


def report(
    queue: str, job_id: str, fence: Fence, report: ReportBody, key_ttl_ms: int | None = None
) -> Op[int]:
    # Keyed so that a repeat adds no second log line or progress event.
    request = ReportRequest(
        queue=queue,
        job_id=job_id,
        fence=fence,
        report=report,
        idempotency=own_key(key_ttl_ms),
    )
    resp: ReportResponse = yield from _retried(Call("report", request))
    return resp.log_count


# Schedules


def schedule_server(queue: str, spec: ServerSchedule) -> Op[ScheduleResult]:
    resp = yield Call(
        "schedule",
        ScheduleRequest(queue=queue, schedule=Oneof[Literal["server"], ServerSchedule]("server", spec)),
    )
    return ScheduleResult(job_id=_present(resp, "job_id"), delay_ms=resp.delay_ms)


def schedule_upsert(queue: str, spec: SchedulerSpec) -> Op[ScheduleResult]:
    resp = yield Call(
        "schedule",
        ScheduleRequest(queue=queue, schedule=Oneof[Literal["upsert"], SchedulerSpec]("upsert", spec)),
    )
    return ScheduleResult(job_id=_present(resp, "job_id"), delay_ms=resp.delay_ms)


def schedule_advance(queue: str, advance: SchedulerAdvance) -> Op[ScheduleResult]:
    resp = yield Call(
        "schedule",
        ScheduleRequest(
            queue=queue, schedule=Oneof[Literal["advance"], SchedulerAdvance]("advance", advance)
        ),
    )
    return ScheduleResult(job_id=_present(resp, "job_id"), delay_ms=resp.delay_ms)


def unschedule(queue: str, scheduler_id: str) -> Op[bool]:
    resp: UnscheduleResponse = yield Call(
        "unschedule", UnscheduleRequest(queue=queue, scheduler_id=scheduler_id)
    )
    return resp.removed


# Queue administration


# Administration that a repeat leaves as the first try did, and whose answer
# does not say what the try itself did: these are sent again when their
# outcome is unknown. Draining, cleaning, sweeping and the counts of meta
# fields or events removed are not: a repeat acts on what came meanwhile, or
# answers 0 for what the lost try did. Nor is obliterate: its last chunk
# removes the queue, its pause with it, and a repeat is refused as a queue
# not paused (`obliterate` pauses first, so calling it again works).
_REPEATABLE_ADMIN = frozenset(
    {"pause", "resume", "set_config", "set_rate_limit", "register_worker", "retry_jobs", "promote_jobs"}
)


def queue_admin(queue: str, field_name: str, value: Any) -> Op[QueueAdminResponse]:
    call = Call("queue_admin", QueueAdminRequest(queue=queue, op=_chosen(field_name, value)))
    resp: QueueAdminResponse = yield from (_retried(call) if field_name in _REPEATABLE_ADMIN else _once(call))
    return resp


def queue_admin_until_done(queue: str, field_name: str, value: Any) -> Op[None]:
    """Obliterate, retry and promote work in chunks: call again while `more`."""
    while True:
        resp = yield from queue_admin(queue, field_name, value)
        if not resp.more:
            return None


def _pause_then(queue: str, op: Op[T]) -> Op[T]:
    yield from queue_admin(queue, "pause", True)
    return (yield from op)


def set_config(queue: str, changes: Mapping[str, Any]) -> Op[None]:
    current = (yield from query(queue, "config", True)) or QueueConfig()
    dead_letter_queue = changes.get("dead_letter_queue", _present(current, "dead_letter_queue"))
    config = QueueConfig(
        max_stalled=changes.get("max_stalled", current.max_stalled),
        stalled_interval_ms=changes.get("stalled_interval_ms", current.stalled_interval_ms),
        dead_letter_queue=dead_letter_queue or None,
        dead_letter_on_exhausted=changes.get("dead_letter_on_exhausted", current.dead_letter_on_exhausted),
    )
    yield from queue_admin(queue, "set_config", config)
    return None


def job_admin(queue: str, job_id: str, field_name: str, value: Any) -> Op[bool]:
    resp: JobAdminResponse = yield Call(
        "job_admin", JobAdminRequest(queue=queue, job_id=job_id, op=_chosen(field_name, value))
    )
    return resp.done


# Reads


def query(queue: str, field_name: str, value: Any, wait_ms: int = 0, retried: bool = True) -> Op[Any]:
    call = Call("query", QueryRequest(queue=queue, query=_chosen(field_name, value)), wait_ms=wait_ms)
    if wait_ms == 0 and retried:
        resp = yield from _retried(call)
    else:
        # A long-poll is not: its caller waits again (a watch reconnects).
        resp = yield call
    if resp.result is None:
        return None
    return resp.result.value


def last_event_seq(queue: str, retried: bool = True) -> Op[int]:
    """The sequence of the queue's newest event (0 when none); one try
    unless `retried`, for a caller whose retries are its own (a watch's
    reconnects)."""
    return _then(query(queue, "last_event", True, retried=retried), lambda n: n or 0)


def get_jobs(queue: str, ids: Sequence[str]) -> Op[list[Job | None]]:
    slots = yield from query(queue, "jobs", QueryRequest.Jobs(ids=list(ids)))
    return _job_slot_list(slots.slots) if slots else [None] * len(ids)


def counts(queue: str, types: Sequence[str], delayed_before: int | None) -> Op[dict[str, int]]:
    result = yield from query(
        queue, "counts", QueryRequest.Counts(types=list(types), delayed_before=delayed_before)
    )
    values = list(result.counts) if result else []
    return dict(zip(types, values + [0] * (len(types) - len(values)), strict=True))


def dependencies(
    queue: str, job_id: str, with_jobs: bool, status: DependencyStatus | None, start: int, end: int
) -> Op[Dependencies]:
    request = QueryRequest.Dependencies(
        job_id=job_id,
        with_jobs=with_jobs,
        status=status or DependencyStatus.UNSPECIFIED,
        start=start,
        end=end,
    )
    result = yield from query(queue, "dependencies", request)
    if result is None:
        return Dependencies(dependencies=[], jobs=[], total=0)
    return Dependencies(
        dependencies=list(result.dependencies), jobs=_job_slot_list(result.jobs), total=result.total
    )


def events(queue: str, after: int | None, limit: int, wait_ms: int) -> Op[list[QueueEvent]]:
    result = yield from query(
        queue,
        "events",
        QueryRequest.Events(after=after, limit=limit, wait_ms=min(wait_ms, SERVER_MAX_WAIT_MS)),
        wait_ms=min(wait_ms, SERVER_MAX_WAIT_MS),
    )
    return [QueueEvent.from_proto(e) for e in result.events] if result else []


# The result store


def result_get(key: str) -> Op[bytes | None]:
    resp: ResultGetResponse = yield from _retried(Call("result_get", ResultGetRequest(key=key)))
    return resp.value if resp.has_field("value") else None


def result_mget(keys: Sequence[str]) -> Op[list[bytes | None]]:
    resp = yield from _retried(Call("result_m_get", ResultMGetRequest(keys=list(keys))))
    return [_present(v, "value") for v in resp.values]


def _decoded(key: str, value: bytes | None, default: Any) -> Any:
    return default if value is None else decode_json(value, key)


# A set or an expiry is sent again when its outcome is unknown: a repeat
# stores the same value, or the same expiry counted from a moment later. A
# delete or an increment is not: its repeat would answer `deleted` or `added`
# false for what the lost try did, and a chord's last member would never see
# itself added.


def result_set(key: str, value: Any, ttl_ms: int | None) -> Op[None]:
    yield from _retried(
        Call("result_set", ResultSetRequest(key=key, value=encode_data(value), ttl_ms=ttl_ms))
    )
    return None


def _result_ttl(ttl_ms: int | None) -> int | None:
    """A result-store entry's `ttl_ms`: the server counts it from the write,
    so 0 stored an entry already expired, read back as missing."""
    return optional_ms_not_zero(ttl_ms, "ttl_ms", "no expiry", "store an entry already expired")


def result_delete(key: str) -> Op[bool]:
    resp: ResultDeleteResponse = yield Call("result_delete", ResultDeleteRequest(key=key))
    return resp.deleted


def result_incr(key: str, member: str, ttl_ms: int | None) -> Op[IncrResult]:
    resp = yield Call("result_incr", ResultIncrRequest(key=key, member=member, ttl_ms=ttl_ms))
    return IncrResult(count=resp.count, added=resp.added)


def result_expire(key: str, ttl_ms: int) -> Op[bool]:
    resp: ResultExpireResponse = yield from _retried(
        Call("result_expire", ResultExpireRequest(key=key, ttl_ms=ttl_ms))
    )
    return resp.found


U = TypeVar("U")


def _then(op: Op[T], convert: Callable[[T], U]) -> Op[U]:
    """`op`, with its result converted (inside the operation, so the async
    client converts after the await)."""
    result = yield from op
    return convert(result)


def _nothing(_: Any) -> None:
    return None


def _count(resp: QueueAdminResponse) -> int:
    return resp.count


def _job_ids(resp: Any) -> list[str]:
    return list(resp.job_ids)


def _names(result: Any) -> list[str]:
    return list(result.names) if result else []


class Operations(ABC):
    """The public API, shared by `Client` and `AsyncClient`.

    Each method builds an operation and hands it to `_run`, which the sync
    client runs to its result and the async client turns into an awaitable.
    """

    # Each call's bound, in ms (None: none); see `own_key_ttl_ms`.
    _timeout_ms: int | None
    # How long a call whose outcome is unknown is sent again (`_retried`).
    _retry_for_ms: int
    # Whether the server keeps a bulk add's key for the call (see `enqueue_bulk`).
    _bulk_keys: BulkKeys

    @abstractmethod
    def _run(self, op: Op[T]) -> T:
        """Performs the operation's calls; the async client returns an awaitable instead."""

    def _key_ttl_ms(self) -> int | None:
        """The TTL of the keys this client gives its own writes (`own_key_ttl_ms`)."""
        return own_key_ttl_ms(self._timeout_ms, self._retry_for_ms)

    # --- producing ---------------------------------------------------------

    def enqueue(self, queue: str, name: str, data: Any = None, **options: Unpack[JobOptions]) -> Enqueued:
        """Adds one job; `options` are those of `loam_jobs.job()`."""
        return self._run(enqueue(queue, job(name, data, **options), self._key_ttl_ms()))

    def enqueue_job(self, queue: str, spec: JobSpec) -> Enqueued:
        """Adds a job built with `loam_jobs.job()`."""
        return self._run(enqueue(queue, spec, self._key_ttl_ms()))

    def enqueue_bulk(
        self,
        queue: str,
        specs: Iterable[JobSpec | Mapping[str, Any]],
        *,
        all_or_nothing: bool = False,
    ) -> list[Enqueued | LoamJobsError]:
        """Adds many jobs in one transaction. A job is a `JobSpec` (from
        `loam_jobs.job()`) or a mapping of `enqueue`'s parameters (`name`,
        `data` and its options), built as `enqueue` builds its job. A mapping
        with a key `enqueue` does not take raises TypeError, one with a value
        the wire cannot carry InvalidArgumentError, each naming the job's
        index and the key, and no job is sent. Each entry of the result is the
        job's `Enqueued`, or the error (not raised) that refused that job;
        with `all_or_nothing`, the first job refused is raised instead and no
        job is added (BullMQ's addBulk on Loam)."""
        jobs = [_bulk_job_spec(i, item) for i, item in enumerate(specs)]
        ttl_ms = self._key_ttl_ms()
        return self._run(enqueue_bulk(queue, jobs, all_or_nothing, ttl_ms, self._bulk_keys))

    def flow(self, nodes: Sequence[FlowNode]) -> list[Enqueued]:
        """Adds a tree of jobs across queues, all or nothing (parents first;
        each child names its parent, see `flow_node`)."""
        return self._run(flow(nodes, self._key_ttl_ms()))

    # --- working -----------------------------------------------------------

    def lease(
        self,
        queue: str,
        *,
        max_jobs: int = 1,
        wait_ms: int = 0,
        token: str = "",
        worker: str | None = None,
        lock_duration_ms: int = 0,
        names: Iterable[str] | None = None,
        limiter: RateLimit | None = None,
    ) -> LeaseBatch:
        """Takes up to `max_jobs` ready jobs, waiting up to `wait_ms` for the first."""
        wait_ms = whole_ms(wait_ms, "wait_ms")
        options = lease_options(
            max_jobs,
            token=token,
            worker=worker,
            lock_duration_ms=lock_duration_ms,
            names=names,
            limiter=limiter,
        )
        return self._run(lease(queue, options, wait_ms))

    @overload
    def extend(
        self, target: LeasedJob, duration_ms: int, *, epoch: int | None = None, token: str | None = None
    ) -> int: ...

    @overload
    def extend(self, target: Iterable[LeasedJob], duration_ms: int) -> list[str]: ...

    def extend(
        self,
        target: LeasedJob | Iterable[LeasedJob],
        duration_ms: int,
        *,
        epoch: int | None = None,
        token: str | None = None,
    ) -> int | list[str]:
        """Extends one lease (returns its new deadline and sets the lease's
        `deadline`; raises FencedError if it was lost), or the leases of one
        queue (a `LeaseBatch` or any iterable of them; returns the ids whose
        lease was lost, and leaves their `deadline` as it was, since the
        server answers a list with no deadlines). `epoch=` or `token=` fence
        a single lease by something other than its own epoch."""
        if isinstance(target, LeasedJob):
            return self._run(extend_one(target, duration_ms, _fence(target, epoch, token, False)))
        if epoch is not None or token is not None:
            raise InvalidArgumentError(
                "epoch= and token= fence a single lease; a list is fenced by its leases"
            )
        leases = list(target)
        if not leases:
            # Through `_run` like every answer, so the async client awaits it too.
            return self._run(_answered([]))
        queues = {lease.queue for lease in leases}
        if len(queues) != 1:
            raise InvalidArgumentError("extend takes leases of one queue at a time")
        items = [(lease.id, lease.fence()) for lease in leases]
        return self._run(extend_many(queues.pop(), items, duration_ms))

    def complete(
        self,
        target: LeasedJob | str,
        outcome: OutcomeSpec | None = None,
        *,
        queue: str | None = None,
        epoch: int | None = None,
        token: str | None = None,
        unchecked: bool = False,
        fetch_next: int = 0,
        fetch_next_options: LeaseOptions | None = None,
        fetch_next_token: str = "",
        fetch_next_worker: str | None = None,
        fetch_next_lock_duration_ms: int = 0,
        fetch_next_names: Iterable[str] | None = None,
        fetch_next_limiter: RateLimit | None = None,
        remove_on_complete: bool | int | Keep | Retention | None = None,
        remove_on_fail: bool | int | Keep | Retention | None = None,
        metrics_max_points: int | None = None,
        rate_limit_ttl_for: RateLimit | None = None,
    ) -> CompleteResult:
        """Ends a leased job with `outcome` (default `Success()`).

        `target` is the `LeasedJob` (fenced by its epoch), or a job id with
        `queue=` and one of `epoch=`, `token=` or `unchecked=True`.
        `fetch_next=n` leases up to n more jobs in the same transaction,
        with the `fetch_next_*` options, which are those of `lease` (pass
        the worker's own: a worker that leases only some `names`, or with a
        longer lock, wants the same for the jobs it fetches here), or
        `fetch_next_options` whole; they are in the result's `next` (a
        job marked to fail is failed there instead, as `lease` does, with
        `fail_deferred` set on the options). `rate_limit_ttl_for` also
        answers the queue's rate-limit ttl under that limiter
        (`rate_limit_ttl_ms`); with it, a `Release()` with `unchecked=True`
        of a job that is not active leaves the job where it is
        (`moved=False`), as BullMQ's moveJobFromActiveToWait does.
        """
        if outcome is not None and not isinstance(outcome, OutcomeSpec):
            raise InvalidArgumentError(
                f"request not sent: the outcome must be Success(...), Retry(...), Fail(...), Release(), "
                f"Delay(...), WaitChildren() or RateLimited(...): {outcome!r}"
            )
        queue_name, job_id = _target(target, queue)
        fence = _fence(target, epoch, token, unchecked)
        next_options = fetch_next_options or (
            lease_options(
                fetch_next,
                token=fetch_next_token,
                worker=fetch_next_worker,
                lock_duration_ms=fetch_next_lock_duration_ms,
                names=fetch_next_names,
                limiter=fetch_next_limiter,
            )
            if fetch_next
            else None
        )
        return self._run(
            complete(
                queue_name,
                job_id,
                fence,
                outcome or Success(),
                next_options,
                None if remove_on_complete is None else retention(remove_on_complete),
                None if remove_on_fail is None else retention(remove_on_fail),
                metrics_max_points,
                rate_limit_ttl_for,
                self._key_ttl_ms(),
            )
        )

    def report(
        self,
        target: LeasedJob | str,
        *,
        progress: Any = NOT_GIVEN,
        log: str | None = None,
        keep_logs: int | None = None,
        data: Any = NOT_GIVEN,
        queue: str | None = None,
        epoch: int | None = None,
        token: str | None = None,
        unchecked: bool = False,
    ) -> int:
        """Reports exactly one of: `progress` (any JSON value), a `log` line
        (keeping the newest `keep_logs`; by default the job's own `keep_logs`,
        else the newest 1,000), or new `data` for the job (`encode_data`).
        None is JSON null for progress and data, as everywhere: leave out what
        is not reported. Returns the number of log lines kept (0 for progress
        and data)."""
        if (progress is not NOT_GIVEN) + (log is not None) + (data is not NOT_GIVEN) != 1:
            raise InvalidArgumentError("report takes exactly one of progress, log and data")
        if progress is not NOT_GIVEN:
            body: ReportBody = Oneof[Literal["progress"], str]("progress", encode_json(progress))
        elif log is not None:
            body = Oneof[Literal["log"], ReportRequest.Log]("log", ReportRequest.Log(row=log, keep=keep_logs))
        else:
            body = Oneof[Literal["data"], bytes]("data", encode_data(data))
        queue_name, job_id = _target(target, queue)
        fence = _fence(target, epoch, token, unchecked)
        return self._run(report(queue_name, job_id, fence, body, self._key_ttl_ms()))

    # --- schedules ---------------------------------------------------------

    def schedule(
        self,
        queue: str,
        scheduler_id: str,
        name: str,
        data: Any = None,
        *,
        cron: str | None = None,
        tz: str | None = None,
        every_ms: int | None = None,
        start_ms: int | None = None,
        end_ms: int | None = None,
        limit: int | None = None,
        immediately: bool = False,
        **job_options: Unpack[TickJobOptions],
    ) -> ScheduleResult:
        """Creates or replaces a schedule the server ticks itself: a `cron`
        expression (5 or 6 fields) in time zone `tz` (IANA, default UTC), or
        `every_ms`. Each tick enqueues one job `name` with `data` and
        `job_options` (those of `loam_jobs.job()`, less `job_id` and
        `idempotency_key`: each tick's job is keyed by its tick). The first
        tick is reckoned from the server's clock."""
        if (cron is None) == (every_ms is None):
            raise InvalidArgumentError("give exactly one of cron and every_ms")
        spec = ServerSchedule(
            id=scheduler_id,
            name=name,
            cron=cron,
            tz=tz,
            every_ms=every_ms,
            start_date=start_ms,
            end_date=end_ms,
            limit=limit,
            immediately=immediately,
            job=job(name, data, **job_options),
        )
        return self._run(schedule_server(queue, spec))

    def upsert_scheduler(self, queue: str, spec: SchedulerSpec) -> ScheduleResult:
        """BullMQ's upsertJobScheduler: the caller computes cron times."""
        return self._run(schedule_upsert(queue, spec))

    def advance_scheduler(
        self,
        queue: str,
        scheduler_id: str,
        producer_id: str,
        *,
        next_millis: int | None = None,
        spec: JobSpec | None = None,
    ) -> ScheduleResult:
        """BullMQ's updateJobSchedulerNextMillis: after iteration `producer_id`
        started, enqueue the next one (`next_millis` is required for cron)."""
        advance = SchedulerAdvance(
            id=scheduler_id, next_millis=next_millis, producer_id=producer_id, job=spec
        )
        return self._run(schedule_advance(queue, advance))

    def unschedule(self, queue: str, scheduler_id: str) -> bool:
        return self._run(unschedule(queue, scheduler_id))

    def get_scheduler(self, queue: str, scheduler_id: str) -> Scheduler | None:
        op = query(queue, "scheduler", QueryRequest.SchedulerOf(id=scheduler_id))
        return self._run(
            _then(op, lambda slot: slot.scheduler if slot and slot.has_field("scheduler") else None)
        )

    def get_schedulers(
        self, queue: str, start: int = 0, end: int = -1, *, asc: bool = True
    ) -> list[Scheduler]:
        op = query(queue, "schedulers", QueryRequest.Schedulers(start=start, end=end, asc=asc))
        return self._run(_then(op, lambda result: list(result.schedulers) if result else []))

    def scheduler_count(self, queue: str) -> int:
        return self._run(_then(query(queue, "scheduler_count", True), lambda n: n or 0))

    # --- queue administration ----------------------------------------------

    def pause(self, queue: str) -> None:
        return self._run(_then(queue_admin(queue, "pause", True), _nothing))

    def resume(self, queue: str) -> None:
        return self._run(_then(queue_admin(queue, "resume", True), _nothing))

    def is_paused(self, queue: str) -> bool:
        """Whether the queue is paused (the `paused` field of its meta, as BullMQ keeps it)."""
        op = query(queue, "meta", QueryRequest.Meta(fields=["paused"]))
        return self._run(_then(op, lambda result: bool(result and "paused" in result.values)))

    def drain(self, queue: str, *, delayed: bool = False) -> int:
        """Removes the waiting jobs (and the delayed ones with `delayed`); returns how many."""
        return self._run(_then(queue_admin(queue, "drain", QueueAdminRequest.Drain(delayed=delayed)), _count))

    def clean(self, queue: str, state: str, *, before_ms: int, limit: int = 0) -> list[str]:
        """Removes jobs in BullMQ state `state` (`completed`, `failed`, `wait`,
        `delayed`, ...) finished or created at or before `before_ms`; returns their ids."""
        op = queue_admin(queue, "clean", QueueAdminRequest.Clean(state=state, before=before_ms, limit=limit))
        return self._run(_then(op, _job_ids))

    def obliterate(self, queue: str, *, force: bool = False, chunk: int = 1000) -> None:
        """Pauses the queue, then removes it with all its jobs, `chunk` jobs per
        call (BullMQ's obliterate). Without `force` it refuses while jobs are
        active, and the queue stays paused, as on BullMQ: `resume` it to go on
        without obliterating."""
        value = QueueAdminRequest.Obliterate(force=force, count=chunk)
        return self._run(_pause_then(queue, queue_admin_until_done(queue, "obliterate", value)))

    def retry_jobs(
        self,
        queue: str,
        *,
        state: JobState = JobState.FAILED,
        before_ms: int | None = None,
        chunk: int = 1000,
    ) -> None:
        """Moves the failed (or completed) jobs that finished at or before
        `before_ms` (default now) back to waiting."""
        before = int(time.time() * 1000) if before_ms is None else before_ms
        value = QueueAdminRequest.RetryJobs(state=state, count=chunk, before=before)
        return self._run(queue_admin_until_done(queue, "retry_jobs", value))

    def promote_jobs(self, queue: str, *, chunk: int = 1000) -> None:
        """Moves every delayed job to waiting."""
        value = QueueAdminRequest.PromoteJobs(count=chunk)
        return self._run(queue_admin_until_done(queue, "promote_jobs", value))

    def set_meta(self, queue: str, values: Mapping[str, str]) -> int:
        return self._run(
            _then(queue_admin(queue, "set_meta", QueueAdminRequest.SetMeta(values=dict(values))), _count)
        )

    def remove_meta_fields(self, queue: str, fields: Sequence[str]) -> int:
        value = QueueAdminRequest.RemoveMetaFields(fields=text_list(fields, "fields"))
        return self._run(_then(queue_admin(queue, "remove_meta_fields", value), _count))

    def get_meta(self, queue: str, fields: Sequence[str] = ()) -> dict[str, str]:
        """The queue's meta fields asked for (all with none); absent fields are left out."""
        op = query(queue, "meta", QueryRequest.Meta(fields=text_list(fields, "fields")))
        return self._run(_then(op, lambda result: dict(result.values) if result else {}))

    def set_rate_limit(self, queue: str, ms: int) -> None:
        """Stops the whole queue for `ms` (BullMQ's rateLimit)."""
        return self._run(
            _then(queue_admin(queue, "set_rate_limit", QueueAdminRequest.SetRateLimit(ms=ms)), _nothing)
        )

    def remove_rate_limit_key(self, queue: str) -> int:
        return self._run(_then(queue_admin(queue, "remove_rate_limit_key", True), _count))

    def sweep_stalled(self, queue: str, *, max_stalled: int | None = None) -> list[str]:
        """Reclaims expired leases now; returns the reclaimed ids."""
        value = QueueAdminRequest.SweepStalled(max_stalled=max_stalled)
        return self._run(_then(queue_admin(queue, "sweep_stalled", value), _job_ids))

    def set_config(
        self,
        queue: str,
        *,
        max_stalled: int | None = None,
        stalled_interval_ms: int | None = None,
        dead_letter_queue: str | None = None,
        dead_letter_on_exhausted: bool | None = None,
    ) -> None:
        """Changes the settings given and keeps the others (read, then
        written: two calls, so a concurrent change of another setting may be
        overwritten). `dead_letter_queue=""` turns dead-lettering off."""
        changes = {
            "max_stalled": max_stalled,
            "stalled_interval_ms": stalled_interval_ms,
            "dead_letter_queue": dead_letter_queue,
            "dead_letter_on_exhausted": dead_letter_on_exhausted,
        }
        return self._run(set_config(queue, {k: v for k, v in changes.items() if v is not None}))

    def get_config(self, queue: str) -> QueueConfig:
        return self._run(_then(query(queue, "config", True), lambda config: config or QueueConfig()))

    def publish_event(
        self, queue: str, name: str, fields: Mapping[str, str], *, max_events: int = DEFAULT_MAX_EVENTS
    ) -> str:
        """Appends an event to the queue's log, trimming the log to its newest
        `max_events`; returns the event's id (`<ms>-<seq>`)."""
        value = QueueAdminRequest.PublishEvent(
            name=name, fields=[EventField(key=k, value=v) for k, v in fields.items()], max_events=max_events
        )
        return self._run(_then(queue_admin(queue, "publish_event", value), lambda resp: resp.event_id))

    def trim_events(self, queue: str, max_length: int) -> int:
        value = QueueAdminRequest.TrimEvents(max_length=max_length)
        return self._run(_then(queue_admin(queue, "trim_events", value), _count))

    def remove_dedup_key(self, queue: str, dedup_id: str, *, job_id: str | None = None) -> int:
        """Frees a dedup id (only if it still points at `job_id`, when given)."""
        value = QueueAdminRequest.RemoveDedupKey(dedup_id=dedup_id, job_id=job_id)
        return self._run(_then(queue_admin(queue, "remove_dedup_key", value), _count))

    def redrive_dead_letters(self, queue: str, *, limit: int = 0) -> int:
        """Moves jobs from the queue's dead-letter queue back to it; returns how many."""
        value = QueueAdminRequest.RedriveDeadLetters(limit=limit)
        return self._run(_then(queue_admin(queue, "redrive_dead_letters", value), _count))

    def register_worker(self, queue: str, name: str) -> None:
        """Lists `name` among the queue's workers for 5 minutes (call again to stay listed)."""
        value = QueueAdminRequest.RegisterWorker(name=name)
        return self._run(_then(queue_admin(queue, "register_worker", value), _nothing))

    def unregister_worker(self, queue: str, name: str) -> bool:
        """Stops listing `name` (a worker that is closing); False if it was not listed."""
        value = QueueAdminRequest.UnregisterWorker(name=name)
        return self._run(_then(queue_admin(queue, "unregister_worker", value), lambda resp: resp.count == 1))

    def workers(self, queue: str) -> list[str]:
        """Worker names seen on the queue in the last 5 minutes."""
        return self._run(_then(query(queue, "workers", True), _names))

    def workers_seen(self, queue: str) -> list[WorkerSeen]:
        """The workers of `workers`, first seen first, each with the address of
        the connection it was last seen on, and how long ago it was first and
        last seen (`age_ms`, `idle_ms`)."""
        return self._run(
            _then(query(queue, "workers", True), lambda result: list(result.workers) if result else [])
        )

    def queues(self) -> list[str]:
        """The namespace's queues."""
        return self._run(_then(query("", "queues", True), _names))

    # --- jobs ----------------------------------------------------------------

    def get_job(self, queue: str, job_id: str) -> Job | None:
        return self._run(_then(get_jobs(queue, [job_id]), lambda jobs: jobs[0]))

    def get_jobs(self, queue: str, job_ids: Sequence[str]) -> list[Job | None]:
        return self._run(get_jobs(queue, text_list(job_ids, "job_ids")))

    def remove(self, queue: str, job_id: str, *, remove_children: bool = False) -> bool:
        """Removes a job; False when it or a descendant is locked (nothing removed)."""
        value = JobAdminRequest.Remove(remove_children=remove_children)
        return self._run(job_admin(queue, job_id, "remove", value))

    def remove_unprocessed_children(self, queue: str, job_id: str) -> None:
        return self._run(_then(job_admin(queue, job_id, "remove_unprocessed_children", True), _nothing))

    def remove_child_dependency(self, queue: str, job_id: str, parent_key: str) -> bool:
        value = JobAdminRequest.RemoveChildDependency(parent_key=parent_key)
        return self._run(job_admin(queue, job_id, "remove_child_dependency", value))

    def retry(
        self,
        queue: str,
        job_id: str,
        *,
        state: JobState = JobState.FAILED,
        reset_attempts_made: bool = False,
        reset_attempts_started: bool = False,
    ) -> None:
        """Moves a finished job back to waiting."""
        value = JobAdminRequest.RetryFinished(
            state=state,
            reset_attempts_made=reset_attempts_made,
            reset_attempts_started=reset_attempts_started,
        )
        return self._run(_then(job_admin(queue, job_id, "retry_finished", value), _nothing))

    def promote(self, queue: str, job_id: str) -> None:
        """Makes a delayed job ready now."""
        return self._run(_then(job_admin(queue, job_id, "promote", True), _nothing))

    def change_delay(self, queue: str, job_id: str, delay_ms: int) -> None:
        value = JobAdminRequest.ChangeDelay(delay_ms=delay_ms)
        return self._run(_then(job_admin(queue, job_id, "change_delay", value), _nothing))

    def change_priority(self, queue: str, job_id: str, priority: int, *, lifo: bool = False) -> None:
        value = JobAdminRequest.ChangePriority(priority=priority, lifo=lifo)
        return self._run(_then(job_admin(queue, job_id, "change_priority", value), _nothing))

    def clear_logs(self, queue: str, job_id: str, *, keep: int | None = None) -> None:
        value = JobAdminRequest.ClearLogs(keep=keep)
        return self._run(_then(job_admin(queue, job_id, "clear_logs", value), _nothing))

    # --- reads ---------------------------------------------------------------

    def counts(self, queue: str, *types: str, delayed_before: int | None = None) -> dict[str, int]:
        """Jobs per BullMQ type (`waiting` or `wait`, `active`, `delayed`,
        `prioritized`, `waiting-children`, `completed`, `failed`, `paused`,
        `repeat`, ...), keyed as named; when none are, the types (and names)
        of BullMQ's `getJobCounts()`."""
        names = list(types) or [
            "active",
            "completed",
            "delayed",
            "failed",
            "paused",
            "prioritized",
            "waiting",
            "waiting-children",
        ]
        return self._run(counts(queue, names, delayed_before))

    def counts_per_priority(self, queue: str, priorities: Sequence[int]) -> dict[int, int]:
        op = query(queue, "counts_per_priority", QueryRequest.CountsPerPriority(priorities=list(priorities)))

        def by_priority(result: Any) -> dict[int, int]:
            values = list(result.counts) if result else []
            return {p: (values[i] if i < len(values) else 0) for i, p in enumerate(priorities)}

        return self._run(_then(op, by_priority))

    def ranges(
        self, queue: str, types: Sequence[str], start: int = 0, end: int = -1, *, asc: bool = False
    ) -> dict[str, list[str]]:
        """Job ids per BullMQ type, from `start` to `end` (negative counts from the end)."""
        types = text_list(types, "types")
        value = QueryRequest.Ranges(types=types, start=start, end=end, asc=asc)

        def by_type(result: Any) -> dict[str, list[str]]:
            lists = [list(r.ids) for r in result.ranges] if result else []
            return {t: (lists[i] if i < len(lists) else []) for i, t in enumerate(types)}

        return self._run(_then(query(queue, "ranges", value), by_type))

    def logs(self, queue: str, job_id: str, start: int = 0, end: int = -1, *, asc: bool = True) -> LogPage:
        op = query(queue, "logs", QueryRequest.Logs(job_id=job_id, start=start, end=end, asc=asc))
        return self._run(
            _then(op, lambda r: LogPage(logs=list(r.logs), count=r.count) if r else LogPage(logs=[], count=0))
        )

    def dependencies(
        self,
        queue: str,
        job_id: str,
        *,
        with_jobs: bool = False,
        status: DependencyStatus | None = None,
        start: int = 0,
        end: int = -1,
    ) -> Dependencies:
        """A parent's children: those of `status` (every one when None), positions `start..end`
        (inclusive, in key order; an `end` of -1 runs to the last and a lower one gives none, as
        BullMQ's paginate), with their jobs when `with_jobs`, and how many there are of that
        status (`total`)."""
        return self._run(dependencies(queue, job_id, with_jobs, status, start, end))

    def metrics(self, queue: str, kind: str, start: int = 0, end: int = -1) -> Metrics:
        """Per-minute counts of `completed` or `failed` jobs: the points `start..end` (inclusive, newest
        first, negative from the oldest end, as Redis's LRANGE), and how many are kept (`total`)."""
        op = query(queue, "metrics", QueryRequest.MetricsOf(kind=kind, start=start, end=end))
        return self._run(_then(op, lambda metrics: metrics or Metrics()))

    def dedup_job(self, queue: str, dedup_id: str) -> str | None:
        """The job holding a dedup id, or None."""
        op = query(queue, "dedup_job", QueryRequest.DedupJob(dedup_id=dedup_id))
        return self._run(_then(op, lambda job_id: job_id or None))

    def rate_limit_ttl(self, queue: str, *, max_jobs: int | None = None) -> int:
        op = query(queue, "rate_limit_ttl", QueryRequest.RateLimitTtl(max_jobs=max_jobs))
        return self._run(_then(op, lambda n: n or 0))

    def is_maxed(self, queue: str) -> bool:
        return self._run(_then(query(queue, "is_maxed", True), bool))

    def last_event_seq(self, queue: str) -> int:
        """The sequence of the queue's newest event (0 when none): a cursor for `watch(after=...)`."""
        return self._run(last_event_seq(queue))

    def events(
        self, queue: str, *, after: int | None = None, limit: int = 100, wait_ms: int = 0
    ) -> list[QueueEvent]:
        """Events after sequence `after` (None: from now on), waiting up to
        `wait_ms` (at most 30 s) for the first. Like Redis's XREAD, a cursor
        behind the trimmed log gets the oldest events kept, with no word of
        those trimmed (compare the first one's `seq` with `after + 1`);
        `watch` raises `EventsTrimmedError` instead."""
        return self._run(events(queue, after, limit, wait_ms))

    def wait_for_job(self, queue: str, wait_ms: int) -> bool:
        """Waits up to `wait_ms` (at most 30 s); True once a job may be ready."""
        wait = min(wait_ms, SERVER_MAX_WAIT_MS)
        op = query(queue, "wait_for_job", QueryRequest.WaitForJob(wait_ms=wait), wait_ms=wait)
        return self._run(_then(op, bool))

    # --- the result store ----------------------------------------------------

    def result_get(self, key: str) -> bytes | None:
        """The bytes at `key` (`b"null"` for a stored None), or None when
        missing or expired; `result_get_json` decodes them."""
        return self._run(result_get(key))

    def result_mget(self, keys: Sequence[str]) -> list[bytes | None]:
        """`result_get` of each key, in one call."""
        return self._run(result_mget(text_list(keys, "keys")))

    def result_get_json(self, key: str, default: Any = None) -> Any:
        """The value at `key` decoded as JSON, which gives back any value but
        bytes that `result_set` stored, or `default` when missing or expired.
        A stored None is None: pass a `default` of your own to tell it from a
        missing key. InvalidJsonError when the value is not JSON (bytes
        stored as they are)."""
        return self._run(_then(result_get(key), lambda value: _decoded(key, value, default)))

    def result_mget_json(self, keys: Sequence[str], default: Any = None) -> list[Any]:
        """`result_get_json` of each key, in one call."""
        names = text_list(keys, "keys")
        return self._run(
            _then(
                result_mget(names),
                lambda values: [_decoded(k, v, default) for k, v in zip(names, values, strict=True)],
            )
        )

    def result_set(self, key: str, value: Any, *, ttl_ms: int | None = None) -> None:
        """Stores `value`, expiring after `ttl_ms`: bytes as they are (read
        them back with `result_get`), anything else as JSON, None as null
        (read it back with `result_get_json`). `ttl_ms` is at least 1 (None:
        no expiry): 0 would store a value already expired."""
        return self._run(result_set(key, value, _result_ttl(ttl_ms)))

    def result_delete(self, key: str) -> bool:
        return self._run(result_delete(key))

    def result_incr(self, key: str, member: str, *, ttl_ms: int | None = None) -> IncrResult:
        """Counts `member` once in the counter at `key` (a repeat adds
        nothing), which expires after `ttl_ms` (at least 1; None: no expiry)."""
        return self._run(result_incr(key, member, _result_ttl(ttl_ms)))

    def result_expire(self, key: str, ttl_ms: int) -> bool:
        """Sets a key's expiry; False when the key does not exist."""
        return self._run(result_expire(key, ttl_ms))
