"""The router process (``python -m kvturn_server.router``, uvicorn, real sockets) against
bodies sent to exhaust it: its memory and its connections stay bounded."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvturn_server.local import free_port

ROOT = Path(__file__).resolve().parents[3]
GROWTH_BOUND_MIB = 96  # the default body cap is 32 MiB; what is over it is never held


def _hwm_mib(pid: int) -> float:
    match = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    assert match is not None
    return int(match.group(1)) / 1024


@pytest.fixture
def router() -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    port = free_port()
    env = {**os.environ}
    env.setdefault("PYTHONPATH", os.pathsep.join(
        str(ROOT / p) for p in ("server", "sdk", "integrations")))
    # Backends nobody listens on: every request here is refused before any leg.
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvturn_server.router", "--prefill", f"http://127.0.0.1:{free_port()}",
         "--decode", f"http://127.0.0.1:{free_port()}", "--port", str(port),
         "--health-interval", "3600", "--body-timeout", "1"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert proc.poll() is None, "the router exited at start-up"
                assert time.monotonic() < deadline, "the router did not listen within 30 s"
                time.sleep(0.05)
        yield port, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: router\r\n"
        b"content-type: application/json\r\n")


def _response(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except OSError:
        pass
    return data


def test_a_chunked_256_mib_body_is_refused_without_growing_the_router(
        router: tuple[int, subprocess.Popen[bytes]]) -> None:
    port, proc = router
    before = _hwm_mib(proc.pid)
    chunk = b"x" * (1 << 20)
    frame = b"100000\r\n" + chunk + b"\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(HEAD + b"transfer-encoding: chunked\r\n\r\n"
                     + b'e\r\n{"messages": "\r\n')
        try:
            for _ in range(256):
                sock.sendall(frame)
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the router refused and closed: expected
        reply = _response(sock)
    grown = _hwm_mib(proc.pid) - before
    assert grown < GROWTH_BOUND_MIB, f"the router's peak RSS grew {grown:.0f} MiB"
    if reply:  # a reset can drop the answer itself; the memory is the point
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert b"body_too_large" in reply


def test_a_body_that_never_completes_frees_its_connection(
        router: tuple[int, subprocess.Popen[bytes]]) -> None:
    port, _ = router
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(HEAD + b"content-length: 1000\r\n\r\n" + b'{"model": ')
        started = time.monotonic()
        reply = _response(sock)  # returns when the router closes the connection
        took = time.monotonic() - started
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"body_timeout" in reply
    assert took < 5  # --body-timeout 1


@pytest.mark.parametrize("garbage", [
    b"NOT AN HTTP REQUEST\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nhost router\r\n\r\n",  # a header without a colon
    b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: ten\r\n\r\n",
])
def test_a_request_that_does_not_parse_gets_an_openai_shaped_400(
        router: tuple[int, subprocess.Popen[bytes]], garbage: bytes) -> None:
    port, _ = router
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(garbage)
        reply = _response(sock)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), reply[:200]
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "bad_request"
    assert error["message"].startswith("malformed HTTP request")
