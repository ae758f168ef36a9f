"""kvturn: a drop-in OpenAI client that carries conversations (in development)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvturn")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0"

__all__ = ["__version__"]
