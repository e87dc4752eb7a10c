"""Integration tests: a real `radixserve serve` subprocess on a free port, used through httpx and
the official openai client. One server (session scope) serves most tests; a second, smaller one
runs beside it for queue-full / API-key / killed-scheduler tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from processes import free_port  # noqa: E402,F401  (the tests here import it from conftest)
from triton_import import import_triton_interpreted  # noqa: E402

import_triton_interpreted()  # before anything here imports triton (see tests/triton_import.py)

REPO = Path(__file__).resolve().parents[2]
MAX_TOTAL_TOKENS = 6000
STARTUP_TIMEOUT = 180
TRITON_INTERPRET_AT_START = os.environ.get("TRITON_INTERPRET")  # read before any test module is imported


def pytest_configure(config):
    config.addinivalue_line("markers", "after_all: runs after every other integration test (checks what they left)")


def pytest_collection_modifyitems(config, items):
    """Tests marked after_all go after the last other test of this directory, whatever the file
    names or the order pytest was given them in."""
    here = Path(__file__).parent
    ours = [i for i in items if Path(str(i.fspath)).parent == here]
    last = [i for i in ours if i.get_closest_marker("after_all")]
    if not last:
        return
    rest = [i for i in items if i not in last]
    at = max((n for n, i in enumerate(rest) if i in ours), default=len(rest) - 1) + 1
    items[:] = rest[:at] + last + rest[at:]


def child_pids(pid: int) -> List[int]:
    out: List[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def assert_children_gone(pids: List[int], timeout: float = 10) -> None:
    """Every child process exits soon after the server (no orphans)."""
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if pid_alive(p)]


class ServerProcess:
    """`radixserve serve` on a free port; with wait=False, call wait_healthy() later (servers
    that start side by side). start_new_session: in a process group of its own (pgid = its pid),
    as a service manager starts it, so a test can signal the whole group."""

    def __init__(self, *args: str, api_key: Optional[str] = None, wait: bool = True, start_new_session: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile("w+", prefix="radixserve-test-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=start_new_session)
        if wait:
            self.wait_healthy()

    def wait_healthy(self) -> None:
        self._wait_healthy()
        self.children = child_pids(self.proc.pid)
        m = re.search(r"IPC sockets in (\S+)", self.read_log())
        self.ipc_dir = m.group(1) if m else None

    @property
    def headers(self) -> Dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def read_log(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def tp_rank_pid(self, tp_rank: int) -> int:
        """The pid a TP rank's scheduler logs when it is ready (not a guess from pid order)."""
        m = re.search(rf"scheduler TP{tp_rank}\] Scheduler ready \(pid (\d+)\)", self.read_log())
        assert m, self.read_log()
        assert int(m.group(1)) in self.children
        return int(m.group(1))

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.proc.kill()
        raise RuntimeError(f"server did not become healthy:\n{self.read_log()}")

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=kw.pop("timeout", 120), **kw)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return self.proc.returncode


def start_float32_server(model_path, max_total_tokens: int) -> ServerProcess:
    """A real model served in float32 (the tests compare it with transformers), started without
    waiting: it loads while the test process loads its own models. serve_until_done() waits."""
    return ServerProcess("--model-path", str(model_path), "--dtype", "float32",
                         "--max-total-tokens", str(max_total_tokens), wait=False)


def serve_until_done(srv: ServerProcess):
    """A module fixture's body: wait for the server, hand it out, then a clean stop (exit 0, no
    child left)."""
    srv.wait_healthy()  # kills the server if it does not come up
    yield srv
    code = srv.stop()
    assert code == 0, srv.read_log()[-3000:]
    assert_children_gone(srv.children)


@pytest.fixture(scope="session")
def server():
    srv = ServerProcess(
        "--max-total-tokens", str(MAX_TOTAL_TOKENS),
        "--max-request-body-bytes", "200000",
        "--decode-log-interval", "5",
    )
    yield srv
    code = srv.stop()
    # SIGTERM: a clean exit, no child left, no socket file left.
    assert code == 0, srv.read_log()[-3000:]
    assert_children_gone(srv.children)
    assert srv.ipc_dir and not os.path.exists(srv.ipc_dir)


@pytest.fixture(scope="session")
def http(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="session")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model_name(http):
    return http.get("/v1/models").json()["data"][0]["id"]


def greedy(max_new_tokens: int = 8, **kw) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": 0, **kw}


def server_state(http: httpx.Client) -> dict:
    r = http.get("/get_server_info")
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(http: httpx.Client, timeout: float = 30) -> dict:
    """Until nothing runs or waits in the scheduler and the tokenizer manager holds no request."""
    deadline = time.monotonic() + timeout
    while True:
        info = server_state(http)
        if info["num_running_reqs"] == 0 and info["num_queue_reqs"] == 0 and info["tokenizer_manager"]["num_pending_reqs"] == 0:
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle: {info['internal_states']}")
        time.sleep(0.1)


def stream_in_background(srv: "ServerProcess", body: dict, timeout: float = 120) -> "tuple":
    """POST a streaming /generate on a thread; returns (thread, events): the data of each SSE
    event, appended as it arrives (the last is "[DONE]")."""
    import threading

    events: List[str] = []

    def run() -> None:
        with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=timeout) as c:
            with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])

    t = threading.Thread(target=run)
    t.start()
    return t, events
