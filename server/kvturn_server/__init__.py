"""kvturn's server side: the vLLM KV connector, the router and the local stack.

The subpackages are imported on their own because they pull different dependencies:
``kvturn_server.connector`` loads inside vLLM processes (it imports vLLM and NIXL),
``kvturn_server.router`` needs the ``[router]`` extra, ``kvturn_server.local`` starts vLLM
processes of the ``[cpu]`` extra.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvturn")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0"

__all__ = ["__version__"]
