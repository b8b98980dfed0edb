"""What callers pass to and get from the client.

Records the server returns whole (`Job`, `Scheduler`, `QueueConfig`, ...)
are the generated loam.jobs.v1 messages, re-exported here. The few things a
worker handles on every job (a lease, an outcome, an event) get small
classes of their own; `job()` builds the `JobSpec` that enqueue, bulk
enqueue, flows and schedules share.

Times are milliseconds since the Unix epoch and durations are milliseconds,
as on the wire. Job data, results, progress and result-store values are
bytes or JSON text on the wire: bytes pass through unchanged, anything else
is encoded as JSON by `encode_json`, None as `null`.
"""

from __future__ import annotations

import copy
import json
import operator
import os
import time
import traceback
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict, overload

from protobuf import Oneof

from ._gen.loam.jobs.v1.events_pb import Event
from ._gen.loam.jobs.v1.jobs_pb import WorkerSeen
from ._gen.loam.jobs.v1.types_pb import (
    Backoff,
    BackoffKind,
    Dedup,
    Dependency,
    DependencyStatus,
    Enqueued,
    Fence,
    FlowNode,
    Idempotency,
    Job,
    JobError,
    JobSpec,
    JobState,
    Keep,
    Lease,
    Leased,
    LeaseOptions,
    Metrics,
    OnChildFailure,
    Outcome,
    ParentRef,
    QueueConfig,
    RateLimit,
    Retention,
    Scheduler,
    SchedulerSpec,
)
from .errors import InvalidArgumentError, InvalidJsonError

__all__ = [
    "Backoff",
    "BackoffKind",
    "CompleteResult",
    "Dedup",
    "Delay",
    "Dependency",
    "DependencyStatus",
    "Enqueued",
    "Fail",
    "FlowNode",
    "Job",
    "JobSpec",
    "JobState",
    "Keep",
    "LeaseBatch",
    "LeasedJob",
    "Metrics",
    "OnChildFailure",
    "ParentRef",
    "QueueConfig",
    "QueueEvent",
    "RateLimit",
    "RateLimited",
    "Release",
    "Retention",
    "Retry",
    "Scheduler",
    "SchedulerSpec",
    "Success",
    "WaitChildren",
    "WorkerSeen",
    "encode_data",
    "exponential_backoff",
    "fixed_backoff",
    "flow_node",
    "job",
    "retention",
]


def encode_json(value: Any) -> str:
    """`value` as compact JSON text, None as `null`.

    NaN and the infinities are refused: Python writes them as `NaN` and
    `Infinity`, which are not JSON, and which JSON.parse (a BullMQ worker,
    any other client) cannot read. They, and values JSON has no form for,
    raise InvalidArgumentError("request not sent: ..."), as every value the
    wire cannot carry does, before anything is sent."""
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as err:
        raise InvalidArgumentError(f"request not sent: {err}") from err
    except RecursionError as err:
        raise InvalidArgumentError("request not sent: the value nests too deeply to write as JSON") from err


def whole_ms(value: int, what: str) -> int:
    """`value` as a number of milliseconds: a whole number (any integer type,
    not a bool or a float), 0 or more, or InvalidArgumentError("request not
    sent: ...")."""
    try:
        if isinstance(value, bool):
            raise TypeError
        ms = operator.index(value)
    except TypeError:
        ms = -1
    if ms < 0:
        raise InvalidArgumentError(
            f"request not sent: {what} must be a whole number of ms, 0 or more: {value!r}"
        )
    return ms


def optional_ms_not_zero(value: int | None, what: str, none_means: str, zero_would: str) -> int | None:
    """`value` as None or a whole number of ms, at least 1 (see `whole_ms`),
    for a setting where 0 would be a mistake: `zero_would` says what it
    would do, `none_means` what to pass instead."""
    if value is None:
        return None
    ms = whole_ms(value, what)
    if ms == 0:
        raise InvalidArgumentError(
            f"request not sent: {what} must be at least 1 ms (None: {none_means}); 0 would {zero_would}"
        )
    return ms


def text_list(values: Iterable[str], what: str) -> list[str]:
    """`values` as a list; one string where a list of them goes (which would
    be taken as its characters) raises InvalidArgumentError("request not
    sent: ...")."""
    if isinstance(values, str | bytes):
        raise InvalidArgumentError(f"request not sent: {what} takes a list of strings, not one: {values!r}")
    return list(values)


def encode_data(value: Any) -> bytes:
    """Bytes as they are; anything else as JSON text (`encode_json`)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    return encode_json(value).encode()


def decode_json(value: bytes, subject: str) -> Any:
    """`value` read as JSON text; InvalidJsonError about `subject` (a key) when
    it is not, or when it nests deeper than Python reads (which a producer in
    another language may write), so that one error type marks a value no
    reader here can take."""
    try:
        return json.loads(value, parse_constant=_not_json)
    except ValueError as err:  # JSONDecodeError, or bytes that are not UTF-8 text
        raise InvalidJsonError(f"the value of {subject!r} is not JSON: {err}", subject=subject) from err
    except RecursionError as err:
        raise InvalidJsonError(f"the value of {subject!r} nests too deeply to read", subject=subject) from err


def _not_json(constant: str) -> Any:
    """`NaN`, `Infinity` and `-Infinity`, which Python's reader takes and JSON has not."""
    raise ValueError(f"{constant} is not JSON")


def fixed_backoff(delay_ms: int, *, jitter: float = 0.0) -> Backoff:
    return Backoff(kind=BackoffKind.FIXED, delay_ms=delay_ms, jitter=jitter)


def exponential_backoff(delay_ms: int, *, jitter: float = 0.0, max_ms: int | None = None) -> Backoff:
    """2^(attempts_made - 1) * delay_ms between attempts, capped by max_ms."""
    return Backoff(kind=BackoffKind.EXPONENTIAL, delay_ms=delay_ms, jitter=jitter, max_ms=max_ms)


def retention(policy: bool | int | Keep | Retention) -> Retention:
    """BullMQ's removeOnComplete / removeOnFail: True removes the job at once,
    False keeps every job, a number keeps that many, a `Keep` bounds count
    and age."""
    if isinstance(policy, Retention):
        return policy
    if isinstance(policy, Keep):
        return Retention(policy=Oneof[Literal["keep"], Keep]("keep", policy))
    if policy is True:
        return Retention(policy=Oneof[Literal["remove_immediately"], bool]("remove_immediately", True))
    if policy is False:
        return Retention(policy=Oneof[Literal["keep_all"], bool]("keep_all", True))
    # As given: the encoder refuses what is not a whole number (a float
    # was truncated here once, where every other count refuses one).
    return Retention(policy=Oneof[Literal["keep"], Keep]("keep", Keep(count=policy)))


class TickJobOptions(TypedDict, total=False):
    """The options of `job` that `schedule` takes for each tick's job, by
    keyword (a type checker then checks them by name and type): all but
    those of `JobOptions` that name or key a job, which a tick does itself."""

    delay_ms: int
    priority: int
    lifo: bool
    attempts: int
    backoff: int | Backoff | None
    headers: Mapping[str, str] | None
    dedup: str | Dedup | None
    lock_duration_ms: int | None
    timeout_ms: int | None
    expires: int | None
    parent: ParentRef | None
    on_child_failure: OnChildFailure
    remove_on_complete: bool | int | Keep | Retention | None
    remove_on_fail: bool | int | Keep | Retention | None
    keep_logs: int | None
    dead_letter: str | None
    timestamp: int | None
    opts: str | Mapping[str, Any]


class JobOptions(TickJobOptions, total=False):
    """The options of `job` after its name and data: `enqueue`'s keyword
    arguments."""

    job_id: str | None
    idempotency_key: str | None
    idempotency_ttl_ms: int | None
    scheduler_id: str | None


def job(
    name: str,
    data: Any = None,
    *,
    job_id: str | None = None,
    delay_ms: int = 0,
    priority: int = 0,
    lifo: bool = False,
    attempts: int = 0,
    backoff: int | Backoff | None = None,
    headers: Mapping[str, str] | None = None,
    idempotency_key: str | None = None,
    idempotency_ttl_ms: int | None = None,
    dedup: str | Dedup | None = None,
    lock_duration_ms: int | None = None,
    timeout_ms: int | None = None,
    expires: int | None = None,
    parent: ParentRef | None = None,
    on_child_failure: OnChildFailure = OnChildFailure.UNSPECIFIED,
    remove_on_complete: bool | int | Keep | Retention | None = None,
    remove_on_fail: bool | int | Keep | Retention | None = None,
    keep_logs: int | None = None,
    dead_letter: str | None = None,
    timestamp: int | None = None,
    scheduler_id: str | None = None,
    opts: str | Mapping[str, Any] = "",
) -> JobSpec:
    """A job as a producer describes it.

    `data` is encoded with `encode_data` (None is JSON null). `backoff` as a
    number is a fixed delay in ms. `dedup` as a string is the dedup id with
    BullMQ's default mode (until the job finishes). `opts` is the caller's
    own options document (BullMQ's job options: a mapping, or JSON object
    text), kept verbatim by the server.
    `scheduler_id` names the job scheduler the job is an iteration of.
    """
    if not isinstance(name, str):
        raise InvalidArgumentError(f"request not sent: a job's name is a string: {name!r}")
    if idempotency_key == "":
        # Taken for no key, it left the job to an automatic key of its own.
        raise InvalidArgumentError("request not sent: idempotency_key is empty (None for no key of your own)")
    object_text = isinstance(opts, str) and (not opts or opts.lstrip().startswith("{"))
    if not (object_text or isinstance(opts, Mapping)):
        # As the server refuses it: BullMQ reads a job's options as an object.
        raise InvalidArgumentError(f"request not sent: opts is a mapping or JSON object text: {opts!r}")
    return JobSpec(
        name=name,
        data=encode_data(data),
        opts=opts if isinstance(opts, str) else encode_json(opts),
        headers=dict(headers or {}),
        job_id=job_id,
        idempotency=Idempotency(key=idempotency_key, ttl_ms=idempotency_ttl_ms) if idempotency_key else None,
        dedup=Dedup(id=dedup) if isinstance(dedup, str) else dedup,
        delay_ms=delay_ms,
        priority=priority,
        lifo=lifo,
        attempts=attempts,
        backoff=fixed_backoff(backoff) if isinstance(backoff, int) else backoff,
        lock_duration_ms=lock_duration_ms,
        timeout_ms=timeout_ms,
        expires=expires,
        parent=_bullmq_keyed(parent),
        on_child_failure=on_child_failure,
        remove_on_complete=None if remove_on_complete is None else retention(remove_on_complete),
        remove_on_fail=None if remove_on_fail is None else retention(remove_on_fail),
        keep_logs=keep_logs,
        dead_letter=dead_letter,
        timestamp=timestamp,
        scheduler_id=scheduler_id,
    )


# BullMQ's default key prefix.
BULLMQ_PREFIX = "bull"


def _bullmq_keyed(parent: ParentRef | None) -> ParentRef | None:
    """`parent`, with BullMQ's default prefix when it names none: BullMQ keys a
    flow's jobs `<prefix>:<queue>:<id>`, and without one a flow made here had
    keys BullMQ's `getFlow` and `getChildrenValues` did not match."""
    if parent is None or parent.prefix:
        return parent
    return ParentRef(queue=parent.queue, id=parent.id, prefix=BULLMQ_PREFIX)


def uuid7() -> str:
    """A UUIDv7 (RFC 9562): the time in milliseconds, then random bits."""
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (
        (ms & (1 << 48) - 1) << 80
        | 0x7 << 76
        | (rand >> 62 & 0xFFF) << 64
        | 0b10 << 62
        | rand & (1 << 62) - 1
    )
    return str(uuid.UUID(int=value))


def own_key(ttl_ms: int | None = None) -> Idempotency:
    """A fresh idempotency key (a UUIDv7) for one call, which the server keeps
    `ttl_ms` (None: its default, a day)."""
    return Idempotency(key=uuid7(), ttl_ms=ttl_ms)


def idempotent(spec: JobSpec, ttl_ms: int | None = None) -> JobSpec:
    """`spec`, or a copy of it with an idempotency key of its own when it has
    none: an enqueue retried after an unknown outcome then returns the first
    try's job instead of adding a second one. A job id alone does not do
    that: if the first try's job finished and was removed before the retry,
    the retry would add the job again. The server keeps the key `ttl_ms`
    (None: its default, a day)."""
    if spec.has_field("idempotency"):
        return spec
    keyed = copy.copy(spec)
    keyed.idempotency = own_key(ttl_ms)
    return keyed


def flow_node(queue: str, spec: JobSpec, *, wait_children: bool = False) -> FlowNode:
    """One node of a flow; list parents (wait_children=True) before their
    children. A child names its parent in its spec: `job(..., parent=
    ParentRef(queue=..., id=...))` with the parent's `job_id`; a node that
    names none is a job of its own, and a parent left with no children runs
    at once."""
    return FlowNode(queue=queue, job=spec, wait_children=wait_children)


# Outcomes: how a leased job ends.


def _job_error(error: str | BaseException, stacktrace: str | None, stacktrace_limit: int | None) -> JobError:
    # An exception's traceback is its stack trace, as a BullMQ worker stores
    # a thrown Error's stack (a string, like a thrown non-Error, has none).
    if stacktrace is None and isinstance(error, BaseException):
        stacktrace = "".join(traceback.format_exception(error)).rstrip("\n")
    return JobError(message=str(error), stacktrace=stacktrace, stacktrace_limit=stacktrace_limit)


@dataclass(frozen=True)
class Success:
    """The job succeeded; `result` (`encode_data`) is stored as its return
    value: JSON null by default, as a BullMQ processor that returns nothing."""

    result: Any = None

    def to_proto(self) -> Outcome:
        return Outcome(
            kind=Oneof[Literal["success"], Outcome.Success](
                "success", Outcome.Success(result=encode_data(self.result))
            )
        )


@dataclass(frozen=True)
class Retry:
    """The attempt failed; try again.

    Without `after_ms` the job's own settings decide: another attempt after
    its backoff while attempts remain, else the job fails. With `after_ms`
    the job is retried after that long whatever its attempts (BullMQ's
    retryJob, where the worker has already decided)."""

    error: str | BaseException
    after_ms: int | None = None
    stacktrace: str | None = None
    stacktrace_limit: int | None = None

    def to_proto(self) -> Outcome:
        err = _job_error(self.error, self.stacktrace, self.stacktrace_limit)
        return Outcome(
            kind=Oneof[Literal["retry"], Outcome.Retry](
                "retry", Outcome.Retry(error=err, after_ms=self.after_ms)
            )
        )


@dataclass(frozen=True)
class Fail:
    """The job failed for good; `dead_letter` moves it to the dead-letter queue."""

    error: str | BaseException
    dead_letter: bool = False
    stacktrace: str | None = None
    stacktrace_limit: int | None = None

    def to_proto(self) -> Outcome:
        err = _job_error(self.error, self.stacktrace, self.stacktrace_limit)
        return Outcome(
            kind=Oneof[Literal["fail"], Outcome.Fail](
                "fail", Outcome.Fail(error=err, dead_letter=self.dead_letter)
            )
        )


@dataclass(frozen=True)
class Release:
    """Give the job back without spending an attempt, optionally after a pause."""

    after_ms: int | None = None

    def to_proto(self) -> Outcome:
        return Outcome(
            kind=Oneof[Literal["release"], Outcome.Release](
                "release", Outcome.Release(after_ms=self.after_ms)
            )
        )


@dataclass(frozen=True)
class Delay:
    """Park the job until `until_ms` (epoch ms; BullMQ's moveToDelayed)."""

    until_ms: int

    def to_proto(self) -> Outcome:
        return Outcome(
            kind=Oneof[Literal["delay"], Outcome.Delay]("delay", Outcome.Delay(until=self.until_ms))
        )


@dataclass(frozen=True)
class WaitChildren:
    """Park a parent until its children (or the one named child) finish."""

    child: str | None = None

    def to_proto(self) -> Outcome:
        return Outcome(
            kind=Oneof[Literal["wait_children"], Outcome.WaitChildren](
                "wait_children", Outcome.WaitChildren(child=self.child)
            )
        )


@dataclass(frozen=True)
class RateLimited:
    """Give the job back and stop the whole queue for `for_ms`."""

    for_ms: int

    def to_proto(self) -> Outcome:
        return Outcome(
            kind=Oneof[Literal["rate_limited"], Outcome.RateLimited](
                "rate_limited", Outcome.RateLimited(for_ms=self.for_ms)
            )
        )


OutcomeSpec = Success | Retry | Fail | Release | Delay | WaitChildren | RateLimited


@dataclass
class LeasedJob:
    """A job this worker holds. Pass it back to complete, extend and report:
    they are fenced by its `epoch`, so a worker that lost the lease cannot
    overwrite the outcome of the one that took over."""

    queue: str
    job: Job
    epoch: int
    token: str
    deadline: int

    @property
    def id(self) -> str:
        return self.job.id

    @property
    def name(self) -> str:
        return self.job.name

    @property
    def data(self) -> bytes:
        return self.job.data

    def json(self) -> Any:
        """The job's data decoded as JSON: None for null, and for empty data
        (no data at all: the wire's default, and what this client sent for
        None before it sent null). Data that is not JSON (sent as bytes)
        raises InvalidJsonError about the job's id."""
        return decode_json(self.job.data, self.job.id) if self.job.data else None

    def fence(self) -> Fence:
        return Fence(kind=Oneof[Literal["epoch"], int]("epoch", self.epoch))

    @classmethod
    def from_proto(cls, queue: str, lease: Lease) -> LeasedJob:
        return cls(
            queue=queue, job=lease.job or Job(), epoch=lease.epoch, token=lease.token, deadline=lease.deadline
        )


@dataclass
class LeaseBatch:
    """The jobs one lease call took, and why there were fewer than asked for."""

    jobs: list[LeasedJob]
    # The queue's rate limit holds jobs back for this long.
    rate_limit_ms: int = 0
    # When the next delayed job is due, if one is.
    next_due: int | None = None
    paused: bool = False
    # The queue's global concurrency is reached.
    maxed: bool = False

    def __iter__(self) -> Iterator[LeasedJob]:
        return iter(self.jobs)

    def __len__(self) -> int:
        return len(self.jobs)

    @overload
    def __getitem__(self, index: int) -> LeasedJob: ...

    @overload
    def __getitem__(self, index: slice) -> list[LeasedJob]: ...

    def __getitem__(self, index: int | slice) -> LeasedJob | list[LeasedJob]:
        return self.jobs[index]

    @classmethod
    def from_proto(cls, queue: str, leased: Leased | None) -> LeaseBatch:
        if leased is None:
            return cls(jobs=[])
        info = leased.info
        return cls(
            jobs=[LeasedJob.from_proto(queue, lease) for lease in leased.leases],
            rate_limit_ms=info.rate_limit_ms if info else 0,
            next_due=info.next_due if info and info.has_field("next_due") else None,
            paused=info.paused if info else False,
            maxed=info.maxed if info else False,
        )


@dataclass
class CompleteResult:
    # UNSPECIFIED when retention removed the job at once.
    state: JobState
    finished_on: int | None
    # For WaitChildren: whether the job now waits.
    moved: bool
    # The next job, when fetch_next asked for one.
    next: LeaseBatch
    rate_limit_ttl_ms: int | None = None


@dataclass(frozen=True)
class QueueEvent:
    """One entry of a queue's event log; `seq` is the cursor to resume after it."""

    seq: int
    ts: int
    name: str
    fields: dict[str, str] = field(default_factory=dict)

    @property
    def job_id(self) -> str | None:
        return self.fields.get("jobId")

    @classmethod
    def from_proto(cls, event: Event) -> QueueEvent:
        return cls(seq=event.seq, ts=event.ts, name=event.name, fields={f.key: f.value for f in event.fields})


def lease_options(
    max_jobs: int,
    *,
    token: str = "",
    worker: str | None = None,
    lock_duration_ms: int = 0,
    names: Iterable[str] | None = None,
    limiter: RateLimit | None = None,
) -> LeaseOptions:
    return LeaseOptions(
        max=max_jobs,
        token=token,
        worker=worker,
        lock_duration_ms=lock_duration_ms,
        names=text_list(names or [], "names"),
        limiter=limiter,
    )
