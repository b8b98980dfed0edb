"""Fixtures: a real `loam-jobs serve` process per test session.

The binary is $LOAM_JOBS_BIN, else `loam-jobs` in $CARGO_TARGET_DIR or the
repository's target/ (debug, then release). Build it with
`cargo build -p loam-jobs-server`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from loam_jobs import Client

REPO_ROOT = Path(__file__).resolve().parents[3]
# Small limits, so the size tests need no large payloads.
MAX_PAYLOAD_BYTES = 64 * 1024
MAX_REQUEST_BYTES = 256 * 1024
# Tokens are at least 16 characters (the server refuses shorter ones).
ALPHA_TOKEN = "alpha-token-0123456789"
BETA_TOKEN = "beta-token-0123456789"
PR_SET_PDEATHSIG = 1


def server_binary() -> Path:
    if env := os.environ.get("LOAM_JOBS_BIN"):
        return Path(env)
    target_dirs = [Path(os.environ["CARGO_TARGET_DIR"])] if os.environ.get("CARGO_TARGET_DIR") else []
    target_dirs.append(REPO_ROOT / "target")
    for target in target_dirs:
        for profile in ("debug", "release"):
            candidate = target / profile / "loam-jobs"
            if candidate.is_file():
                return candidate
    pytest.exit(
        "no loam-jobs binary: run `cargo build -p loam-jobs-server` or set LOAM_JOBS_BIN",
        returncode=2,
    )


def _die_with_parent() -> None:
    # A killed test run (a timeout, Ctrl-C) must not leave servers behind:
    # on Linux the kernel sends the server SIGTERM when pytest dies.
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(
    data_dir: Path, env_extra: dict[str, str] | None = None, port: int | None = None, args: Sequence[str] = ()
) -> Server:
    port = port or free_port()
    log_path = data_dir.parent / f"{data_dir.name}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOAM_JOBS_")}
    env.update(env_extra or {})
    env.setdefault("RUST_LOG", "warn")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                str(server_binary()),
                "serve",
                "--listen",
                f"127.0.0.1:{port}",
                "--data-dir",
                str(data_dir),
                "--max-payload-bytes",
                str(MAX_PAYLOAD_BYTES),
                "--max-request-bytes",
                str(MAX_REQUEST_BYTES),
                "--shutdown-grace-secs",
                "2",
                *args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_die_with_parent,
        )
    server = Server(url=f"http://127.0.0.1:{port}", process=process, log_path=log_path)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"loam-jobs exited with {process.returncode}:\n{server.log()}")
        try:
            with urllib.request.urlopen(f"{server.url}/healthz", timeout=1) as resp:
                if resp.status == 200:
                    return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"loam-jobs did not become healthy:\n{server.log()}")


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("server") / "data")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with token authentication: ALPHA_TOKEN -> alpha, BETA_TOKEN -> beta."""
    tokens = f"{ALPHA_TOKEN}=alpha,{BETA_TOKEN}=beta"
    srv = start_server(tmp_path_factory.mktemp("auth-server") / "data", {"LOAM_JOBS_TOKENS": tokens})
    yield srv
    stop_server(srv)


@pytest.fixture
def client(server: Server) -> Iterator[Client]:
    with Client(server.url) as c:
        yield c


@pytest.fixture
def queue() -> str:
    """A queue name no other test uses (all tests share one server)."""
    return f"q-{uuid.uuid4().hex[:12]}"
