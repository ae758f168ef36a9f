"""The host tier as a NIXL engine: which host bytes stand in for each region of the decode's KV
(``_regions.py``), and the handshake a prefill gets (``_reads.py``). Reading over NIXL is
tested end to end (tests/e2e/test_host_tier.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

from kvturn_server.offload._reads import host_engine_id, host_handshake, tensor_pairs
from kvturn_server.offload._regions import TensorPair, host_regions
from kvturn_server.offload._spec import host_reads

PAGE = 4096


def pair(device: int, host: int, stride: int = PAGE, page: int = PAGE) -> TensorPair:
    return TensorPair(device_base=device, device_stride=stride, device_blocks=10,
                      host_base=host, host_stride=page, page=page)


def test_each_layers_region_maps_onto_its_host_tensor() -> None:
    tensors = [pair(0x10000, 0x900000), pair(0x50000, 0xA00000)]
    regions = host_regions([0x50000, 0x10000], [PAGE, PAGE], [PAGE, PAGE], tensors)
    assert regions.bases == [0xA00000, 0x900000]  # in the decode's region order
    assert regions.block_lens == [PAGE, PAGE] and regions.strides == [PAGE, PAGE]


def test_a_region_inside_a_page_keeps_its_offset() -> None:
    regions = host_regions([0x10000 + 1024], [1024], [PAGE], [pair(0x10000, 0x900000)])
    assert regions.bases == [0x900000 + 1024]


@pytest.mark.parametrize(("base", "length", "stride", "why"), [
    (0x80000, PAGE, PAGE, "not in the first block"),  # no KV tensor there
    (0x10000, PAGE, 2 * PAGE, "steps"),  # layers interleaved in one allocation
    (0x10000 + 1024, PAGE, PAGE, "transfers bytes"),  # past the page the host tier copies
])
def test_a_region_without_a_host_twin_is_refused(base: int, length: int, stride: int,
                                                  why: str) -> None:
    with pytest.raises(ValueError, match=why):
        host_regions([base], [length], [stride], [pair(0x10000, 0x900000)])


def test_tensor_pairs_read_addresses_and_strides_off_the_tensors() -> None:
    device = torch.zeros((6, PAGE), dtype=torch.int8)
    host = torch.zeros((3, PAGE), dtype=torch.int8)
    (found,) = tensor_pairs([device], [host], [PAGE - 8])
    assert found == TensorPair(device.data_ptr(), PAGE, 6, host.data_ptr(), PAGE, PAGE - 8)


def test_the_handshake_is_the_decodes_but_for_where_the_host_tier_differs() -> None:
    decode = NixlAgentMetadata(
        engine_id="dec", agent_metadata=b"device-agent", kv_caches_base_addr=[0x10000, 0x50000],
        device_id=0, num_blocks=33, block_lens=[PAGE, PAGE], block_strides=[PAGE, PAGE],
        kv_cache_layout="NHD", block_size=128, ssm_sizes=(0, 0), attn_backend_name="CPU_ATTN",
        physical_blocks_per_logical_kv_block=1, region_num_blocks=[33, 33],
        region_group_ids=[0, 0], region_names=["l0", "l1"], region_mem_types=["DRAM", "DRAM"])
    regions = host_regions([0x10000, 0x50000], [PAGE, PAGE], [PAGE, PAGE],
                           [pair(0x10000, 0x900000), pair(0x50000, 0xA00000)])
    host = host_handshake(decode, b"host-agent", regions, rows=40)
    assert host.engine_id == host_engine_id("dec") == "dec-host"
    assert (host.agent_metadata, host.kv_caches_base_addr) == (b"host-agent", [0x900000, 0xA00000])
    assert host.num_blocks == 40 and host.region_num_blocks == [40, 40]
    # Everything else is the decode's: the prefill checks it against its own.
    same = {f.name for f in dataclasses.fields(NixlAgentMetadata)} - {
        "engine_id", "agent_metadata", "kv_caches_base_addr", "num_blocks",
        "region_num_blocks", "block_lens", "block_strides", "region_mem_types", "device_id"}
    assert all(getattr(host, name) == getattr(decode, name) for name in same)


def test_host_reads_are_on_unless_the_host_tier_says_false() -> None:
    assert host_reads({}) and not host_reads({"host_reads": False})
    with pytest.raises(ValueError, match="true or false"):
        host_reads({"host_reads": "no"})


def test_a_decode_whose_side_channel_is_not_on_loopback_serves_no_host_reads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A host read names the host tier's loopback side channel: a prefill on another host
    # would dial its own loopback and wait out vLLM's handshake timeout before recomputing.
    from types import SimpleNamespace

    from kvturn_server.connector import _worker
    from kvturn_server.offload import _reads

    decode = SimpleNamespace(
        xfer_handshake_metadata=object(), world_size=1, nixl_backends=["UCX"],
        vllm_config=SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_role="kv_consumer")))
    monkeypatch.setitem(_worker._registered, "dec", decode)  # type: ignore[arg-type]
    built: list[tuple[object, ...]] = []

    def endpoint(*args: object) -> tuple[object, ...]:
        built.append(args)
        return args

    monkeypatch.setattr(_reads, "HostReadEndpoint", endpoint)
    for side_channel, serves in (("10.0.0.7", False), ("localhost", True),
                                 ("127.0.0.4", True)):
        monkeypatch.setattr(_reads, "vllm_side_channel_host", lambda at=side_channel: at)
        assert (_reads.start_endpoint("dec", [], [], []) is not None) is serves, side_channel
    assert len(built) == 2


def test_the_side_channel_answers_vllms_handshake_and_survives_garbage() -> None:
    """A real NIXL agent over real tensors, asked the way vLLM's prefill asks
    (``NixlConnectorWorker._nixl_handshake``): the reply is the payload and a clock."""
    import time

    import msgspec
    import zmq
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        GET_META_MSG,
        NixlHandshakePayload,
    )

    from kvturn_server.offload._reads import HostReadEndpoint

    device = [torch.zeros((4, PAGE), dtype=torch.int8) for _ in range(2)]
    host = [torch.zeros((6, PAGE), dtype=torch.int8) for _ in range(2)]
    decode = NixlAgentMetadata(
        engine_id="dec", agent_metadata=b"device-agent",
        kv_caches_base_addr=[t.data_ptr() for t in device], device_id=0, num_blocks=4,
        block_lens=[PAGE, PAGE], block_strides=[PAGE, PAGE], kv_cache_layout="NHD",
        block_size=16, ssm_sizes=(0, 0), attn_backend_name="CPU_ATTN",
        physical_blocks_per_logical_kv_block=1, region_num_blocks=[4, 4])
    payload = NixlHandshakePayload(compatibility_hash="abc", agent_metadata_bytes=
                                   msgspec.msgpack.encode(decode))
    endpoint = HostReadEndpoint(payload, ["UCX"], device, host, [PAGE, PAGE])
    context = zmq.Context()
    try:
        garbage = context.socket(zmq.DEALER)
        garbage.connect(f"tcp://127.0.0.1:{endpoint.port}")
        garbage.send_multipart([b"", b"\xc1not msgpack"])
        garbage.send_multipart([b"one frame, no delimiter"])  # not three frames at the router
        garbage.send_multipart([b"", b"a", b"b"])
        ask = context.socket(zmq.REQ)
        ask.setsockopt(zmq.RCVTIMEO, 5000)
        ask.connect(f"tcp://127.0.0.1:{endpoint.port}")
        ask.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
        reply, clock = ask.recv_multipart()
        assert abs(msgspec.msgpack.decode(clock) - time.perf_counter()) < 5
        answer = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(reply)
        assert answer.compatibility_hash == "abc"
        meta = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(answer.agent_metadata_bytes)
        assert meta.engine_id == "dec-host" and meta.agent_metadata != b"device-agent"
        assert meta.kv_caches_base_addr == [t.data_ptr() for t in host]
        assert meta.num_blocks == 6 and meta.region_num_blocks == [6, 6]
        assert endpoint.drain() == 0
        garbage.close(linger=0)
        ask.close(linger=0)
    finally:
        endpoint.close()
        context.term()
