"""The sync and async clients share `Operations`; this holds only while every
public method hands its operation to `_run` and returns what `_run` returns
(the async `_run` returns an awaitable, so nothing may touch its result)."""

from __future__ import annotations

import ast
import inspect
import textwrap

from loam_jobs import AsyncClient, Client, JobOptions, TickJobOptions, job
from loam_jobs._ops import Operations


def _is_run_call(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "_run"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    )


def test_every_public_method_returns_the_run_result_untouched() -> None:
    checked = 0
    for name, method in vars(Operations).items():
        if name.startswith("_") or not callable(method):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
        runs = [n for n in ast.walk(tree) if _is_run_call(n)]
        returned = [n.value for n in ast.walk(tree) if isinstance(n, ast.Return) and n.value is not None]
        assert runs, f"{name} performs no call through _run"
        assert all(any(r is v for v in returned) for r in runs), (
            f"{name} uses _run's result instead of returning it"
        )
        checked += 1
    assert checked > 50


def test_both_clients_have_the_same_public_methods() -> None:
    def public(cls: type) -> set[str]:
        return {n for n in dir(cls) if not n.startswith("_")}

    assert public(Client) == public(AsyncClient)


def test_the_async_stub_names_only_what_it_imports() -> None:
    """`AsyncClient`'s annotations come from the generated stub: a name in a
    signature that the stub does not import is `Any` to a type checker."""
    import builtins
    from pathlib import Path

    import loam_jobs._gen as gen

    stub = ast.parse((Path(gen.__file__).parent / "async_operations.pyi").read_text())
    known = set(dir(builtins))
    for node in stub.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            known |= {(a.asname or a.name).split(".")[0] for a in node.names}
    stub_class = next(n for n in stub.body if isinstance(n, ast.ClassDef))
    methods = [m for m in stub_class.body if isinstance(m, ast.AsyncFunctionDef)]
    named = {
        n.id
        for m in methods
        for part in [m.args, *([m.returns] if m.returns else [])]
        for n in ast.walk(part)
        if isinstance(n, ast.Name)
    }
    assert len(methods) > 50
    assert named - known == set()


def test_the_typed_job_options_are_those_job_takes() -> None:
    # `enqueue` and `schedule` pass their keyword arguments on to `job()`:
    # the TypedDicts that type them must name its options.
    taken = set(inspect.signature(job).parameters) - {"name", "data"}
    assert JobOptions.__optional_keys__ == taken and not JobOptions.__required_keys__
    keyed = {"job_id", "idempotency_key", "idempotency_ttl_ms", "scheduler_id"}
    assert TickJobOptions.__optional_keys__ == taken - keyed
