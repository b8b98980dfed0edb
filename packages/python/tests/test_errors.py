"""Bad input, limits and authentication raise typed errors with the server's reason."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError

import loam_jobs
from loam_jobs import (
    Client,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    InvalidJsonError,
    Job,
    LeasedJob,
    LoamJobsError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    ResourceExhaustedError,
    Success,
    UnauthenticatedError,
    UnavailableError,
    _ops,
    job,
)
from loam_jobs._gen.loam.jobs.v1.jobs_pb import EnqueueBulkResponse, EnqueueResponse, EnqueueResult
from loam_jobs._ops import Call
from loam_jobs.client import _Reconnect, _release
from loam_jobs.errors import from_connect_error

from .conftest import (
    ALPHA_TOKEN,
    BETA_TOKEN,
    MAX_PAYLOAD_BYTES,
    MAX_REQUEST_BYTES,
    Server,
    free_port,
    start_server,
    stop_server,
)


def test_invalid_queue_names(client: Client) -> None:
    with pytest.raises(InvalidArgumentError) as empty:
        client.enqueue("", "a", None)
    assert empty.value.reason == "invalid_argument"
    assert empty.value.code == "invalid_argument"
    assert "queue name" in empty.value.message
    with pytest.raises(InvalidArgumentError):
        client.enqueue("q" * 1025, "a", None)


def test_oversized_payloads(client: Client, queue: str) -> None:
    with pytest.raises(PayloadTooLargeError) as payload:
        client.enqueue(queue, "big", b"x" * (MAX_PAYLOAD_BYTES + 1))
    assert payload.value.reason == "payload_too_large"
    assert isinstance(payload.value, ResourceExhaustedError)

    client.enqueue(queue, "small", None)
    leased = client.lease(queue)[0]
    with pytest.raises(PayloadTooLargeError):
        client.complete(leased, Success(b"r" * (MAX_PAYLOAD_BYTES + 1)))
    with pytest.raises(PayloadTooLargeError):
        client.result_set(f"{queue}:big", b"v" * (MAX_PAYLOAD_BYTES + 1))

    # A request over --max-request-bytes is refused before it is decoded.
    with pytest.raises(ResourceExhaustedError) as request:
        client.enqueue(queue, "huge", b"x" * (MAX_REQUEST_BYTES + 1))
    assert isinstance(request.value, PayloadTooLargeError)


def test_not_found_and_preconditions(client: Client, queue: str) -> None:
    with pytest.raises(NotFoundError) as missing:
        client.retry(queue, "missing")
    assert missing.value.bullmq_code == -1 and missing.value.subject == "missing"

    waiting = client.enqueue(queue, "w", None)
    # Only a finished job can be retried.
    with pytest.raises(FailedPreconditionError) as state:
        client.retry(queue, waiting.id)
    assert state.value.reason == "precondition.not_in_state"
    assert state.value.bullmq_code == -3


def test_values_the_wire_cannot_carry_are_refused_before_sending() -> None:
    # No server: a request the client cannot encode must not be taken for one
    # that could not reach it (retried, then reported as unavailable).
    # The message names the request's field: the runtime's own names only the value.
    with Client(f"http://127.0.0.1:{free_port()}") as nowhere:
        for options, field in (
            ({"delay_ms": -1}, "job.delay_ms"),
            ({"delay_ms": 1.5}, "job.delay_ms"),
            ({"attempts": 2**40}, "job.attempts"),
            ({"remove_on_complete": 1.7}, "job.remove_on_complete.keep.count"),
        ):
            with pytest.raises(InvalidArgumentError) as refused:
                nowhere.enqueue("q", "a", None, **options)  # type: ignore[arg-type]
            assert refused.value.message.startswith(f"request not sent: EnqueueRequest.{field}: ")
        with pytest.raises(
            InvalidArgumentError, match=r"request not sent: JobAdminRequest\.change_priority\.priority: "
        ):
            nowhere.change_priority("q", "j", -1)
        with pytest.raises(InvalidArgumentError, match=r"request not sent: LeaseRequest\.options\.max: "):
            nowhere.lease("q", max_jobs=-1)
        with pytest.raises(InvalidArgumentError, match=r"request not sent: QueryRequest\.counts\.types: "):
            nowhere.counts("q", 5)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match=r"request not sent: WatchRequest\.after: "):
            next(nowhere.watch("q", after=-1))


def test_arguments_of_the_wrong_kind_are_refused_before_sending() -> None:
    # Each was a TypeError or AttributeError from inside the client, or, for
    # one string where a list of them goes, a call about its characters.
    lease = LeasedJob(queue="q", job=Job(id="1"), epoch=1, token="t", deadline=0)
    with Client(f"http://127.0.0.1:{free_port()}") as nowhere:
        one_string: list[Callable[[], object]] = [
            lambda: nowhere.ranges("q", "wait"),
            lambda: nowhere.get_jobs("q", "abc"),
            lambda: nowhere.result_mget("abc"),
            lambda: nowhere.result_mget_json("abc"),
            lambda: nowhere.get_meta("q", "abc"),
            lambda: nowhere.remove_meta_fields("q", "abc"),
            lambda: nowhere.lease("q", names="abc"),  # type: ignore[arg-type]
        ]
        for call in one_string:
            with pytest.raises(
                InvalidArgumentError, match="request not sent: .* takes a list of strings, not one"
            ):
                call()
        for wait in (None, "100", 1.5, True, -1):
            with pytest.raises(
                InvalidArgumentError, match="request not sent: wait_ms must be a whole number"
            ):
                nowhere.lease("q", wait_ms=wait)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="request not sent: a job's name is a string"):
            nowhere.enqueue("q", None)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="request not sent: idempotency_key is empty"):
            nowhere.enqueue("q", "a", idempotency_key="")
        # BullMQ reads a job's options as an object: the server refuses others.
        for opts in ("null", "5", "[1]", ["a"]):
            with pytest.raises(InvalidArgumentError, match="request not sent: opts is a mapping"):
                nowhere.enqueue("q", "a", opts=opts)  # type: ignore[arg-type]
        for outcome in (Success, "ok", Exception("boom")):
            with pytest.raises(InvalidArgumentError, match="request not sent: the outcome must be"):
                nowhere.complete(lease, outcome)  # type: ignore[arg-type]
    for timeout in (-1, "5", 1.5):
        with pytest.raises(InvalidArgumentError, match="timeout_ms must be a whole number"):
            Client("http://127.0.0.1:1", timeout_ms=timeout)  # type: ignore[arg-type]


def test_values_json_cannot_carry_are_refused_before_sending() -> None:
    # NaN and the infinities would be written as `NaN` and `Infinity`, which
    # JSON.parse (a BullMQ worker) cannot read. No server: a request sent
    # would fail as unavailable, not as an invalid argument.
    leased = LeasedJob(queue="q", job=Job(id="j"), epoch=1, token="t", deadline=0)
    with Client(f"http://127.0.0.1:{free_port()}") as nowhere:

        def every_write_of(bad: object) -> list[Callable[[], object]]:
            return [
                lambda: nowhere.enqueue("q", "a", bad),
                lambda: nowhere.enqueue("q", "a", None, opts={"x": bad}),
                lambda: nowhere.enqueue_bulk("q", [{"name": "a", "data": bad}]),
                lambda: nowhere.schedule("q", "s", "a", bad, every_ms=1_000),
                lambda: nowhere.complete(leased, Success(bad)),
                lambda: nowhere.report(leased, progress=bad),
                lambda: nowhere.report(leased, data=bad),
                lambda: nowhere.result_set("k", bad),
            ]

        for bad in (float("nan"), float("inf"), -float("inf"), {"nested": [float("nan")]}, object()):
            for write in every_write_of(bad):
                with pytest.raises(InvalidArgumentError) as refused:
                    write()
                assert "request not sent" in refused.value.message


def test_the_client_writes_json_in_one_place() -> None:
    # Every JSON value goes through encode_json, which refuses NaN.
    package = Path(loam_jobs.__file__).parent
    writers = {path.name: path.read_text().count("json.dumps(") for path in package.glob("*.py")}
    assert {name: count for name, count in writers.items() if count} == {"models.py": 1}


def test_unreachable_server_is_unavailable() -> None:
    with Client(f"http://127.0.0.1:{free_port()}", retry_for_ms=1_500) as nowhere:
        started = time.monotonic()
        with pytest.raises(UnavailableError) as down:
            nowhere.drain("q")
        assert time.monotonic() - started < 1, "a write that is not safe to repeat is not tried again"
        assert down.value.tries == 1
        # A read is, until the client's retry budget is spent.
        started = time.monotonic()
        with pytest.raises(UnavailableError) as still_down:
            nowhere.result_get("k")
        # The last try at the end of the budget (and a connect's few ms).
        assert 1.5 <= time.monotonic() - started < 2.5
        assert still_down.value.tries >= 3 and still_down.value.idempotency_key is None
    assert down.value.reason == ""


Calls = dict[str, Callable[[], Any]]


def _asked_while_away(
    data_dir: Path,
    prepare: Callable[[Client], Calls],
    away_seconds: float,
    check: Callable[[Client, dict[str, Any]], None],
) -> None:
    """Starts a server, `prepare`s its data and the calls to make, stops it,
    makes each call from a thread of its own (each call's first try is
    refused), starts the server again on the same port and data after
    `away_seconds`, and `check`s each call's answer (or error)."""
    server = start_server(data_dir)
    port = int(server.url.rsplit(":", 1)[1])
    try:
        with Client(server.url) as client:
            calls = prepare(client)
            stop_server(server)
            answers: dict[str, Any] = {}

            def ask(name: str, call: Callable[[], Any]) -> None:
                try:
                    answers[name] = call()
                except LoamJobsError as err:
                    answers[name] = err

            threads = [threading.Thread(target=ask, args=item) for item in calls.items()]
            for thread in threads:
                thread.start()
            time.sleep(away_seconds)
            server = start_server(data_dir, port=port)
            for thread in threads:
                thread.join(timeout=30)
            check(client, answers)
    finally:
        stop_server(server)


def test_an_enqueue_made_while_the_server_restarts_for_seconds_is_added_once_it_is_back(
    tmp_path: Path,
) -> None:
    def prepare(client: Client) -> Calls:
        client.enqueue("restarts", "before")
        return {"add": lambda: client.enqueue("restarts", "during")}

    def check(client: Client, answers: dict[str, Any]) -> None:
        assert type(answers["add"]).__name__ == "Enqueued"
        assert client.counts("restarts", "waiting") == {"waiting": 2}

    # Away for longer than a restart of a few seconds, as a killed server
    # with a log to replay is.
    _asked_while_away(tmp_path / "data", prepare, 4, check)


def test_calls_safe_to_repeat_made_while_the_server_is_away_are_answered_once_it_is_back(
    tmp_path: Path,
) -> None:
    def prepare(client: Client) -> Calls:
        client.enqueue("restarts", "a", job_id="a")
        client.enqueue("restarts", "b", job_id="b")
        held = client.lease("restarts", lock_duration_ms=60_000)[0]
        return {
            "counts": lambda: client.counts("restarts", "waiting", "active"),
            "lease": lambda: [leased.id for leased in client.lease("restarts", lock_duration_ms=60_000)],
            "extend": lambda: client.extend([held], 60_000),
            "pause": lambda: client.pause("restarts-other"),
            "result_set": lambda: client.result_set("restarts-result", {"ok": True}),
        }

    def check(client: Client, answers: dict[str, Any]) -> None:
        assert answers["counts"] in ({"waiting": 1, "active": 1}, {"waiting": 0, "active": 2})
        assert answers["lease"] == ["b"]
        assert answers["extend"] == []
        assert answers["pause"] is None and client.is_paused("restarts-other")
        assert answers["result_set"] is None and client.result_get_json("restarts-result") == {"ok": True}

    _asked_while_away(tmp_path / "data", prepare, 0.05, check)


def test_client_timeout_is_deadline_exceeded() -> None:
    # A server that takes the connection and never answers.
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with Client(url, timeout_ms=100, retry_for_ms=0) as hurried:
            with pytest.raises(DeadlineExceededError) as late:
                hurried.result_get("k")
        assert isinstance(late.value, TimeoutError)
        with pytest.raises(InvalidArgumentError, match="timeout_ms must be at least 1 ms"):
            Client(url, timeout_ms=0)
    finally:
        silent.close()


def test_tokens_choose_the_namespace(auth_server: Server) -> None:
    with pytest.raises(UnauthenticatedError) as no_token:
        Client(auth_server.url).enqueue("q", "a", None)
    assert no_token.value.reason == "unauthenticated"
    with pytest.raises(UnauthenticatedError):
        Client(auth_server.url, token="wrong-token-0123456789").enqueue("q", "a", None)
    with pytest.raises(PermissionDeniedError) as other_ns:
        Client(auth_server.url, token=ALPHA_TOKEN, namespace="beta").enqueue("q", "a", None)
    assert other_ns.value.reason == "permission_denied"

    alpha = Client(auth_server.url, token=ALPHA_TOKEN)
    beta = Client(auth_server.url, token=BETA_TOKEN, namespace="beta")
    alpha.enqueue("shared-name", "a", None)
    alpha.result_set("k", b"alpha's")
    # The same queue and key names in another namespace are other queues and keys.
    assert beta.counts("shared-name", "wait") == {"wait": 0}
    assert beta.result_get("k") is None
    assert alpha.counts("shared-name", "wait") == {"wait": 1}
    assert alpha.result_get("k") == b"alpha's"


def test_namespaces_without_tokens(client: Client, server: Server, queue: str) -> None:
    team = Client(server.url, namespace="team-b")
    team.enqueue(queue, "a", None)
    assert team.counts(queue, "wait") == {"wait": 1}
    assert client.counts(queue, "wait") == {"wait": 0}


def test_every_error_is_a_loam_jobs_error(client: Client) -> None:
    with pytest.raises(LoamJobsError):
        client.enqueue("", "a", None)


def test_every_connect_code_has_an_error_class_of_its_own_that_the_package_exports() -> None:
    # `unknown`, `unimplemented`, `aborted` and `data_loss` were bare LoamJobsErrors.
    for code in Code:
        err = from_connect_error(ConnectError(code, "m"))
        assert type(err) is not LoamJobsError, code
        assert err.code == code.value
        assert getattr(loam_jobs, type(err).__name__) is type(err)
        assert type(err).__name__ in loam_jobs.__all__


@pytest.mark.parametrize("make", [loam_jobs.Client, loam_jobs.AsyncClient])
def test_a_token_or_namespace_no_header_can_carry_is_refused_at_once(make: Callable[..., object]) -> None:
    bad: list[dict[str, str]] = [{"token": "a\nb"}, {"namespace": "ns\r\nx-evil: 1"}, {"namespace": "naïve"}]
    for given in bad:
        with pytest.raises(InvalidArgumentError, match="printable ASCII"):
            make("http://127.0.0.1:1", **given)


def _refused_in_a_forked_child(call: Callable[[], object]) -> None:
    """Runs `call` in a forked child, which must raise `ForkedProcessError`
    there, not hang or do anything else."""
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            call()
        except loam_jobs.ForkedProcessError:
            code = 0
        except BaseException:
            code = 2
        os._exit(code)
    deadline = time.monotonic() + 20
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_a_process_forked_after_a_client_was_made_is_refused_not_hung(client: Client) -> None:
    # Every call in such a child hung before, with no error: the HTTP runtime
    # under the clients does not survive fork.
    _refused_in_a_forked_child(lambda: Client(client.url).queues())
    client.queues()  # the parent's client is unaffected


def test_a_watch_open_when_the_process_forked_is_refused_in_the_child_not_hung(
    client: Client, queue: str
) -> None:
    # Its stream is read by a thread of the parent's: in the child, the watch
    # handed out what that thread had read, then waited for ever.
    watch = client.watch(queue)
    client.enqueue(queue, "a")
    assert next(watch).name == "added"
    _refused_in_a_forked_child(lambda: [next(watch) for _ in range(5)])
    assert next(watch).name == "waiting"  # the parent's watch goes on
    watch.close()


def test_ctrl_c_in_the_pause_before_a_completions_retry_gives_back_what_it_fetched(
    client: Client, queue: str
) -> None:
    # The first try completed the job and fetched the next, and its answer was
    # lost; Ctrl-C comes in the pause before the retry. The completion is sent
    # again under its key on a helper thread, and the job it fetched goes back
    # to waiting rather than to nobody until its lock expires.
    import _thread

    client.enqueue(queue, "first")
    client.enqueue(queue, "second")
    first = client.lease(queue, max_jobs=1)[0]
    send = client._call
    tries = 0

    def losing_the_first_answer(call: Any) -> Any:
        nonlocal tries
        answer = send(call)
        if call.rpc == "complete":
            tries += 1
            if tries == 1:
                threading.Timer(0.02, _thread.interrupt_main).start()
                raise UnavailableError("the answer was lost")
        return answer

    client._call = losing_the_first_answer  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        client.complete(first, Success(), fetch_next=1, fetch_next_lock_duration_ms=60_000)
    counts: dict[str, int] = {}
    # Generous for a busy machine, and well short of the fetched job's 60 s lock.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        counts = client.counts(queue, "wait", "active", "completed")
        if counts["active"] == 0:
            break
        time.sleep(0.05)
    # The first try, the one sent again to learn what it fetched, and the release.
    assert (counts, tries) == ({"wait": 1, "active": 0, "completed": 1}, 3)


def test_job_data_that_is_not_json_raises_invalid_json_about_the_job(client: Client, queue: str) -> None:
    client.enqueue(queue, "raw", b"\xff not json")
    leased = client.lease(queue)
    assert leased
    with pytest.raises(loam_jobs.InvalidJsonError) as refused:
        leased[0].json()
    assert refused.value.subject == leased[0].job.id


def test_a_closed_client_refuses_every_later_call_and_sends_nothing(server: Server, queue: str) -> None:
    # A call after close() was sent as if the client were open: pyqwest opened
    # new connections for it.
    with Client(server.url) as closed:
        closed.enqueue(queue, "before", None)
    with pytest.raises(loam_jobs.ClientClosedError, match="closed"):
        closed.enqueue(queue, "after", None)
    with pytest.raises(loam_jobs.ClientClosedError):
        closed.watch(queue)
    with pytest.raises(loam_jobs.ClientClosedError):
        next(closed.watch(queue, after=0))
    with Client(server.url) as open_client:
        assert open_client.counts(queue, "wait") == {"wait": 1}


def test_an_operation_under_way_when_its_client_closes_ends_as_it_would_have(
    client: Client, queue: str
) -> None:
    # A paged operation, one call a job: closed from another thread while it
    # runs, it goes on to its end rather than stop half done.
    client.enqueue_bulk(queue, [loam_jobs.job("d", None, delay_ms=600_000) for _ in range(300)])
    closing = Client(client.url)
    failed: list[BaseException] = []
    send = closing._call
    # Whether the client was closed as each call went out.
    closed_when_sent: list[bool] = []
    under_way = threading.Event()

    def sent(call: Any) -> Any:
        closed_when_sent.append(closing._closed)
        under_way.set()
        return send(call)

    closing._call = sent  # type: ignore[method-assign]

    def promote() -> None:
        try:
            closing.promote_jobs(queue, chunk=1)
        except BaseException as err:
            failed.append(err)

    runner = threading.Thread(target=promote)
    runner.start()
    # Closed once its first call is out (a fixed head start could end before
    # the operation began, which then raised ClientClosedError as it should).
    assert under_way.wait(10), "the operation made no call"
    closing.close()
    runner.join(60)
    assert failed == []
    assert any(closed_when_sent), "the operation ended before the client closed"
    assert client.counts(queue, "delayed", "wait") == {"delayed": 0, "wait": 300}


def test_closing_a_client_ends_a_lease_waiting_in_another_thread_and_gives_back_what_it_takes(
    client: Client, queue: str
) -> None:
    # The lease waited out its whole wait: a job that came meanwhile was
    # handed to a caller whose complete() then raised ClientClosedError, and
    # stayed active until its lock expired (a stall); and shutdown waited.
    closing = Client(client.url)
    outcome: list[object] = []

    def lease() -> None:
        try:
            outcome.append(closing.lease(queue, wait_ms=10_000))
        except BaseException as err:
            outcome.append(err)

    waiting = threading.Thread(target=lease, daemon=True)
    waiting.start()
    time.sleep(0.5)  # into the long-poll
    closed = time.monotonic()
    closing.close()
    waiting.join(timeout=5)
    assert not waiting.is_alive(), "close() did not end the lease waiting in another thread"
    assert time.monotonic() - closed < 1
    assert len(outcome) == 1 and isinstance(outcome[0], loam_jobs.ClientClosedError), outcome

    # The long-poll left at the server takes the job that comes now, and gives it back.
    added = client.enqueue(queue, "after-close")
    stored: Job | None = None
    for _ in range(100):
        stored = client.get_job(queue, added.id)
        assert stored is not None
        if stored.attempts_started and stored.state == loam_jobs.JobState.WAITING:
            break
        time.sleep(0.05)
    assert stored is not None
    assert (stored.state, stored.attempts_started, stored.attempts_made) == (loam_jobs.JobState.WAITING, 1, 0)
    assert client.counts(queue, "wait", "active") == {"wait": 1, "active": 0}


def test_an_answer_without_its_job_is_an_internal_error() -> None:
    # The server always answers an add with its job; a reply without one (a
    # server of another version, a proxy's) is the server's fault, said as such.
    add = _ops.enqueue("q", job("a", None))
    next(add)
    with pytest.raises(InternalError, match="no job"):
        add.send(EnqueueResponse())
    bulk = _ops.enqueue_bulk("q", [job("a", None), job("b", None)])
    next(bulk)
    with pytest.raises(StopIteration) as done:
        bulk.send(EnqueueBulkResponse(results=[EnqueueResult(), EnqueueResult()]))
    assert [type(r) for r in done.value.value] == [InternalError, InternalError]


def test_reconnect_pauses_double_up_to_two_seconds_however_long_the_outage() -> None:
    down = UnavailableError("the server is down")
    # Each pause is drawn from the upper half of its bound, so that watches
    # cut off together (a server restart) do not reconnect in step.
    bounds = [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    drawn: list[list[float]] = [[] for _ in bounds]
    for _ in range(300):
        reconnect = _Reconnect(max_attempts=None)
        for pauses in drawn:
            pauses.append(reconnect.pause_after(down))
    for bound, pauses in zip(bounds, drawn, strict=True):
        assert bound / 2 <= min(pauses) and max(pauses) <= bound
        # Spread over that half (300 draws all missing a fifth of it: 1e-29).
        assert min(pauses) < bound * 0.6 and max(pauses) > bound * 0.9
    reconnect = _Reconnect(max_attempts=None)
    pauses = [reconnect.pause_after(down) for _ in range(5000)]
    assert all(1.0 <= pause <= 2.0 for pause in pauses[6:])


def test_a_client_timeout_past_64_bits_keeps_the_servers_key_ttl(server: Server, queue: str) -> None:
    # As good as no bound: the idempotency key keeps the server's default,
    # where its TTL, derived from the bound, could not be encoded.
    with Client(server.url, timeout_ms=sys.maxsize) as patient:
        assert patient.enqueue(queue, "a", None).id


def test_values_no_reader_here_takes_are_invalid_json(client: Client, queue: str) -> None:
    # A worker that catches ValueError for a poison message catches these too.
    deep = b"[" * 5000 + b"]" * 5000  # JSON.stringify writes it; Python's reader recurses too deep
    for stored in (deep, b"NaN", b"-Infinity"):
        client.result_set(f"{queue}:k", stored)
        with pytest.raises(InvalidJsonError):
            client.result_get_json(f"{queue}:k")
        leased = LeasedJob(queue="q", job=Job(id="j", data=stored), epoch=1, token="t", deadline=0)
        with pytest.raises(InvalidJsonError):
            leased.json()
    nested: list[object] = []
    for _ in range(5000):
        nested = [nested]
    with pytest.raises(InvalidArgumentError, match="request not sent"):
        client.enqueue(queue, "deep", nested)


def test_a_job_given_back_keeps_its_key_as_long_as_the_clients_writes() -> None:
    leased = LeasedJob(queue="q", job=Job(id="j"), epoch=1, token="t", deadline=0)
    call = next(_release(leased, _ops.own_key_ttl_ms(30_000, 20_000)))
    assert isinstance(call, Call)
    assert call.request.options.idempotency.ttl_ms == 30_000 + 20_000 + 30_000 + 60_000
