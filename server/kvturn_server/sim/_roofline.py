"""Cost profiles derived from hardware specifications and the model's shape (a roofline).

Every number a simulated step takes comes from three facts, each stated:

- **the accelerator** (:class:`Accelerator`): dense bf16 tensor throughput, HBM bandwidth and
  size, and the links a KV cache moves over: the NIC per GPU (prefill to decode across nodes),
  NVLink, and host-to-device PCIe (a host tier read back). Numbers are NVIDIA's datasheets.
- **the model** (:class:`ModelShape`): layers, hidden size, attention and KV heads, the MLP's
  width, the vocabulary. From them: the matmul parameters a token goes through, the KV bytes a
  token holds, the weights a decode step reads.
- **the efficiencies** (:class:`Efficiency`): what fraction of each peak a serving engine
  reaches (MFU for prefill, HBM and link efficiency), and the costs no specification gives
  (a read's fixed cost, a leg's overhead, a tensor-parallel all-reduce's latency).

From these:

- **prefill** (compute-bound): a token at context ``c`` costs ``2 P + 4 L H d c`` FLOPs (``P``
  matmul parameters, ``L`` layers, ``H`` query heads of size ``d``: QK^T and AV); at MFU ``m``
  of ``g`` GPUs' peak ``F`` that is the connector's work model (``connector/_cost.py``,
  :meth:`CostModel.work`) with ``compute_tokens_per_s = m g F / 2P`` units per second and
  ``A = 2P / 4 L H d`` (the context at which attention costs as much as the matmuls).
- **decode** (bandwidth-bound): a step reads the weights once and the KV of every running
  sequence: ``ITL = (weights + batch KV) / (e g B) + 2 L t_ar`` for ``g > 1`` (two all-reduces a
  layer), at HBM bandwidth ``B`` and efficiency ``e``, for a stated running batch.
- **KV moves**: ``bytes / (e_link x link bandwidth x g)`` (every GPU moves its own shard) plus a
  fixed cost per read.

:data:`CHECKS` applies the same formulas to published measurements and states both numbers;
``docs/simulate.md`` prints them and a test holds the profiles to them.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024 ** 3


@dataclass(frozen=True)
class Accelerator:
    """One GPU's peaks (NVIDIA datasheets): tensor FLOP/s, memory and link bandwidths."""

    name: str
    bf16_tflops: float
    """Dense bf16 tensor throughput (the datasheets' figure without sparsity)."""
    hbm_tbps: float
    memory_gib: float
    """What the driver reports (``nvidia-smi`` total), the base of vLLM's memory fraction."""
    nic_gbps: float
    """RDMA bandwidth per GPU, GB/s (one 400 Gb/s ConnectX-7 per GPU in HGX/DGX nodes)."""
    nvlink_gbps: float
    """NVLink bandwidth per direction, GB/s."""
    pcie_gbps: float
    """Host-to-device bandwidth per direction, GB/s (PCIe Gen5 x16)."""
    source: str


H100_SXM = Accelerator(
    "H100 SXM", bf16_tflops=989.4, hbm_tbps=3.35, memory_gib=79.6, nic_gbps=50.0,
    nvlink_gbps=450.0, pcie_gbps=64.0,
    source="NVIDIA H100 datasheet (SXM5: 989 TFLOPS dense bf16, 3.35 TB/s HBM3, 80 GB, NVLink "
           "900 GB/s, PCIe Gen5 128 GB/s both ways); 81,559 MiB reported; DGX H100: one "
           "400 Gb/s ConnectX-7 per GPU")
H200 = Accelerator(
    "H200 SXM", bf16_tflops=989.4, hbm_tbps=4.8, memory_gib=140.4, nic_gbps=50.0,
    nvlink_gbps=450.0, pcie_gbps=64.0,
    source="NVIDIA H200 datasheet (SXM: 989 TFLOPS dense bf16, 4.8 TB/s HBM3e, 141 GB, NVLink "
           "900 GB/s, PCIe Gen5 128 GB/s both ways); 143,771 MiB reported; HGX H200: one "
           "400 Gb/s ConnectX-7 per GPU")


@dataclass(frozen=True)
class ModelShape:
    """A dense decoder's shape (its ``config.json``): what a token costs and holds."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2

    @property
    def matmul_params(self) -> int:
        """Parameters every token's forward pass multiplies by (attention projections and the
        gated MLP; the LM head runs for one token of a prompt and is left out)."""
        attention = 2 * self.hidden * self.heads * self.head_dim \
            + 2 * self.hidden * self.kv_heads * self.head_dim
        return self.layers * (attention + 3 * self.hidden * self.intermediate)

    @property
    def weight_bytes(self) -> int:
        """All weights (embedding and LM head untied)."""
        return (self.matmul_params + 2 * self.vocab * self.hidden) * self.dtype_bytes

    @property
    def step_read_bytes(self) -> int:
        """Weights a decode step reads: every matmul and the LM head (the embedding is a
        lookup of a few rows)."""
        return (self.matmul_params + self.vocab * self.hidden) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attention_tokens(self) -> int:
        """``A``: the context at which a token's attention FLOPs equal its matmul FLOPs."""
        return round(2 * self.matmul_params / (4 * self.layers * self.heads * self.head_dim))


QWEN3_32B = ModelShape("Qwen3-32B", layers=64, hidden=5120, heads=64, kv_heads=8, head_dim=128,
                       intermediate=25600, vocab=151936)
QWEN25_72B = ModelShape("Qwen2.5-72B", layers=80, hidden=8192, heads=64, kv_heads=8,
                        head_dim=128, intermediate=29568, vocab=152064)


@dataclass(frozen=True)
class Efficiency:
    """What a serving engine reaches of the peaks, and the costs no datasheet gives."""

    mfu: float = 0.6
    """Prefill: fraction of the dense bf16 peak. The published single-request TTFT in
    :data:`CHECKS` implies 0.61 for vLLM on H100s."""
    hbm: float = 0.8
    """Decode: fraction of HBM bandwidth (the published ITL in :data:`CHECKS` implies 0.78)."""
    link: float = 0.8
    """KV transfers over the NIC or NVLink (assumed: RDMA reaches 80-90 % of line rate)."""
    pcie: float = 0.8
    """Host-to-device reads of a host tier (a published measurement in :data:`CHECKS`)."""
    decode_batch_tokens: int = 131072
    """The running batch a decode step reads the KV of: 128k tokens (one agent context of
    that size, or sixteen of 8k). ITL is stated for this batch."""
    allreduce_us: float = 25.0
    """Latency of one tensor-parallel all-reduce of a decode step (assumed: NCCL's small-message
    latency over NVLink); two per layer."""
    read_fixed_ms: float = 5.0
    """A KV read's fixed cost: NIXL's setup and the request parked one more engine step
    (assumed)."""
    leg_overhead_ms: float = 25.0
    """HTTP hops, tokenization and scheduling of one leg (assumed)."""


def prefill_tokens_per_s(model: ModelShape, gpu: Accelerator, gpus: int,
                         eff: Efficiency) -> float:
    """Work units (tokens at context 0) per second: ``m g F / 2P``."""
    return eff.mfu * gpus * gpu.bf16_tflops * 1e12 / (2 * model.matmul_params)


def prefill_seconds(model: ModelShape, gpu: Accelerator, gpus: int, eff: Efficiency,
                    tokens: int, context: int = 0) -> float:
    """Seconds to compute ``tokens`` prompt tokens after ``context`` cached ones."""
    units = tokens * (1 + (context + (tokens - 1) / 2) / model.attention_tokens)
    return units / prefill_tokens_per_s(model, gpu, gpus, eff)


def itl_seconds(model: ModelShape, gpu: Accelerator, gpus: int, eff: Efficiency,
                batch_tokens: int) -> float:
    """One decode step reading the weights and ``batch_tokens`` tokens of KV."""
    read = (model.step_read_bytes + batch_tokens * model.kv_bytes_per_token) \
        / (eff.hbm * gpus * gpu.hbm_tbps * 1e12)
    allreduce = 2 * model.layers * eff.allreduce_us * 1e-6 if gpus > 1 else 0.0
    return read + allreduce


@dataclass(frozen=True)
class Check:
    """A derived number beside a published measurement of the same thing."""

    what: str
    derived: float
    published: float
    unit: str
    source: str

    @property
    def ratio(self) -> float:
        """Derived over published."""
        return self.derived / self.published

    def describe(self) -> dict[str, object]:
        return {"what": self.what, "derived": round(self.derived, 4),
                "published": self.published, "unit": self.unit, "source": self.source}


def _checks(eff: Efficiency) -> tuple[Check, ...]:
    # ML.ENERGY serves LMArena chats (short prompts, 625-token replies on average): about 1k
    # tokens of context per running sequence.
    chat_context = 1000
    return (
        Check("prefill: TTFT of one 8,192-token prompt, Qwen2.5-72B-Instruct on 2x H100 "
              "(vLLM, TP2, concurrency 1)",
              prefill_seconds(QWEN25_72B, H100_SXM, 2, eff, 8192) + eff.leg_overhead_ms / 1e3,
              1.0638, "s",
              "tenstorrent/tt-inference-server issue #143, GPU reference sweep (2025-04-01)"),
        Check("decode: median ITL, Qwen3-32B bf16 on 1x H100 (vLLM, max_num_seqs 8, LMArena "
              "chats)",
              itl_seconds(QWEN3_32B, H100_SXM, 1, eff, 8 * chat_context), 0.025206, "s",
              "ML.ENERGY leaderboard, Qwen/Qwen3-32B lm-arena-chat (ml-energy/leaderboard "
              "public/data/models)"),
        Check("decode: median ITL, Qwen3-32B bf16 on 2x H100 (vLLM, TP2, max_num_seqs 16, "
              "LMArena chats)",
              itl_seconds(QWEN3_32B, H100_SXM, 2, eff, 16 * chat_context), 0.016037, "s",
              "ML.ENERGY leaderboard, as above"),
        Check("host tier: host-to-device read bandwidth, vLLM's CPU KV offload, PCIe Gen5",
              eff.pcie * H200.pcie_gbps, 54.0, "GB/s",
              "agentic-kvc (gahow), single H20, vLLM 0.18.1 native DRAM offload: CPU-tier hits "
              "transfer-bound at about 54 GB/s"),
    )


CHECKS: tuple[Check, ...] = _checks(Efficiency())
