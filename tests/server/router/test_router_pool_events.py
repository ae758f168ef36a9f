"""A backend's state changes only through its pool's event methods (router/_pool.py): each
event, what it changes, and what it leaves alone."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvturn_server.router._pool import READ_FLOOR_TTL, Backend, Pool

ROUTER = Path(__file__).resolve().parents[3] / "server" / "kvturn_server"


def _decode() -> tuple[Pool, Backend]:
    backend = Backend("decode", "http://d0", control_url="http://d0c")
    return Pool("decode", [backend], eject_after=2, readmit_after=2), backend


def test_a_leg_counts_in_flight_from_its_start_to_its_end() -> None:
    pool, b = _decode()
    pool.leg_started(b)
    pool.leg_started(b)
    assert b.in_flight == 2
    pool.leg_ended(b)
    assert b.in_flight == 1
    with pool.lease(b):
        assert b.in_flight == 2
    assert b.in_flight == 1
    with pytest.raises(RuntimeError), pool.lease(b):
        raise RuntimeError("the leg failed")
    assert b.in_flight == 1  # a leg that raised has ended too


def test_a_continuation_holds_its_tokens_of_the_budget_until_it_ends() -> None:
    pool, b = _decode()
    pool.continuation_started(b, 300)
    pool.continuation_started(b, 200)
    assert b.continuing == 500
    pool.continuation_ended(b, 300)
    assert b.continuing == 200
    pool.continuation_ended(b, 900)  # never below none
    assert b.continuing == 0


def test_a_prefill_s_reports_raise_and_lower_its_read_floor() -> None:
    b = Backend("prefill", "http://p0")
    pool = Pool("prefill", [b], eject_after=2, readmit_after=2)
    pool.read_reported(b, declined=512, reused=0, now=100.0)
    assert (b.read_floor, b.read_floor_at) == (512, 100.0)
    pool.read_reported(b, declined=256, reused=0, now=110.0)
    assert (b.read_floor, b.read_floor_at) == (512, 110.0)  # a fresh floor only rises
    pool.read_reported(b, declined=256, reused=0, now=110.0 + READ_FLOOR_TTL)
    assert b.read_floor == 256  # an old one starts over
    pool.read_reported(b, declined=0, reused=100, now=200.0)
    assert b.read_floor == 99  # a read lowers it below what was read
    pool.read_reported(b, declined=0, reused=300, now=200.0)
    assert b.read_floor == 99  # a read above the floor says nothing new
    assert b.read_floor_at == 110.0 + READ_FLOOR_TTL


def test_the_control_endpoint_answers_fails_and_answers_again() -> None:
    pool, b = _decode()
    pool.control_answered(b, "e1")
    assert b.control_ok and b.control_engine_id == "e1"
    pool.control_answered(b)  # an answer that names no engine keeps the one named
    assert b.control_engine_id == "e1"
    # A call's failure about the call (a bad reply) leaves the endpoint in use.
    assert not pool.control_failed(b, "status")
    assert b.control_ok and b.control_trusted
    for kind in ("connect", "timeout", "unauthorized"):
        assert pool.control_failed(b, kind)
        assert not b.control_ok and not b.control_trusted
        assert not pool.control_failed(b, kind)  # already out of use
        pool.control_answered(b)
    # A health check that found it unusable names no kind.
    assert pool.control_failed(b)
    assert not b.control_ok


def test_an_engine_named_by_the_decode() -> None:
    pool, b = _decode()
    assert pool.engine_seen(b, "e1")
    assert b.engine_id == "e1"
    assert not pool.engine_seen(b, "e1")
    pool.control_failed(b)
    # A new engine answered: its control endpoint, in the same process, is trusted again.
    assert pool.engine_seen(b, "e2")
    assert b.engine_id == "e2" and b.control_ok
    pool.control_answered(b, "e2")
    pool.http_engine_seen(b, "e3")
    assert b.http_engine_id == "e3" and not b.control_trusted  # two engines: distrusted
    pool.check_failed(b, "health check: refused")
    assert b.http_engine_id is None  # whatever answers next may be another engine


_STATE = frozenset({"continuing", "control_engine_id", "control_ok", "engine_id", "failures",
                    "healthy", "http_down", "http_engine_id", "in_flight", "last_error",
                    "read_floor", "read_floor_at", "successes"})


def test_only_the_pool_changes_a_backend_s_state() -> None:
    """Outside ``router/_pool.py`` (and ``Backend.__init__``) no module of the server assigns
    to a backend's state: every change is one of the pool's events."""
    writes = []
    for path in sorted(ROUTER.rglob("*.py")):
        if path.name == "_pool.py" and path.parent.name == "router":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(t, ast.Attribute) and t.attr in _STATE \
                            and not (isinstance(t.value, ast.Name) and t.value.id == "self"):
                        writes.append(f"{path.relative_to(ROUTER)}:{node.lineno}: .{t.attr}")
    assert not writes, "backend state written outside its pool:\n" + "\n".join(writes)
