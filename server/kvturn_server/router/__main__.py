"""``python -m kvturn_server.router --prefill URL --decode URL``: the router without the CLI."""

from __future__ import annotations

import argparse
import sys

from kvturn_server._settings import plain_warnings
from kvturn_server.router._app import serve
from kvturn_server.router._config import RouterConfigError
from kvturn_server.router._flags import add_router_args, router_config_from_args


def main(argv: list[str] | None = None) -> int:
    with plain_warnings("kvturn router"):
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvturn_server.router",
                                     description="The kvturn router (same flags as "
                                                 "`kvturn router`).")
    add_router_args(parser)
    args = parser.parse_args(argv)
    try:
        config = router_config_from_args(args)
    except RouterConfigError as exc:
        print(f"kvturn router: {exc}", file=sys.stderr)  # noqa: T201
        return 2
    try:
        serve(config)
    except RouterConfigError as exc:
        print(f"kvturn router: {exc}", file=sys.stderr)  # noqa: T201
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
