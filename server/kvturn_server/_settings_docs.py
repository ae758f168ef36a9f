"""The docs' settings tables, generated from the settings dataclasses.

Each table sits in its page between two markers::

    <!-- settings: router (generated: python -m kvturn_server._settings_docs) -->

    | setting | ... |

    <!-- end settings: router -->

``python -m kvturn_server._settings_docs`` rewrites them from the code; ``--check`` only says
which are out of date (exit 1). ``tests/server/test_settings.py`` runs the check.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kvturn_server import connector, router

DOCS = Path(__file__).resolve().parents[2] / "docs"

TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    "router": ("router-operations.md", router.settings_table),
    "connector": ("connector.md", connector.settings_table),
}
"""Table name -> (page under docs/, its generator)."""


def _block(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- settings: {name} [^\n]*-->\n)(.*?)(<!-- end settings: {name} -->)",
                      re.DOTALL)


def stale(docs: Path = DOCS, *, write: bool = False) -> list[str]:
    """The tables whose page differs from the code (rewritten in place with ``write``)."""
    out = []
    for name, (page, generate) in TABLES.items():
        path = docs / page
        text = path.read_text()
        found = _block(name).search(text)
        if found is None:
            out.append(f"{page}: no '<!-- settings: {name} ... -->' block")
            continue
        table = "\n" + generate() + "\n"  # blank lines around it: a Markdown table of its own
        if found.group(2) != table:
            out.append(f"{page}: the {name} settings table differs from the code")
            if write:
                path.write_text(text[:found.start(2)] + table + text[found.end(2):])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvturn_server._settings_docs",
        description="Rewrite the docs' settings tables from the settings dataclasses.")
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a table is out of date")
    args = parser.parse_args(argv)
    found = stale(write=not args.check)
    for line in found:
        sys.stdout.write(("out of date: " if args.check else "rewrote: ") + line + "\n")
    return 1 if found and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
