"""Prefills read a decode's host tier over NIXL, as they read its device KV.

A retention evicted from the decode's device KV lives on in its host tier ("host-only"). A
prefill's NIXL connector can read it from there if the host tier looks like an engine to it:
this module makes it one, in the decode's worker process, where the host tensors are.

- A second NIXL agent registers the host tensors (DRAM), beside the agent of the decode's own
  NIXL worker (which registered the device KV).
- A side channel on loopback answers vLLM's NIXL handshake with the decode's own handshake
  metadata, changed where the host tier differs: the engine id (``<engine id>-host``), the
  agent, each region's base (the host twin of the region, ``_regions.py``), stride and block
  count (host rows). The compatibility hash is the decode's: the same model, dtype, layout.
- A prefill then reads "blocks" that are host rows (``row = chunk * blocks_per_chunk + j``,
  ``_rows.py``) and, when done, notifies this agent; the notes are drained each engine step
  (:meth:`HostReadEndpoint.drain`) and counted.

The side channel binds a port the kernel picks (no setting, no collision with the ports a
stack hands out); the worker reports it to the scheduler side with its per-step metadata
(``_connector.py``), where the keeper builds a host read's params. One tensor-parallel rank
only: with several, each rank would serve a part and the handshake would need them all.

Nothing here moves bytes: NIXL does, one-sidedly, while the decode's NIXL progress thread (on by
default on decodes, ``kvturn_server.connector._host``) polls this agent's UCX worker too.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from typing import Any

import msgspec
import torch
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    GET_META_MSG,
    NixlAgentMetadata,
    NixlHandshakePayload,
)

from kvturn_server._control_secret import is_loopback
from kvturn_server.connector import HOST_ENGINE_SUFFIX
from kvturn_server.offload._regions import HostRegions, TensorPair, host_regions

log = logging.getLogger("kvturn.offload")

LOOPBACK = "127.0.0.1"


def host_engine_id(engine_id: str) -> str:
    """The engine id a decode's host tier answers NIXL handshakes with."""
    return engine_id + HOST_ENGINE_SUFFIX


def tensor_pairs(device: list[torch.Tensor], host: list[torch.Tensor],
                 pages: list[int]) -> list[TensorPair]:
    """The host tier's tensors as addresses (``device[i]`` is copied into ``host[i]``)."""
    return [TensorPair(device_base=d.data_ptr(), device_stride=d.stride(0) * d.element_size(),
                       device_blocks=d.shape[0], host_base=h.data_ptr(),
                       host_stride=h.stride(0) * h.element_size(), page=page)
            for d, h, page in zip(device, host, pages, strict=True)]


def host_handshake(decode: NixlAgentMetadata, agent_metadata: bytes, regions: HostRegions,
                   rows: int) -> NixlAgentMetadata:
    """The decode's handshake metadata, as its host tier answers it."""
    n = len(regions.bases)
    return dataclasses.replace(
        decode, engine_id=host_engine_id(decode.engine_id), agent_metadata=agent_metadata,
        kv_caches_base_addr=list(regions.bases), device_id=0, num_blocks=rows,
        block_lens=list(regions.block_lens), block_strides=list(regions.strides),
        region_num_blocks=[rows] * n, region_mem_types=["DRAM"] * n)


class HostReadEndpoint:
    """The decode's host tier as a NIXL engine a prefill can read (module docstring)."""

    def __init__(self, decode: NixlHandshakePayload, backends: list[str],
                 device: list[torch.Tensor], host: list[torch.Tensor], pages: list[int]) -> None:
        from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config

        meta = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(decode.agent_metadata_bytes)
        regions = host_regions(meta.kv_caches_base_addr, meta.block_lens, meta.block_strides,
                               tensor_pairs(device, host, pages))
        rows = min(t.shape[0] for t in host)
        self.engine_id = host_engine_id(meta.engine_id)
        self.reads_done = 0
        # A config built from keywords only, as vLLM's worker builds it, so that kvturn's
        # progress-thread default applies to this agent too (connector._host).
        self._agent: Any = NixlWrapper(f"{self.engine_id}-{uuid.uuid4()}",
                                       nixl_agent_config(num_threads=1))
        self._descs = self._agent.get_reg_descs(
            [(t.data_ptr(), t.nbytes, 0, "") for t in host], "DRAM")
        self._agent.register_memory(self._descs, backends=backends)
        handshake = host_handshake(meta, self._agent.get_agent_metadata(), regions, rows)
        encoder = msgspec.msgpack.Encoder()
        self._reply = encoder.encode(NixlHandshakePayload(
            compatibility_hash=decode.compatibility_hash,
            agent_metadata_bytes=encoder.encode(handshake)))
        self._stop = threading.Event()
        self._socket: Any = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVTIMEO, 1000)
        self.host = LOOPBACK
        self.port: int = self._socket.bind_to_random_port(f"tcp://{LOOPBACK}")
        self._thread = threading.Thread(target=self._serve, name="kvturn-host-reads",
                                        daemon=True)
        self._thread.start()
        log.info("host KV tier: readable over NIXL as engine %s at %s:%d (%d regions, "
                 "%d rows, block lens %s, strides %s)", self.engine_id, self.host, self.port,
                 len(regions.bases), rows, sorted(set(regions.block_lens)),
                 sorted(set(regions.strides)))

    def _serve(self) -> None:
        # vLLM's own listener (NixlConnectorScheduler._nixl_handshake_listener) binds a port
        # it is given; this one binds the port the kernel picks, so it keeps its own loop. The
        # reply is the one vLLM's prefill expects: the payload, then this host's perf_counter
        # (CLOCK_MONOTONIC, shared with the scheduler process that stamps the pin's deadline).
        sock = self._socket
        try:
            while not self._stop.is_set():
                try:
                    frames = sock.recv_multipart()
                except zmq.Again:
                    continue
                # A REQ peer's message is three frames here; any other shape is garbage too
                # (unpacking it would stop the channel for every prefill after it).
                identity, message = frames[0], frames[-1] if len(frames) == 3 else b""
                try:
                    request = msgspec.msgpack.decode(message) if message else None
                except msgspec.DecodeError:
                    request = None
                if not isinstance(request, list) or not request or request[0] != GET_META_MSG:
                    # Whoever sent it gets no answer (a REQ peer times out), the channel
                    # serves on.
                    log.warning("host KV tier: unexpected handshake message %r", message[:64])
                    continue
                sock.send_multipart((identity, b"", self._reply,
                                     msgspec.msgpack.encode(time.perf_counter())))
        except Exception:
            if not self._stop.is_set():
                log.exception("host KV tier: the NIXL side channel stopped")
        finally:
            sock.close(linger=0)

    def drain(self) -> int:
        """Read-done notifications since the last call (prefills send one per read): taken off
        the agent so that they do not pile up, and counted."""
        done = sum(len(m) for m in self._agent.get_new_notifs().values())
        self.reads_done += done
        return done

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self._agent.deregister_memory(self._descs)
        except Exception:
            log.exception("host KV tier: deregistering the host tensors from NIXL failed")


def vllm_side_channel_host() -> str:
    """Where the decode's own NIXL side channel listens (``VLLM_NIXL_SIDE_CHANNEL_HOST``)."""
    from vllm import envs

    return str(envs.VLLM_NIXL_SIDE_CHANNEL_HOST)


def start_endpoint(engine_id: str, device: list[torch.Tensor], host: list[torch.Tensor],
                   pages: list[int]) -> HostReadEndpoint | None:
    """The host tier's read endpoint for the decode ``engine_id`` of this worker process, or
    None (logged) when prefills cannot read it: no kvturn NIXL worker registered here (a host
    tier without kvturn's connector, or built before it), a decode whose side channel is not
    on loopback (prefills on other hosts), or a layout whose regions have no host twins."""
    from kvturn_server.connector import registered_nixl_worker

    worker = registered_nixl_worker(engine_id)
    if worker is None or worker.xfer_handshake_metadata is None:
        log.warning("host KV tier: no kvturn NIXL worker of engine %s in this process; "
                    "prefills cannot read host memory", engine_id)
        return None
    if worker.vllm_config.kv_transfer_config.kv_role != "kv_consumer":
        return None  # a prefill: nobody reads its host tier (only decodes retain)
    side_channel = vllm_side_channel_host()
    if not is_loopback(side_channel):
        # The decode advertises its side channel at a fleet address: its prefills may be on
        # other hosts, where the loopback address a host read names is their own, and each
        # would wait out vLLM's handshake timeout before recomputing.
        log.warning("host KV tier: the decode's NIXL side channel is at %s, not loopback; "
                    "prefills on other hosts cannot reach the host tier's side channel, so "
                    "none read host memory", side_channel)
        return None
    if worker.world_size != 1:
        log.warning("host KV tier: host reads need one tensor-parallel rank, this decode has "
                    "%d; prefills cannot read host memory", worker.world_size)
        return None
    try:
        return HostReadEndpoint(worker.xfer_handshake_metadata, list(worker.nixl_backends),
                                device, host, pages)
    except ValueError as e:
        log.warning("host KV tier: prefills cannot read host memory: %s", e)
        return None
