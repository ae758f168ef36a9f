"""Reading trace files: the shared agent-trace JSON (one session per file) and kvturn's
request JSONL (one request per line). The formats are documented in the package docstring."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvturn_server.traces._model import TraceConversation, TraceFormatError, TraceRequest

DEFAULT_BLOCK_SIZE = 64
SUFFIXES = (".json", ".jsonl")


@dataclass(frozen=True, slots=True)
class _Call:
    """One request as a file states it, before it is related to the one before."""

    arrival_s: float
    gap_s: float | None
    prompt_tokens: int
    reply_tokens: int
    hash_ids: tuple[int, ...]
    kind: str = "n"
    api_time_s: float | None = None


def _shared(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    pairs = zip(a, b, strict=False)
    return sum(1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], pairs))


def _requests(calls: list[_Call], block_size: int) -> tuple[TraceRequest, ...]:
    """The calls related each to the one before: shared prefix, extension, shrink, new tokens."""
    out: list[TraceRequest] = []
    previous: _Call | None = None
    for index, call in enumerate(calls):
        if previous is None:
            shared, extends, shrank, new = 0, False, False, None
            gap = 0.0
        else:
            shared = _shared(previous.hash_ids, call.hash_ids)
            extends = shared == len(previous.hash_ids)
            shrank = call.prompt_tokens < previous.prompt_tokens
            new = call.prompt_tokens - previous.prompt_tokens - previous.reply_tokens
            gap = (call.gap_s if call.gap_s is not None
                   else max(call.arrival_s - previous.arrival_s, 0.0))
        out.append(TraceRequest(
            index=index, arrival_s=call.arrival_s, gap_s=gap, prompt_tokens=call.prompt_tokens,
            reply_tokens=call.reply_tokens, hash_ids=call.hash_ids, block_size=block_size,
            shared_blocks=shared, extends=extends, shrank=shrank, new_tokens=new,
            kind=call.kind, api_time_s=call.api_time_s))
        previous = call
    return tuple(out)


def _int(raw: dict[str, Any], key: str, where: str, *, minimum: int = 0) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TraceFormatError(f"{where}: {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _number(raw: dict[str, Any], key: str, where: str, default: float | None = None) -> float:
    value = raw.get(key, default)
    if (not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value)
            or value < 0):
        raise TraceFormatError(f"{where}: {key!r} must be a number >= 0, got {value!r}")
    return float(value)


def _ids(raw: Any, where: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in raw):
        raise TraceFormatError(f"{where}: 'hash_ids' must be a list of integers")
    return tuple(raw)


# The shared agent-trace JSON.

def _session_calls(raw: list[Any], where: str, offset_s: float) -> tuple[
        list[_Call], list[tuple[float, dict[str, Any]]]]:
    """A session's own calls and its subagents (with their start on the session's clock)."""
    calls: list[_Call] = []
    subagents: list[tuple[float, dict[str, Any]]] = []
    for n, item in enumerate(raw):
        at = f"{where} request {n}"
        if not isinstance(item, dict):
            raise TraceFormatError(f"{at}: expected an object, got {type(item).__name__}")
        t = offset_s + _number(item, "t", at)
        if item.get("type") == "subagent":
            subagents.append((t, item))
            continue
        calls.append(_Call(
            arrival_s=t, gap_s=_number(item, "think_time", at, 0.0),
            prompt_tokens=_int(item, "in", at, minimum=1),
            reply_tokens=_int(item, "out", at), hash_ids=_ids(item.get("hash_ids"), at),
            kind=str(item.get("type", "n")),
            api_time_s=_number(item, "api_time", at) if "api_time" in item else None))
    return calls, subagents


def _session(cid: str, raw: dict[str, Any], source: str, scope: str, block_size: int,
             offset_s: float, parent: str | None) -> Iterator[TraceConversation]:
    """A session and, after it, each of its subagents (recursively) as conversations."""
    where = f"{source}: {cid}"
    requests = raw.get("requests")
    if not isinstance(requests, list):
        raise TraceFormatError(f"{where}: no 'requests' list")
    calls, subagents = _session_calls(requests, where, offset_s)
    if calls:
        yield TraceConversation(
            cid=cid, source=source, scope=scope, requests=_requests(calls, block_size),
            parent=parent, agent_type=raw.get("subagent_type"),
            system_tokens=raw.get("system_tokens"), tool_tokens=raw.get("tool_tokens"))
    for n, (start, sub) in enumerate(subagents):
        name = str(sub.get("agent_id") or f"subagent-{n}")
        yield from _session(f"{cid}/{name}", sub, source, scope, block_size, start,
                            cid if calls else parent)


def _read_json(path: Path) -> list[TraceConversation]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise TraceFormatError(f"{path}: not JSON ({error})") from error
    if not isinstance(data, dict):
        raise TraceFormatError(f"{path}: expected one session object")
    block_size = data.get("block_size", DEFAULT_BLOCK_SIZE)
    if not isinstance(block_size, int) or block_size < 1:
        raise TraceFormatError(f"{path}: 'block_size' must be a positive integer")
    cid = path.stem
    return list(_session(cid, data, str(path), str(path), block_size, 0.0, None))


# kvturn's request JSONL.

@dataclass
class _Pending:
    calls: list[_Call]
    parent: str | None
    tail: list[int]
    """The previous request's ids, to extend where a line gives no hash_ids."""


def _jsonl_ids(raw: dict[str, Any], at: str, prompt: int, block_size: int,
               pending: _Pending | None, fresh: Iterator[int]) -> tuple[int, ...]:
    """A line's ids: given, or made up so that the prompt shares ``shared_tokens`` (default:
    every full block of the previous prompt) with the previous request and nothing else."""
    full = prompt // block_size
    if "hash_ids" in raw:
        ids = _ids(raw["hash_ids"], at)
        if len(ids) > math.ceil(prompt / block_size):
            raise TraceFormatError(f"{at}: {len(ids)} hash ids for {prompt} prompt tokens "
                                   f"in {block_size}-token blocks")
        return ids
    before = pending.tail if pending is not None else []
    shared_default = len(before) * block_size
    shared_tokens = _int(raw, "shared_tokens", at) if "shared_tokens" in raw else shared_default
    keep = min(shared_tokens // block_size, len(before), full)
    return tuple(before[:keep]) + tuple(next(fresh) for _ in range(full - keep))


def _read_jsonl(path: Path) -> list[TraceConversation]:
    source, stem = str(path), path.stem
    pending: dict[str, _Pending] = {}
    block_size = DEFAULT_BLOCK_SIZE
    # Made-up ids are negative: they never equal an id a line gives.
    fresh = itertools.count(-1, -1)
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        at = f"{source} line {number}"
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as error:
            raise TraceFormatError(f"{at}: not JSON ({error})") from error
        if not isinstance(raw, dict):
            raise TraceFormatError(f"{at}: expected an object")
        conversation = raw.get("conversation")
        if not isinstance(conversation, str | int) or isinstance(conversation, bool):
            raise TraceFormatError(f"{at}: 'conversation' must be a string")
        cid = str(conversation)
        if "block_size" in raw:
            size = _int(raw, "block_size", at, minimum=1)
            if size != block_size and pending:
                raise TraceFormatError(f"{at}: one block size per file ({block_size} before)")
            block_size = size
        prompt = _int(raw, "prompt_tokens", at, minimum=1)
        t = _number(raw, "t", at)
        state = pending.get(cid)
        if state is not None and t < state.calls[-1].arrival_s:
            raise TraceFormatError(f"{at}: conversation {cid} goes back in time "
                                   f"({t} s after {state.calls[-1].arrival_s} s)")
        ids = _jsonl_ids(raw, at, prompt, block_size, state, fresh)
        call = _Call(arrival_s=t, gap_s=_number(raw, "gap_s", at) if "gap_s" in raw else None,
                     prompt_tokens=prompt, reply_tokens=_int(raw, "reply_tokens", at),
                     hash_ids=ids)
        if state is None:
            parent = raw.get("parent")
            state = pending[cid] = _Pending([], None if parent is None else str(parent), [])
        state.calls.append(call)
        state.tail = list(ids)
    if not pending:
        raise TraceFormatError(f"{source}: no request")
    return [TraceConversation(
        cid=f"{stem}/{cid}", source=source, scope=source,
        requests=_requests(state.calls, block_size),
        parent=None if state.parent is None else f"{stem}/{state.parent}")
        for cid, state in pending.items()]


def _files(paths: Iterable[str | Path]) -> list[Path]:
    out: list[Path] = []
    for item in paths:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix in SUFFIXES and p.is_file())
            if not found:
                raise TraceFormatError(f"{path}: no .json or .jsonl trace in it")
            out.extend(found)
        elif path.is_file():
            out.append(path)
        else:
            raise TraceFormatError(f"{path}: no such file or directory")
    return out


def read_traces(paths: Iterable[str | Path]) -> tuple[TraceConversation, ...]:
    """Every conversation of the given files and directories (a directory: its ``.json`` and
    ``.jsonl`` files, sorted by name), in file order; within a file, a session before its
    subagents. ``.jsonl`` is kvturn's request JSONL, anything else the shared JSON."""
    out: list[TraceConversation] = []
    for path in _files(paths):
        out.extend(_read_jsonl(path) if path.suffix == ".jsonl" else _read_json(path))
    seen: set[str] = set()
    for conversation in out:
        if conversation.cid in seen:
            raise TraceFormatError(f"{conversation.source}: conversation {conversation.cid} "
                                   "read twice (the same file given twice?)")
        seen.add(conversation.cid)
    return tuple(out)
