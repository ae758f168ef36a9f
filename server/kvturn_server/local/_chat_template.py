"""The local model's chat template: ChatML framing with hermes-style tool calls.

Tool calls are rendered as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` so that
vLLM's ``hermes`` tool-call parser reads them back (it needs both tags as single vocabulary
tokens, which the tokenizer adds). Tool results go in a ``tool`` turn wrapped in
``<tool_response>`` tags. An assistant message's ``reasoning_content`` (or ``reasoning``) is
rendered as a ``<think>`` block before its content, so stripping it between turns changes the
token sequence exactly as it does on reasoning models.
"""

from __future__ import annotations

CHAT_TEMPLATE = (
    "{% macro text(content) %}"
    "{% if content is none %}"
    "{% elif content is string %}{{ content }}"
    "{% else %}{% for part in content %}"
    "{% if part.type == 'text' %}{{ part.text }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endmacro %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages and messages[0].role == 'system' %}{{ text(messages[0].content) }}\n\n"
    "{% endif %}"
    "Tools you may call:\n<tools>\n"
    "{% for tool in tools %}{{ (tool.function if tool.function is defined else tool) | tojson }}\n"
    "{% endfor %}"
    "</tools>\nTo call a tool reply with "
    '<tool_call>{"name": NAME, "arguments": {ARGS}}</tool_call><|im_end|>\n'
    "{% elif messages and messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ text(messages[0].content) }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'assistant' %}"
    "<|im_start|>assistant\n"
    "{% set reasoning = m.reasoning_content if m.reasoning_content is defined else "
    "(m.reasoning if m.reasoning is defined else none) %}"
    "{% if reasoning %}<think>\n{{ reasoning }}\n</think>\n{% endif %}"
    "{{ text(m.content) }}"
    "{% if m.tool_calls is defined and m.tool_calls %}"
    "{% for call in m.tool_calls %}"
    "{% set f = call.function if call.function is defined else call %}"
    '<tool_call>{"name": "{{ f.name }}", "arguments": '
    "{% if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson }}"
    "{% endif %}}</tool_call>"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "<|im_start|>tool\n<tool_response>{{ text(m.content) }}</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ m.role }}\n{{ text(m.content) }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
