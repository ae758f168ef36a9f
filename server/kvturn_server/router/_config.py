"""Router settings: one dataclass, built from flags in ``kvturn router``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterConfig:
    """Where the router listens, which backends it uses, and how long it waits for them.

    Attributes:
        prefill: base URLs of prefill vLLM instances (``http://host:port``).
        decode: base URLs of decode vLLM instances.
        prefill_timeout: seconds for the whole prefill leg; past it the decode computes the
            prompt itself.
        connect_timeout: seconds to open a connection to any backend.
        decode_timeout: seconds the decode may stay silent (between stream chunks, or for a
            whole non-streaming reply).
    """

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_timeout: float = 60.0
    connect_timeout: float = 5.0
    decode_timeout: float = 300.0

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("the router needs at least one prefill and one decode backend")
        for url in (*self.prefill, *self.decode):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"backend URL must start with http:// or https://: {url!r}")
