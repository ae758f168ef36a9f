"""The verification chain covers what vLLM's prefix cache keys on besides token ids.

Both sides run with vLLM's own ``Request`` objects: the decode retains a finished turn through
the scheduler's real ``request_finished`` (keeper over a fake block pool, as in
test_scheduler_decode.py), the router's pin hands its params over, and a prefill plans its read
with ``PrefillSide.plan``. Image placeholder tokens are the same ids for every image, so only the
multimodal hash can tell two image turns apart; an adapter or a salt changes no token at all.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus

from kvturn.wire import ReuseReason
from kvturn_server.connector._config import ConnectorConfig
from kvturn_server.connector._decode import DecodeSide, make_keeper
from kvturn_server.connector._extra_keys import UncoverableInput, block_extras, engine_seed
from kvturn_server.connector._hashing import DEFAULT_SEED, block_hashes
from kvturn_server.connector._params import KVTURN_FIELD
from kvturn_server.connector._prefill import PrefillSide, ReadRules, ReuseRecord
from tests.fakes.keeper import BS, FakeBlockPool, tokens
from tests.server.connector.test_scheduler_decode import KEY, decode_leg, decode_scheduler

IMAGE_TOKEN = 9  # the placeholder id of every image
ADAPTER_A = LoRARequest("adapter-a", 1, "/adapters/a")
ADAPTER_B = LoRARequest("adapter-b", 2, "/adapters/b")


def image(identifier: Any, offset: int, length: int = 8) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def image_prompt(offset: int = 0, length: int = 8, text: int = 8) -> list[int]:
    """``offset`` text tokens, the image's placeholders, then ``text`` more text tokens."""
    return [*tokens(offset), *[IMAGE_TOKEN] * length, *tokens(text, start=300)]


def vllm_request(request_id: str, prompt: list[int], *, max_tokens: int = 8,
                 **inputs: Any) -> Request:
    sampling = inputs.pop("sampling", None) or SamplingParams(max_tokens=max_tokens)
    return Request(request_id, list(prompt), sampling, None, **inputs)


class Turn:
    """A decode that retained one turn, pinned for a prefill leg."""

    def __init__(self, prompt: list[int], reply: list[int], **inputs: Any) -> None:
        self.pool = FakeBlockPool(33)
        self.decode = decode_scheduler(self.pool)
        request = vllm_request("d-1", prompt, **inputs)
        request.append_output_token_ids(reply)
        # The last sampled token never went through the model.
        request.num_computed_tokens = len(request.all_token_ids) - 1
        request.status = RequestStatus.FINISHED_STOPPED
        request.kv_transfer_params = decode_leg()
        self.ids = self.pool.allocate(-(-len(request.all_token_ids) // BS))
        try:
            _, self.out = self.decode.request_finished(request, (list(self.ids),))
        finally:
            self.pool.release(self.ids)

    @property
    def retained(self) -> bool:
        return bool(self.out and self.out[KVTURN_FIELD].get("retained"))

    @property
    def keeper(self) -> Any:
        assert isinstance(self.decode.side, DecodeSide)
        assert self.decode.side.keeper is not None
        return self.decode.side.keeper

    def next_prompt_reads(self, prompt: list[int], **inputs: Any) -> ReuseRecord:
        """What a prefill leg of ``prompt`` reads from this retention."""
        view = self.keeper.pin(KEY, 10)  # the router pins before the prefill leg
        assert isinstance(view, dict)
        params = view["params"]
        prefill = prefill_side()
        request = vllm_request("p-1", prompt, max_tokens=1, **inputs)
        request.kv_transfer_params = params
        prefill.plan(request, 0, params)
        record = prefill.records["p-1"]
        if not record.reused_tokens:
            assert params["remote_block_ids"] == [[]] and params["remote_num_tokens"] == 0
        return record


def prefill_side(seed: bytes = DEFAULT_SEED) -> PrefillSide:
    return PrefillSide(ReadRules(engine_id="prefill-engine", block_size=BS, hash_seed=seed,
                                 threshold=0, enabled=True))


REPLY = tokens(6, start=500)


def nothing_read(record: ReuseRecord) -> bool:
    return record.reason == ReuseReason.UNVERIFIED and record.reused_tokens == 0


# Images.


def test_a_turn_about_one_image_does_not_verify_against_a_prompt_about_another() -> None:
    prompt = image_prompt()
    turn = Turn(prompt, REPLY, mm_features=[image("img-A", 0)])
    follow_up = [*prompt, *REPLY, 7, 7, 7]
    assert nothing_read(turn.next_prompt_reads(follow_up, mm_features=[image("img-B", 0)]))


def test_the_same_image_verifies() -> None:
    prompt = image_prompt()
    turn = Turn(prompt, REPLY, mm_features=[image("img-A", 0)])
    follow_up = [*prompt, *REPLY, 7, 7, 7]
    record = turn.next_prompt_reads(follow_up, mm_features=[image("img-A", 0)])
    # 16 prompt tokens + 6 reply, 21 computed: 5 full blocks, all in the next prompt.
    assert record == ReuseRecord(ReuseReason.PARTIAL, 20, 0)


def test_text_before_another_image_is_still_read() -> None:
    prompt = image_prompt(offset=8)
    turn = Turn(prompt, REPLY, mm_features=[image("img-A", 8)])
    record = turn.next_prompt_reads([*prompt, *REPLY, 7],
                                    mm_features=[image("img-B", 8)])
    assert record == ReuseRecord(ReuseReason.PARTIAL, 8, 0)  # the two blocks before it


def test_the_same_image_at_another_position_verifies_nothing_from_there() -> None:
    # Same tokens, the same image, but its placeholders start one token later (another
    # template): vLLM keys on the offset in the block, and so does the chain.
    prompt = [*tokens(4), *[IMAGE_TOKEN] * 9, *tokens(7, start=300)]
    turn = Turn(prompt, REPLY, mm_features=[image("img-A", 4, length=9)])
    record = turn.next_prompt_reads([*prompt, *REPLY, 7],
                                    mm_features=[image("img-A", 5, length=8)])
    assert record == ReuseRecord(ReuseReason.PARTIAL, 4, 0)


# Adapters.


@pytest.mark.parametrize(("retained", "prompted"), [
    (ADAPTER_A, ADAPTER_B),
    (ADAPTER_A, None),
    (None, ADAPTER_A),
    # The name re-pointed at another adapter's files: vLLM keys on the path as well.
    (ADAPTER_A, LoRARequest("adapter-a", 1, "/adapters/a-v2")),
], ids=["other adapter", "adapter then base", "base then adapter", "same name, other path"])
def test_kv_of_one_adapter_never_verifies_for_another(retained: Any, prompted: Any) -> None:
    prompt = tokens(16)
    turn = Turn(prompt, REPLY, lora_request=retained)
    assert nothing_read(turn.next_prompt_reads([*prompt, *REPLY, 7], lora_request=prompted))


def test_the_same_adapter_verifies() -> None:
    prompt = tokens(16)
    turn = Turn(prompt, REPLY, lora_request=ADAPTER_A)
    record = turn.next_prompt_reads([*prompt, *REPLY, 7],
                                    lora_request=LoRARequest("adapter-a", 1, "/adapters/a"))
    assert record == ReuseRecord(ReuseReason.HIT, 20, 0)


# Salts.


@pytest.mark.parametrize(("retained", "prompted"), [
    ("tenant-1", "tenant-2"), ("tenant-1", None), (None, "tenant-1")])
def test_another_cache_salt_verifies_nothing(retained: str | None,
                                             prompted: str | None) -> None:
    prompt = tokens(16)
    turn = Turn(prompt, REPLY, cache_salt=retained)
    assert nothing_read(turn.next_prompt_reads([*prompt, *REPLY, 7], cache_salt=prompted))


def test_same_adapter_image_and_salt_verify() -> None:
    prompt = image_prompt(offset=4)
    inputs: dict[str, Any] = {"lora_request": ADAPTER_A, "cache_salt": "tenant-1"}
    turn = Turn(prompt, REPLY, mm_features=[image("img-A", 4)], **inputs)
    follow_up = [*prompt, *REPLY, 7, 7]
    record = turn.next_prompt_reads(follow_up, mm_features=[image("img-A", 4)], **inputs)
    assert record == ReuseRecord(ReuseReason.HIT, 24, 0)  # 25 computed: 6 full blocks
    for changed in ({"cache_salt": "tenant-2"}, {"lora_request": ADAPTER_B}):
        assert nothing_read(turn.next_prompt_reads(
            follow_up, mm_features=[image("img-A", 4)], **{**inputs, **changed}))


# Input the chain cannot express.


class Opaque:
    """An identifier CBOR cannot encode (a future kind of key)."""


def test_a_prompt_whose_inputs_cannot_be_covered_reads_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    prompt = image_prompt()
    turn = Turn(prompt, REPLY, mm_features=[image("img-A", 0)])
    with caplog.at_level(logging.WARNING, logger="kvturn.connector"):
        record = turn.next_prompt_reads([*prompt, *REPLY, 7],
                                        mm_features=[image(Opaque(), 0)])
    assert nothing_read(record)
    assert "cannot be covered" in caplog.text


def test_a_turn_whose_inputs_cannot_be_covered_is_not_retained(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvturn.connector"):
        turn = Turn(image_prompt(), REPLY, mm_features=[image(Opaque(), 0)])
    assert not turn.retained
    assert turn.out is not None
    assert turn.out[KVTURN_FIELD] == {"conversation": KEY, "retained": False,
                                      "engine_id": turn.decode.engine_id}
    assert not isinstance(turn.keeper.describe(KEY), dict)
    assert "multimodal inputs cannot be covered" in caplog.text


def test_block_extras_raises_for_what_cbor_cannot_encode() -> None:
    request = vllm_request("r", image_prompt(), mm_features=[image(Opaque(), 0)])
    with pytest.raises(UncoverableInput, match="multimodal inputs"):
        block_extras(request, 4, BS)


# Prompt logprobs: vLLM reads no cached or external KV for them.


def test_a_prompt_logprobs_leg_reports_disabled_and_reads_nothing() -> None:
    prompt = tokens(16)
    turn = Turn(prompt, REPLY)
    record = turn.next_prompt_reads([*prompt, *REPLY, 7],
                                    sampling=SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert record == ReuseRecord(ReuseReason.DISABLED, 0, 0)


# Plain text and the seed.


def test_plain_text_hashes_are_unchanged() -> None:
    """Backward compatible: a request without extra inputs hashes its token ids only."""
    request = vllm_request("r", tokens(18))
    assert block_extras(request, 4, BS) is None
    assert block_hashes(tokens(18), BS, extras=None) == block_hashes(tokens(18), BS,
                                                                     extras=[None] * 4)
    assert block_hashes(tokens(16), BS, extras=[b""] * 4) == block_hashes(tokens(16), BS)


def test_extras_only_change_the_blocks_from_where_they_appear() -> None:
    plain = block_hashes(tokens(16), BS)
    mixed = block_hashes(tokens(16), BS, extras=[None, b"x", None, None])
    assert mixed[0] == plain[0]
    assert all(a != b for a, b in zip(mixed[1:], plain[1:], strict=True))
    assert block_hashes(tokens(16), BS, extras=[None, b"y", None, None])[1] != mixed[1]


@pytest.mark.parametrize("extras", [[None] * 3, [None, "x", None, None]],
                         ids=["too few", "not bytes"])
def test_malformed_extras_are_refused(extras: list[Any]) -> None:
    with pytest.raises(ValueError, match="extras"):
        block_hashes(tokens(16), BS, extras=extras)


def fake_vllm_config(**model: Any) -> Any:
    fields = {"model": "/models/tiny", "revision": None, "dtype": "float32",
              "quantization": None, "hf_config": '{"hidden_size": 256}', **model}
    hf_config = fields.pop("hf_config")
    return SimpleNamespace(
        model_config=SimpleNamespace(
            **fields, hf_config=SimpleNamespace(to_json_string=lambda use_diff: hf_config)),
        cache_config=SimpleNamespace(cache_dtype="auto"))


@pytest.mark.parametrize("change", [
    {"model": "/models/other"}, {"revision": "v2"}, {"dtype": "bfloat16"},
    {"quantization": "fp8"}, {"hf_config": '{"hidden_size": 256, "rope_scaling": 2}'}])
def test_engines_of_other_models_never_verify(change: dict[str, Any]) -> None:
    mine = engine_seed(fake_vllm_config())
    assert mine == engine_seed(fake_vllm_config())  # the same on every process
    assert mine.startswith(DEFAULT_SEED)
    theirs = engine_seed(fake_vllm_config(**change))
    assert theirs != mine
    assert block_hashes(tokens(8), BS, theirs)[0] != block_hashes(tokens(8), BS, mine)[0]


def test_a_prefill_of_another_model_verifies_nothing() -> None:
    turn = Turn(tokens(16), REPLY)
    assert _with_seed(turn, DEFAULT_SEED).reused_tokens == 20  # the decode's own seed
    assert nothing_read(_with_seed(turn, engine_seed(fake_vllm_config())))


def test_the_decodes_keeper_chains_from_the_schedulers_seed() -> None:
    seed = engine_seed(fake_vllm_config())
    keeper = make_keeper(ConnectorConfig(), SimpleNamespace(
        kv_cache_groups=[object()], num_blocks=33,
        kv_cache_tensors=[SimpleNamespace(size=33 * 2048)]), seed)
    assert keeper is not None and keeper.hash_seed == seed


def _with_seed(turn: Turn, seed: bytes) -> ReuseRecord:
    """What a prefill whose chain starts from ``seed`` reads of ``turn``'s retention."""
    view = turn.keeper.pin(KEY, 10)
    assert isinstance(view, dict)
    params = view["params"]
    prefill = prefill_side(seed)
    request = vllm_request("p-1", [*tokens(16), *REPLY, 7], max_tokens=1)
    request.kv_transfer_params = params
    prefill.plan(request, 0, params)
    return prefill.records["p-1"]
