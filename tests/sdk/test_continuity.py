"""Continuity: which next turns extend the previous one, and the reason when they do not."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from openai.types.chat import ChatCompletionMessage

from kvturn._continuity import (
    ChatTurn,
    CompletionTurn,
    check,
    describe_chat,
    describe_completion,
    normalise_message,
)

SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "What is the weather in Lisbon?"}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Lisbon"}'}}
REPLY = {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning": "Need a tool."}
TOOL = {"role": "tool", "tool_call_id": "call_1", "content": "22C, sunny"}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def chat(messages: list[Any], **fields: Any) -> ChatTurn:
    turn = describe_chat({"model": "m", "messages": messages, **fields})
    assert turn is not None
    return turn


def answered(messages: list[Any], *replies: dict[str, Any], **fields: Any) -> ChatTurn:
    turn = chat(messages, **fields)
    turn.set_replies(list(replies))
    return turn


FIRST = [SYSTEM, USER]


def next_turn(*extra: Any) -> list[Any]:
    return [*copy.deepcopy(FIRST), *copy.deepcopy(list(extra))]


def test_a_first_turn_has_nothing_to_extend() -> None:
    assert check(None, chat(FIRST)) is None


def test_previous_messages_then_the_reply_then_new_messages_extend() -> None:
    assert check(answered(FIRST, REPLY), chat(next_turn(REPLY, TOOL))) is None


@pytest.mark.parametrize("echo", [
    # the reply as the openai object the response returned
    ChatCompletionMessage.model_validate({
        "role": "assistant", "content": None, "refusal": None, "annotations": [],
        "tool_calls": [CALL], "reasoning": "Need a tool."}),
    # None vs absent, [] vs absent, vLLM's older name for reasoning, a tool call without type
    {"role": "assistant", "content": "", "refusal": None, "audio": None,
     "reasoning_content": "Need a tool.",
     "tool_calls": [{"id": "call_1", "function": {"name": "weather",
                                                  "arguments": '{"city": "Lisbon"}'}}]},
])
def test_representation_differences_that_do_not_change_the_prompt_are_ignored(echo: Any) -> None:
    assert check(answered(FIRST, REPLY), chat(next_turn(echo, TOOL))) is None


def test_a_single_text_part_is_the_same_as_a_string() -> None:
    parts = {"role": "user", "content": [{"type": "text", "text": USER["content"]}]}
    assert check(answered(FIRST, REPLY), chat([SYSTEM, parts, REPLY, TOOL])) is None


def test_content_differences_are_not_ignored() -> None:
    previous = answered(FIRST, REPLY)
    spaced = {**USER, "content": USER["content"] + " "}
    assert check(previous, chat([SYSTEM, spaced, REPLY, TOOL])) == "edited"
    two_parts = {"role": "user", "content": [{"type": "text", "text": "What is the weather"},
                                             {"type": "text", "text": " in Lisbon?"}]}
    assert check(previous, chat([SYSTEM, two_parts, REPLY, TOOL])) == "edited"


@pytest.mark.parametrize(("messages", "reason"), [
    ([{**SYSTEM, "content": "You are verbose."}, USER, REPLY, TOOL], "system-changed"),
    ([{"role": "developer", "content": "x"}, USER, REPLY, TOOL], "system-changed"),
    ([SYSTEM, {**USER, "content": "Weather in Porto?"}, REPLY, TOOL], "edited"),
    ([SYSTEM, REPLY, TOOL], "removed"),
    ([SYSTEM], "truncated"),
    ([SYSTEM, USER], "regenerate"),
    ([SYSTEM, USER, {"role": "user", "content": "Hello?"}], "reply-missing"),
    ([SYSTEM, USER, {**REPLY, "reasoning": None}, TOOL], "reasoning-stripped"),
    ([SYSTEM, USER, {**REPLY, "content": "It is sunny."}, TOOL], "reply-changed"),
    ([SYSTEM, USER, {**REPLY, "tool_calls": [{**CALL, "id": "call_2"}]}, TOOL], "reply-changed"),
])
def test_reasons(messages: list[Any], reason: str) -> None:
    assert check(answered(FIRST, REPLY), chat(copy.deepcopy(messages))) == reason


def test_a_changed_tool_result_inside_the_history_is_named() -> None:
    previous = answered([SYSTEM, USER, REPLY, TOOL], {"role": "assistant", "content": "Sunny."})
    changed = [SYSTEM, USER, REPLY, {**TOOL, "content": "18C, rain"},
               {"role": "assistant", "content": "Sunny."}]
    assert check(previous, chat(changed)) == "tool-result-changed"


def test_reasoning_stripped_from_an_older_assistant_message() -> None:
    previous = answered([SYSTEM, USER, REPLY, TOOL], {"role": "assistant", "content": "Sunny."})
    stripped = [SYSTEM, USER, {**REPLY, "reasoning": None}, TOOL,
                {"role": "assistant", "content": "Sunny."}]
    assert check(previous, chat(stripped)) == "reasoning-stripped"


def test_prompt_shaping_fields() -> None:
    previous = answered(FIRST, REPLY, tools=TOOLS)
    assert check(previous, chat(next_turn(REPLY, TOOL), tools=TOOLS)) is None
    assert check(previous, chat(next_turn(REPLY, TOOL))) == "tools-changed"
    assert check(previous, describe_chat({"model": "other", "messages": next_turn(REPLY, TOOL),
                                          "tools": TOOLS})) == "model-changed"  # type: ignore[arg-type]
    assert check(previous, chat(next_turn(REPLY, TOOL), tools=TOOLS,
                                chat_template_kwargs={"enable_thinking": False})
                 ) == "template-changed"


def test_sampling_parameters_do_not_matter() -> None:
    previous = answered(FIRST, REPLY, temperature=0.0)
    assert check(previous, chat(next_turn(REPLY, TOOL), temperature=1.0, max_tokens=5)) is None


def test_any_choice_of_a_multi_choice_reply_may_continue() -> None:
    other = {"role": "assistant", "content": "Let me check."}
    previous = answered(FIRST, REPLY, other)
    assert check(previous, chat(next_turn(other, {"role": "user", "content": "ok"}))) is None


def test_an_unseen_reply_checks_only_the_prefix() -> None:
    previous = chat(FIRST)  # replies stay None: e.g. a stream that was not read to the end
    assert check(previous, chat(next_turn({"role": "assistant", "content": "anything"}))) is None
    assert check(previous, chat([{**SYSTEM, "content": "x"}, USER, REPLY])) == "system-changed"


def test_switching_api_is_not_an_extension() -> None:
    assert check(answered(FIRST, REPLY), describe_completion(  # type: ignore[arg-type]
        {"model": "m", "prompt": "hello"})) == "api-changed"


class TestCompletions:
    def turn(self, prompt: Any, *replies: Any) -> CompletionTurn:
        turn = describe_completion({"model": "m", "prompt": prompt})
        assert turn is not None
        if replies:
            turn.set_replies(list(replies))
        return turn

    def test_text_prompt_extends_with_previous_prompt_and_completion(self) -> None:
        previous = self.turn("Once upon", " a time")
        assert check(previous, self.turn("Once upon a time, there")) is None
        assert check(previous, self.turn("Once upon a dime")) == "reply-changed"
        assert check(previous, self.turn("Twice upon a time")) == "edited"
        assert check(previous, self.turn("Once")) == "truncated"
        assert check(previous, self.turn("Once upon")) == "regenerate"

    def test_token_prompts(self) -> None:
        previous = self.turn([1, 2, 3], [4, 5])
        assert check(previous, self.turn([1, 2, 3, 4, 5, 6])) is None
        assert check(previous, self.turn([1, 2, 3, 9, 9])) == "reply-changed"
        assert check(previous, self.turn([1, 9, 3, 4])) == "edited"
        assert check(self.turn([1, 2, 3]), self.turn([1, 2, 3, 7])) is None  # reply unseen

    def test_batches_are_not_a_conversation(self) -> None:
        assert describe_completion({"model": "m", "prompt": ["a", "b"]}) is None
        assert describe_completion({"model": "m", "prompt": [[1, 2], [3]]}) is None


def test_the_normal_form() -> None:
    assert normalise_message({"role": "assistant", "content": "", "refusal": None,
                              "tool_calls": [], "reasoning_content": "r"}) == {
        "role": "assistant", "reasoning": "r"}
    assert normalise_message({"role": "user", "content": [{"type": "text", "text": "hi"}]}) == {
        "role": "user", "content": "hi"}
    assert normalise_message(ChatCompletionMessage.model_validate(
        {"role": "assistant", "content": "x", "tool_calls": [CALL]})) == {
        "role": "assistant", "content": "x",
        "tool_calls": [{"id": "call_1", "function": CALL["function"]}]}


@pytest.mark.parametrize("echoed", [
    {"role": "assistant", "content": "x"},
    {"role": "assistant", "content": "x", "tool_calls": None},
    {"role": "assistant", "content": "x", "refusal": ""},
    {"role": "assistant", "content": "y"},
    {"role": "assistant", "content": [{"type": "text", "text": "x"}]},
    {"role": "assistant"},
    {"role": "assistant", "content": "x", "name": "bot"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
])
@pytest.mark.parametrize("reply", [
    {"role": "assistant", "content": "x"},
    {"role": "assistant", "content": "x", "refusal": ""},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "assistant", "content": "x", "reasoning_content": "r"},
    {"role": "assistant", "content": "x", "annotations": []},
])
def test_the_reply_shortcut_only_says_equal_when_the_normal_forms_are(
        echoed: dict[str, Any], reply: dict[str, Any]) -> None:
    # _check_chat settles the common reply slot without normalising; it must never say
    # "the same" where the normal forms differ (it may say "compare them" where they agree).
    from kvturn._continuity import _same_fields

    parsed = ChatCompletionMessage.model_validate(reply)
    for form in (parsed, reply):
        if _same_fields(echoed, form):
            assert normalise_message(echoed) == normalise_message(form), (echoed, form)
    if echoed == {"role": "assistant", "content": "x"} and reply == echoed:
        assert _same_fields(echoed, parsed) and _same_fields(echoed, reply)  # the usual case


@pytest.mark.parametrize("message", [
    {"role": "assistant", "content": [{"type": "text", "text": ""}]},
    {"role": "assistant", "content": [{"type": "text", "text": "x"}], "reasoning_content": "r"},
    {"role": "assistant", "content": "", "tool_calls": [CALL], "refusal": None},
    REPLY, TOOL, {"role": "user", "content": [{"type": "text", "text": "a"},
                                              {"type": "text", "text": "b"}]},
])
def test_a_normal_form_normalises_to_itself(message: dict[str, Any]) -> None:
    # Normal forms are compared with ==: normalising one again must change nothing (a lone
    # empty text part once became "" on the first pass and was dropped only on the second).
    once = normalise_message(message)
    assert normalise_message(once) == once
    if message["content"] == [{"type": "text", "text": ""}]:
        assert once == {"role": "assistant"}  # the part is the string "", which is no content
