"""Continuity: does a turn's prompt extend the conversation the router retained?

The decode retains the last turn's prompt *and* its generated tokens. The next turn can reuse
that KV only if its prompt starts with exactly those tokens, i.e. (chat) its messages start with
the previous request's messages followed by the assistant reply, or (completions) its prompt
starts with the previous prompt followed by the completion text. When it does not (an edited or
removed message, a stripped reasoning trace, a changed tool result, another system prompt, ...)
the SDK says so with ``X-KVTurn-No-Reuse: <reason>``, so the router does not pin and read KV that
cannot match. The connector verifies block hashes anyway; this check is the cheap first line
that also tells the user *why* a turn did not reuse.

What is compared, exactly
-------------------------
Request fields that shape the rendered prompt must be equal (``==`` on the JSON values, an absent
field equals ``None``): ``model`` (reason ``model-changed``), ``tools`` and ``functions``
(``tools-changed``), ``chat_template``, ``chat_template_kwargs`` and ``documents``
(``template-changed``). For completions only ``model``.

Messages are compared after a normalisation that removes differences the server's rendering
does not see (vLLM 0.32 ``ChatCompletionRequest`` and ``chat_utils._parse_chat_message_content``):

1. an openai model object (e.g. ``response.choices[0].message``) counts as its ``model_dump``;
2. a key whose value is ``None`` or ``[]`` counts as absent, at any depth;
3. ``content`` equal to ``""`` counts as absent (vLLM renders ``None`` as no content parts), and
   a ``content`` list holding exactly one ``{"type": "text", "text": s}`` part counts as the
   string ``s`` (vLLM turns a string into that very part);
4. ``reasoning_content`` counts as ``reasoning`` (vLLM renames it before rendering);
5. a tool call's ``"type": "function"`` counts as absent (it is the only type).

Everything else is compared exactly: roles, names, text, content parts, tool-call ids, function
names and argument strings, ``tool_call_id``. Keys other than these are compared too (they may
reach the template).

The reply slot (the message right after the previous request's messages) must equal the
assistant message of one of the previous response's choices. When the SDK could not see that
reply (``with_streaming_response``, a stream abandoned or cut before every choice had its
``finish_reason``), only the prefix is checked. Completions: the new prompt must start with the
previous prompt followed by one choice's text (or, for token-id prompts, its ``token_ids`` when
the server returned them).

Reasons: ``api-changed``, ``model-changed``, ``tools-changed``, ``template-changed``,
``system-changed`` (first message, a system or developer one, differs), ``tool-result-changed``,
``reasoning-stripped`` (an assistant message lost its reasoning), ``removed`` (a message was
dropped from the middle), ``edited`` (any other difference inside the previous messages or
prompt), ``truncated`` (fewer messages, or a shorter prompt, than last time), ``regenerate``
(the same prompt again, without the reply), ``reply-missing`` (no assistant message after the
previous messages), ``reply-changed`` (the assistant message, or completion text, is not the one
the server generated).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import chain
from typing import Any, TypeAlias

import openai

Message: TypeAlias = dict[str, Any]

_SYSTEM_ROLES = frozenset({"system", "developer"})
# The reason for a change of each shape field, in describe_chat's order: model, tools,
# functions, chat_template, chat_template_kwargs, documents.
_SHAPE_REASONS = ("model-changed", "tools-changed", "tools-changed", "template-changed",
                  "template-changed", "template-changed")


_SCALARS = (str, int, float, bool)


def _plain(value: Any) -> Any:
    """``value`` as plain JSON-like data, with ``None`` and ``[]`` values removed from mappings.

    Always builds new containers, so a stored record never aliases the caller's objects.
    Scalars are handled inline (no recursive call): this runs on every turn.
    """
    if isinstance(value, dict):
        return _plain_mapping(value.items(), models=False)
    if isinstance(value, list | tuple):
        return [item if type(item) in _SCALARS else _plain(item) for item in value]
    if type(value) in _SCALARS:
        return value
    if isinstance(value, openai.BaseModel):
        # The fields as the object holds them (what model_dump would give, without running
        # the serializer on every turn), then the extras (vLLM's reasoning, for one).
        out = _plain_mapping(vars(value).items(), models=True)
        extra = value.model_extra
        if extra:
            out.update(_plain_mapping(extra.items(), models=False))
        return out
    return value


def _plain_mapping(items: Iterable[tuple[str, Any]], *, models: bool) -> dict[str, Any]:
    out = {}
    for key, item in items:
        if item is None or (models and key.startswith("_")):  # a model's private attribute
            continue
        if type(item) not in _SCALARS:
            item = _plain(item)
            if isinstance(item, list) and not item:
                continue
        out[key] = item
    return out


def normalise_message(message: Any) -> Message:
    """The form of a chat message that continuity compares (rules in the module docstring)."""
    # The usual message, a dict or a parsed reply, has text fields only: no walk needed.
    if type(message) is dict:
        form = _text_form(message.items())
        if form is not None:
            return form
    elif isinstance(message, openai.BaseModel):
        extra = message.model_extra
        form = _text_form(chain(vars(message).items(), extra.items()) if extra
                          else vars(message).items())
        if form is not None:
            return form
    plain = _plain(message)
    if not isinstance(plain, dict):
        # Not a message the server would accept; keep it comparable instead of failing here.
        return {"": plain}
    content = plain.get("content")
    if (isinstance(content, list) and len(content) == 1 and isinstance(content[0], dict)
            and content[0].keys() == {"type", "text"} and content[0]["type"] == "text"):
        content = plain["content"] = content[0]["text"]
    if content == "":  # after the part became a string: a normal form normalises to itself
        del plain["content"]
    if "reasoning_content" in plain:
        reasoning = plain.pop("reasoning_content")
        plain.setdefault("reasoning", reasoning)
    for call in plain.get("tool_calls", ()):
        if isinstance(call, dict) and call.get("type") == "function":
            del call["type"]
    return plain


def _text_form(items: Iterable[tuple[str, Any]]) -> Message | None:
    """The normal form of a message whose fields are all non-empty strings or absent (``None``,
    ``[]``), as a new dict; None for any other message (``normalise_message`` walks those).
    A model's fields never start with ``_`` (pydantic), so none is a private attribute."""
    form = {}
    for key, value in items:
        if value is None:  # most of a parsed reply's fields
            continue
        if type(value) is not str:
            if type(value) is list and not value:
                continue
            return None
        if not value or key == "reasoning_content":
            return None
        form[key] = value
    return form


def _without_reasoning(message: Message) -> Message:
    return {key: value for key, value in message.items() if key != "reasoning"}


class ChatTurn:
    """A chat request as the router saw it, and (once known) the assistant replies.

    ``messages`` are the request's own JSON messages (openai builds fresh ones per request, so
    they do not alias the caller's list); their normalised forms are computed only when a plain
    ``==`` is not enough, which keeps the common case (the caller resends the same messages)
    cheap. Replies are kept as returned and normalised only when a check needs them.
    """

    __slots__ = ("_normalised", "_reply_norms", "messages", "replies", "shape")

    def __init__(self, shape: tuple[Any, ...], messages: Sequence[Any]) -> None:
        self.shape = shape
        self.messages = messages
        self._normalised: list[Message | None] = [None] * len(messages)
        # The assistant message of each choice, as returned; None while not observed.
        self.replies: list[Any] | None = None
        self._reply_norms: list[Message] | None = None

    def set_replies(self, replies: list[Any]) -> None:
        self.replies = replies
        self._reply_norms = None

    def normalised(self, index: int) -> Message:
        cached = self._normalised[index]
        if cached is None:
            cached = self._normalised[index] = normalise_message(self.messages[index])
        return cached

    def same_message(self, index: int, other: ChatTurn, other_index: int) -> bool:
        mine, theirs = self.messages[index], other.messages[other_index]
        return mine == theirs or self.normalised(index) == other.normalised(other_index)

    def normalised_replies(self) -> list[Message]:
        if self._reply_norms is None:
            self._reply_norms = [normalise_message(reply) for reply in self.replies or ()]
        return self._reply_norms


class CompletionTurn:
    """A completions request (one prompt: text or token ids) and, once known, the completions."""

    __slots__ = ("prompt", "replies", "shape")

    def __init__(self, shape: tuple[Any, ...], prompt: str | list[int]) -> None:
        self.shape = shape
        self.prompt = prompt
        self.replies: list[str] | list[list[int]] | None = None

    def set_replies(self, replies: list[str] | list[list[int]]) -> None:
        self.replies = replies


TurnRecord: TypeAlias = ChatTurn | CompletionTurn


def describe_chat(body: Mapping[str, Any]) -> ChatTurn | None:
    """The continuity view of a chat body, or None when it cannot be one linear conversation."""
    messages = body.get("messages")
    if not isinstance(messages, list | tuple):
        return None
    get = body.get
    return ChatTurn((get("model"), get("tools"), get("functions"), get("chat_template"),
                     get("chat_template_kwargs"), get("documents")), messages)


def describe_completion(body: Mapping[str, Any]) -> CompletionTurn | None:
    """A single text or token-id prompt; batches (a list of prompts) are not one conversation."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return CompletionTurn((body.get("model"),), prompt)
    if isinstance(prompt, list) and all(type(token) is int for token in prompt):
        return CompletionTurn((body.get("model"),), list(prompt))
    return None


def check(previous: TurnRecord | None, current: TurnRecord) -> str | None:
    """Why ``current`` does not extend ``previous`` (a reason token), or None when it does."""
    if previous is None:
        return None
    if type(previous) is not type(current):
        return "api-changed"
    if previous.shape != current.shape:
        for reason, before, now in zip(_SHAPE_REASONS, previous.shape, current.shape,
                                       strict=False):
            if before != now:
                return reason
    if isinstance(previous, ChatTurn):
        assert isinstance(current, ChatTurn)
        return _check_chat(previous, current)
    assert isinstance(current, CompletionTurn)
    return _check_completion(previous, current)


def _check_chat(previous: ChatTurn, current: ChatTurn) -> str | None:
    before = len(previous.messages)
    now = len(current.messages)
    common = min(before, now)
    # Fast path: the caller resent the very same messages (one C-level comparison).
    if previous.messages[:common] != current.messages[:common]:
        for index in range(common):
            if not previous.same_message(index, current, index):
                return _classify_edit(previous, current, index)
    if now < before:
        return "truncated"
    if now == before:
        return "regenerate"
    if previous.replies is None:
        return None
    echoed = current.messages[before]
    if type(echoed) is dict:
        for reply in previous.replies:
            if _same_fields(echoed, reply):
                return None
    replies = previous.normalised_replies()
    echoed = current.normalised(before)
    if echoed in replies:
        return None
    if echoed.get("role") != "assistant":
        return "reply-missing"
    if any(_without_reasoning(reply) == echoed for reply in replies if "reasoning" in reply):
        return "reasoning-stripped"
    return "reply-changed"


def _same_fields(echoed: Message, reply: Any) -> bool:
    """Whether ``echoed`` holds exactly the fields of ``reply`` that are not None (a parsed
    message's) or all of them (an assembled one's): then the two normalise alike, whatever
    they hold (normalising drops None fields first). The common case (the caller appends the
    reply, or ``{"role": "assistant", "content": text}``) is settled here with a few C-level
    comparisons instead of normalising both; any other answer means "compare normal forms"."""
    if type(reply) is dict:
        return echoed == reply
    # echoed's items are among the reply's fields, none of them None, and as many as the
    # reply's fields that are not None: so they are exactly those.
    fields = getattr(reply, "__dict__", None)
    return (fields is not None and not getattr(reply, "__pydantic_extra__", True)
            and echoed.items() <= fields.items() and None not in echoed.values()
            and len(fields) - list(fields.values()).count(None) == len(echoed))


def _classify_edit(previous: ChatTurn, current: ChatTurn, index: int) -> str:
    was, now = previous.normalised(index), current.normalised(index)
    if index == 0 and (was.get("role") in _SYSTEM_ROLES or now.get("role") in _SYSTEM_ROLES):
        return "system-changed"
    if was.get("role") == now.get("role") == "tool":
        return "tool-result-changed"
    if (was.get("role") == now.get("role") == "assistant" and "reasoning" in was
            and "reasoning" not in now and _without_reasoning(was) == now):
        return "reasoning-stripped"
    # Message ``index`` was dropped if the next one (or, for the last one, the reply) took
    # its place.
    if index + 1 < len(previous.messages):
        if previous.normalised(index + 1) == now:
            return "removed"
    elif previous.replies is not None and now in previous.normalised_replies():
        return "removed"
    return "edited"


def _check_completion(previous: CompletionTurn, current: CompletionTurn) -> str | None:
    before, now = previous.prompt, current.prompt
    if type(before) is not type(now):
        return "edited"
    if now[: len(before)] != before:
        return "truncated" if before[: len(now)] == now else "edited"
    if len(now) == len(before):
        return "regenerate"
    if previous.replies is None:
        return None
    rest = now[len(before):]
    if any(rest[: len(reply)] == reply for reply in previous.replies):
        return None
    return "reply-changed"


def strip_echo(texts: list[str], prompt: str) -> list[str]:
    """With ``echo`` the server returns prompt + completion; only the completion is new."""
    return [text[len(prompt):] if text.startswith(prompt) else text for text in texts]


def chat_replies(completion: Any) -> list[Any] | None:
    """The assistant message of each choice of a ``ChatCompletion`` (normalised only if a
    later check needs it)."""
    choices = getattr(completion, "choices", None)
    if not choices:
        return None
    return [choice.message for choice in choices]


def completion_replies(completion: Any, turn: CompletionTurn,
                       echo: bool) -> list[str] | list[list[int]] | None:
    """What each ``Completion`` choice appended to the prompt, in the prompt's own form."""
    choices = getattr(completion, "choices", None)
    if not choices:
        return None
    if isinstance(turn.prompt, str):
        texts = [choice.text or "" for choice in choices]
        return strip_echo(texts, turn.prompt) if echo else texts
    token_ids: list[list[int]] = []
    for choice in choices:
        ids = (choice.model_extra or {}).get("token_ids")
        if not isinstance(ids, list):
            return None  # only vLLM's return_token_ids gives the generated ids
        token_ids.append(ids)
    return token_ids
