"""What the router checks in a completion request before any leg runs (docs/http-api.md, A).

The prefill leg is the client's request with ``stream``, ``stream_options``, ``n``,
``max_tokens``, ``max_completion_tokens``, ``min_tokens`` and ``best_of`` rewritten (one
non-streaming token is all it needs), so a prefill accepts requests that only the decode would
refuse, after a whole prompt's compute and ~30 s of held KV. Those fields, and the checks vLLM
0.32 makes on them (``SamplingParams._verify_args`` and the request models' validators), are
checked here first; everything else reaches both legs unchanged and the prefill answers a bad
value with its own 400.

The router is stricter than vLLM's pydantic models in one way, deliberately: it takes these
fields only as JSON booleans and integers. vLLM coerces ``"stream": "true"``, ``"yes"`` or
``1`` to a stream; a router that read them otherwise would buffer the stream and capture
nothing, so any value both cannot read the same way is refused.
"""

from __future__ import annotations

from typing import Any

from kvturn_server.router._errors import ApiError


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_parameter")


def strict_bool(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise _bad(name, f"{name} must be true, false or null, got {value!r:.40}")


def strict_int(body: dict[str, Any], name: str, *, nullable: bool = True) -> int | None:
    value = body.get(name)
    if value is None and (nullable or name not in body):
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise _bad(name, f"{name} must be an integer{' or null' if nullable else ''}, got "
                     f"{value!r:.40}")


def validate_request(body: dict[str, Any], endpoint: str) -> None:
    """Raise ApiError(400, param=...) when a leg the router rewrites would hide what the
    decode refuses; ``endpoint`` is ``chat`` or ``completions``."""
    stream = strict_bool(body, "stream") is True
    _check_stream_options(body, stream)
    # n: the prefill leg runs one sequence and the decode retains one; vLLM's P/D hand-off
    # gives each of n sequences the same blocks to read. Null is vLLM's default (1) in chat
    # only: its completions model types n as a plain int.
    n = strict_int(body, "n", nullable=endpoint == "chat")
    if n is not None and n != 1:
        raise _bad("n", f"n must be 1 through kvturn (one sequence per turn), got {n}")
    max_tokens = strict_int(body, "max_tokens")
    max_completion = strict_int(body, "max_completion_tokens")
    min_tokens = strict_int(body, "min_tokens")
    if endpoint == "chat":
        # vLLM: max_completion_tokens wins over max_tokens when both are set.
        limit, limit_name = (max_completion, "max_completion_tokens") \
            if max_completion is not None else (max_tokens, "max_tokens")
        if limit is not None and limit < 1:
            raise _bad(limit_name, f"{limit_name} must be at least 1, got {limit}")
    else:
        # vLLM's completions model reads a missing or null max_tokens as 16.
        limit, limit_name = (16 if max_tokens is None else max_tokens), "max_tokens"
        # max_tokens 0 is vLLM's "echo the prompt, generate nothing" (with echo only).
        if limit < 0 or (limit == 0 and body.get("echo") is not True):
            raise _bad("max_tokens", f"max_tokens must be at least 1 (0 only with echo), "
                                     f"got {limit}")
        if limit == 0 and body.get("logprob_token_ids"):
            raise _bad("logprob_token_ids", "logprob_token_ids needs generated tokens; "
                                            "max_tokens is 0")
    if min_tokens is not None:
        if min_tokens < 0:
            raise _bad("min_tokens", f"min_tokens must be >= 0, got {min_tokens}")
        if limit is not None and min_tokens > limit:
            raise _bad("min_tokens", f"min_tokens must be <= {limit_name}={limit}, got "
                                     f"{min_tokens}")
    prompt_logprobs = body.get("prompt_logprobs")
    if stream and isinstance(prompt_logprobs, int | float) \
            and not isinstance(prompt_logprobs, bool) \
            and (prompt_logprobs > 0 or prompt_logprobs == -1):
        raise _bad("prompt_logprobs", "prompt_logprobs are not available when stream is true")


def _check_stream_options(body: dict[str, Any], stream: bool) -> None:
    options = body.get("stream_options")
    if options is None:
        return
    if not isinstance(options, dict):
        raise _bad("stream_options", f"stream_options must be an object or null, got "
                                     f"{type(options).__name__}")
    # vLLM refuses non-empty stream options without a stream (an empty object passes).
    if options and not stream:
        raise _bad("stream_options", "stream_options can only be set when stream is true")
    for name in ("include_usage", "continuous_usage_stats"):
        value = options.get(name)
        if value is not None and not isinstance(value, bool):
            raise _bad(f"stream_options.{name}", f"stream_options.{name} must be true, false "
                                                 f"or null, got {value!r:.40}")
