"""Turns driven leg by leg, as the router drives them (docs/http-api.md, section B).

Benchmarks and the connector's end-to-end tests measure the connector without the router in
between: pin the conversation's retention on the decode, run the prefill leg with the pinned
params, unpin, run the decode leg with the prefill's params plus the conversation key.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from kvturn.wire import HEADER_CONTROL_SECRET, KEEPALIVE, PIN, pin_path, retention_path
from kvturn_server._control_secret import resolve_secret
from kvturn_server.local._http import post_json

NULL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None}


def control(url: str, method: str, path: str, body: dict[str, Any] | None = None,
            timeout: float = 10.0, *, secret: str | None = None) -> tuple[int, dict[str, Any]]:
    """Call a connector's control endpoint; (status, JSON body), also for 4xx answers.
    ``secret`` defaults to this process's (``KVTURN_CONTROL_SECRET[_FILE]``; the local stack
    sets one, ``_stack.py``); ``""`` sends none."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"content-type": "application/json"}
    secret = resolve_secret(os.environ) if secret is None else secret
    if secret:
        headers[HEADER_CONTROL_SECRET] = secret
    req = urllib.request.Request(url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


@dataclass
class LegResult:
    """One turn: both legs' replies and what the pin said."""

    prefill: dict[str, Any]
    decode: dict[str, Any]
    pin: dict[str, Any] | None
    gone: str | None  # the control API's reason when there was nothing to pin
    steps: dict[str, float] = field(default_factory=dict)
    """Seconds each step took, in order: ``pin`` (when reading), ``prefill``, ``unpin`` (when
    pinned), ``decode``."""

    @property
    def reuse(self) -> dict[str, Any]:
        report: dict[str, Any] = (self.prefill.get("kv_transfer_params") or {}).get(
            "kvturn", {}).get("reuse", {})
        return report

    @property
    def token_ids(self) -> list[int]:
        ids: list[int] = self.decode["choices"][0]["token_ids"]
        return ids


@dataclass
class DirectConversation:
    """One conversation's turns over a prefill and a decode (completions API, token ids)."""

    prefill_url: str
    decode_url: str
    decode_control_url: str
    model: str
    key: str
    pin_ttl: float = 60.0
    timeout: float = 600.0
    reuse: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def body(self, prompt: list[int], max_tokens: int,
             params: dict[str, Any] | None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                                **self.extra}
        if params is not None:
            body["kv_transfer_params"] = params
        return body

    def turn(self, prompt: list[int], max_tokens: int, *,
             decode_max_tokens: int | None = None) -> LegResult:
        steps: dict[str, float] = {}
        clock = time.perf_counter()

        def lap(step: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            steps[step], clock = now - clock, now

        pinned: dict[str, Any] | None = None
        gone: str | None = "disabled"
        if self.reuse:
            pinned, gone = self._pin()
            lap("pin")
        params = dict(NULL_PARAMS) if pinned is None else {
            **pinned["params"], "do_remote_decode": True, "do_remote_prefill": False}
        try:
            prefilled = post_json(f"{self.prefill_url}/v1/completions",
                                  self.body(prompt, 1, params), timeout=self.timeout)
            lap("prefill")
        finally:
            if pinned is not None:
                control(self.decode_control_url, "DELETE", pin_path(pinned["pin_id"]))
                lap("unpin")
        leg = dict(prefilled.get("kv_transfer_params") or {})
        leg["kvturn"] = {"conversation": self.key}
        decoded = post_json(f"{self.decode_url}/v1/completions",
                            self.body(prompt, decode_max_tokens or max_tokens, leg),
                            timeout=self.timeout)
        lap("decode")
        return LegResult(prefilled, decoded, pinned, gone, steps)

    def _pin(self) -> tuple[dict[str, Any] | None, str | None]:
        status, answer = control(self.decode_control_url, "POST",
                                 retention_path(self.key, PIN), {"ttl": self.pin_ttl})
        if status == 200:
            return answer, None
        return None, str(answer.get("error", {}).get("code", status))

    def describe(self) -> tuple[int, dict[str, Any]]:
        return control(self.decode_control_url, "GET", retention_path(self.key))

    def keepalive(self) -> tuple[int, dict[str, Any]]:
        return control(self.decode_control_url, "POST", retention_path(self.key, KEEPALIVE))

    def release(self) -> tuple[int, dict[str, Any]]:
        return control(self.decode_control_url, "DELETE", retention_path(self.key))
