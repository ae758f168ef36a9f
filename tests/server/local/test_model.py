"""The locally built model: deterministic files, a usable tokenizer and chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvturn_server.local import SIZES, build_model, is_built
from kvturn_server.local._model import FILES, TAG_TOKENS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("tiny", tmp_path_factory.mktemp("tiny"))


def test_building_twice_gives_identical_bytes(tiny: Path, tmp_path: Path) -> None:
    again = build_model("tiny", tmp_path / "again")
    for name in FILES:
        assert (tiny / name).read_bytes() == (again / name).read_bytes(), name


def test_build_is_marked_complete(tiny: Path, tmp_path: Path) -> None:
    assert is_built(tiny, "tiny")
    assert not is_built(tiny, "bench")
    assert not is_built(tmp_path, "tiny")


def test_config_is_a_small_llama(tiny: Path) -> None:
    config = json.loads((tiny / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == SIZES["tiny"].num_layers


def test_bench_size_is_heavier_and_long_context() -> None:
    tiny, bench = SIZES["tiny"], SIZES["bench"]
    assert bench.max_positions >= 16384
    assert bench.hidden_size * bench.num_layers > 4 * tiny.hidden_size * tiny.num_layers


def test_unknown_size_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model size"):
        build_model("huge", tmp_path)


def test_tokenizer_round_trips_bytes_and_keeps_tags_whole(tiny: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    text = 'Grüße 🌍 {"city": "Paris"}\n\tdef f(): return 42'
    assert tok.decode(tok.encode(text).ids) == text
    for tag in TAG_TOKENS:
        assert len(tok.encode(tag).ids) == 1, tag
    assert tok.token_to_id("<|im_end|>") == 2


def test_chat_template_renders_tools_calls_results_and_reasoning(tiny: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny))
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {
             "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                   add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\nTools you may call:\n<tools>\n")
    assert '"name": "get_weather"' in text
    assert ('<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n<tool_call>'
            '{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>\n'
            in text)
    assert "<|im_start|>tool\n<tool_response>sunny</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_chat_template_without_tools_is_plain_chatml(tiny: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
