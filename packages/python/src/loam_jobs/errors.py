"""Typed errors of the Loam Jobs client.

The server answers every failed call with a Connect error code and an
`loam.jobs.v1.ErrorDetail` (a stable `reason` such as `fenced.no_lease`,
BullMQ's error code, the subject and a retry-after); a request its RPC
framework refuses before the call runs (a body it cannot decode, say) has
the code alone, and an empty `reason`. `from_connect_error`
turns that into one exception class per code, with the few reasons a caller
acts on (fencing, payload size, rate limits, paused queues) as subclasses.
It is the only place where Connect errors become client errors.
"""

from __future__ import annotations

from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import DescOneof, Message

from ._gen.loam.jobs.v1.jobs_pb import BulkError, ErrorDetail

__all__ = [
    "LoamJobsError",
    "InvalidArgumentError",
    "NotFoundError",
    "AlreadyExistsError",
    "FailedPreconditionError",
    "ForkedProcessError",
    "ClientClosedError",
    "FencedError",
    "IdempotencyConflictError",
    "ResourceExhaustedError",
    "PayloadTooLargeError",
    "RateLimitedError",
    "UnavailableError",
    "QueuePausedError",
    "DeadlineExceededError",
    "UnauthenticatedError",
    "PermissionDeniedError",
    "InternalError",
    "CanceledError",
    "UnknownError",
    "UnimplementedError",
    "AbortedError",
    "DataLossError",
    "OutOfRangeError",
    "EventsTrimmedError",
    "InvalidJsonError",
    "from_connect_error",
]

_DETAIL_TYPE = "loam.jobs.v1.ErrorDetail"


class LoamJobsError(Exception):
    """A call the server (or the connection to it) refused, or a value read
    back that the client could not decode.

    Attributes:
        code: the Connect code name (`invalid_argument`, `not_found`, ...),
            or `invalid_json` (`InvalidJsonError`).
        message: the server's human-readable message.
        reason: the server's stable, machine-readable reason
            (`not_found.job`, `fenced.mismatch`, `payload_too_large`, ...);
            empty when the error did not come from the server's handlers
            (a transport failure, a refused request body).
        bullmq_code: BullMQ's error code (-1 JobNotExist ... -11), or 0.
        subject: the job id, queue, scheduler or key the error is about, or "".
        retry_after_ms: when to try again (a rate limit, a busy server's
            `unavailable`); else 0. Retries and watch reconnects wait at
            least this long (up to 2 s).
        tries: how many times the client sent the call (more than 1 when
            its outcome was unknown and it was sent again until the
            client's `retry_for_ms` was spent).
        idempotency_key: the key an enqueue was sent under, when a try of
            it may have been applied (it was sent again, or its outcome is
            unknown): sent again under this key (`idempotency_key=`), while
            the server keeps it, it is added at most once. None otherwise.
    """

    code: str = "unknown"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        reason: str = "",
        bullmq_code: int = 0,
        subject: str = "",
        retry_after_ms: int = 0,
    ) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.reason = reason
        self.bullmq_code = bullmq_code
        self.subject = subject
        self.retry_after_ms = retry_after_ms
        self.tries = 1
        self.idempotency_key: str | None = None

    def __str__(self) -> str:
        extra = f" ({self.reason})" if self.reason else ""
        return f"[{self.code}] {self.message}{extra}"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(message={self.message!r}, reason={self.reason!r}, "
            f"bullmq_code={self.bullmq_code}, subject={self.subject!r})"
        )


class InvalidArgumentError(LoamJobsError):
    """A malformed request: a bad queue name, cron expression, option..."""

    code = "invalid_argument"


class NotFoundError(LoamJobsError):
    """The job, parent job, queue or scheduler does not exist."""

    code = "not_found"


class AlreadyExistsError(LoamJobsError):
    code = "already_exists"


class FailedPreconditionError(LoamJobsError):
    """The store is not in the state the call needs (job not in that state,
    pending children, queue not paused, ...)."""

    code = "failed_precondition"


class ForkedProcessError(FailedPreconditionError):
    """A call in a process forked after a client was made. The HTTP runtime
    under every client does not survive `fork`: each call, in a client made
    before the fork or after it, would hang. Make clients only after forking
    (multiprocessing's `spawn` or `forkserver` start method, gunicorn without
    `--preload`)."""


class ClientClosedError(FailedPreconditionError):
    """An operation started on a client after its `close()` (or after its
    `with` block): nothing was sent. Make a new client. (An operation already
    under way when the client closed ends as it would have.)"""


class FencedError(FailedPreconditionError):
    """The caller no longer holds the job's lease (`fenced.no_lease`) or holds
    another one (`fenced.mismatch`): its outcome was not recorded."""


class IdempotencyConflictError(FailedPreconditionError):
    """An idempotency key was reused with a different job."""


class ResourceExhaustedError(LoamJobsError):
    code = "resource_exhausted"


class PayloadTooLargeError(ResourceExhaustedError):
    """A payload, result or value over the server's --max-payload-bytes, or a
    request over --max-request-bytes."""


class RateLimitedError(ResourceExhaustedError):
    """The queue's rate limit is reached; see `retry_after_ms`."""


class UnavailableError(LoamJobsError):
    """The server cannot be reached or is shutting down, or the queue is paused."""

    code = "unavailable"


class QueuePausedError(UnavailableError):
    """A refusal with the reason `queue_paused`. The server gives it no call
    today: a `lease` of a paused queue returns an empty batch with
    `paused=True` instead (and a watch of one goes on)."""

    code = "unavailable"


class DeadlineExceededError(LoamJobsError, TimeoutError):
    code = "deadline_exceeded"


class UnauthenticatedError(LoamJobsError):
    """No bearer token, or one the server does not know."""

    code = "unauthenticated"


class PermissionDeniedError(LoamJobsError):
    """The token does not grant the namespace the call named."""

    code = "permission_denied"


class OutOfRangeError(LoamJobsError):
    code = "out_of_range"


class EventsTrimmedError(OutOfRangeError):
    """A watch cursor older than the oldest event the queue's log still
    holds: the events in between are gone. `subject` is the oldest kept
    sequence; resynchronise (read the jobs' state) before watching again."""


class InvalidJsonError(LoamJobsError, ValueError):
    """A value read back as JSON (`result_get_json`) that is not JSON text:
    `subject` is its key, and the `json.JSONDecodeError` is the cause. A
    `ValueError`, as json.loads' own error is."""

    code = "invalid_json"


class InternalError(LoamJobsError):
    code = "internal"


class CanceledError(LoamJobsError):
    code = "canceled"


class UnknownError(LoamJobsError):
    """A failure the server or the transport could not put a code on."""

    code = "unknown"


class UnimplementedError(LoamJobsError):
    """A call the server does not have (a server older than this client)."""

    code = "unimplemented"


class AbortedError(LoamJobsError):
    """A call the server gave up on part way (a conflict with another)."""

    code = "aborted"


class DataLossError(LoamJobsError):
    """The server found stored data lost or corrupt."""

    code = "data_loss"


_BY_CODE: dict[str, type[LoamJobsError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        AlreadyExistsError,
        FailedPreconditionError,
        ResourceExhaustedError,
        UnavailableError,
        DeadlineExceededError,
        UnauthenticatedError,
        PermissionDeniedError,
        InternalError,
        CanceledError,
        UnknownError,
        UnimplementedError,
        AbortedError,
        DataLossError,
        OutOfRangeError,
    )
}


def _class_for(code: str, reason: str) -> type[LoamJobsError]:
    if reason.startswith("fenced."):
        return FencedError
    if reason == "idempotency_conflict":
        return IdempotencyConflictError
    if reason == "payload_too_large":
        return PayloadTooLargeError
    if reason == "rate_limited":
        return RateLimitedError
    if reason == "queue_paused":
        return QueuePausedError
    if reason == "events_trimmed":
        return EventsTrimmedError
    if code == "resource_exhausted" and not reason:
        # The server refuses an oversized request body before decoding it,
        # so that refusal carries no detail.
        return PayloadTooLargeError
    return _BY_CODE.get(code, LoamJobsError)


def _build(code: str, message: str, detail: ErrorDetail | None) -> LoamJobsError:
    detail = detail or ErrorDetail()
    cls = _class_for(code, detail.reason)
    return cls(
        message,
        code=code,
        reason=detail.reason,
        bullmq_code=detail.bullmq_code,
        subject=detail.subject,
        retry_after_ms=detail.retry_after_ms,
    )


def from_connect_error(err: ConnectError, request: Message[Any] | None = None) -> LoamJobsError:
    """The client error for a Connect error raised by the generated stubs
    (for `request`, whose field it names when the stub could not encode it)."""
    detail = None
    for attached in err.details:
        if attached.type_name == _DETAIL_TYPE:
            detail = attached.value(ErrorDetail)
            break
    code = err.code.value if isinstance(err.code, Code) else str(err.code)
    if err.code == Code.UNAVAILABLE and _refused_before_sending(err):
        # The stubs report every failure of a call as `unavailable`, their own
        # refusal to encode a value (a negative or float count, a bool) too:
        # that request never left, and sending it again would fail the same.
        field = None if request is None else _unsendable_field(request)
        at = "" if field is None else f"{type(request).__name__}.{field}: "
        return InvalidArgumentError(f"request not sent: {at}{err.message}")
    return _build(code, err.message, detail)


# What the protobuf runtime raises for a value it cannot encode (a wrong
# type, a number out of range).
UNENCODABLE = (TypeError, ValueError, ArithmeticError)


def _refused_before_sending(err: ConnectError) -> bool:
    cause = err.__cause__
    return isinstance(cause, UNENCODABLE) and not isinstance(cause, OSError)


def _unsendable_field(message: Message[Any]) -> str | None:
    """The path of the first field of `message` that cannot be encoded
    (`options.max`, `nodes[2].job.priority`, `counts.types`): the runtime's
    own error names only the value."""
    for member in message.desc().members:
        if isinstance(member, DescOneof):
            chosen = getattr(message, member.local_name)
            if chosen is None:
                continue
            name, value, alone = str(chosen.field), chosen.value, {member.local_name: chosen}
        else:
            name = member.local_name
            if not message.has_field(name):
                continue
            value = getattr(message, name)
            alone = {name: value}
        if isinstance(value, Message):
            inner = _unsendable_field(value)
            if inner is not None:
                return f"{name}.{inner}"
            continue
        if isinstance(value, list) and value and isinstance(value[0], Message):
            for index, item in enumerate(value):
                inner = _unsendable_field(item)
                if inner is not None:
                    return f"{name}[{index}].{inner}"
            continue
        try:
            type(message)(**alone).to_binary()
        except UNENCODABLE:
            return name
    return None


def from_bulk_error(err: BulkError) -> LoamJobsError:
    """The client error for one failed job of an EnqueueBulk."""
    return _build(err.code, err.message, err.detail)
