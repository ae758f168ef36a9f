"""The matplotlib bits every kvturn plot shares (demo, bench reuse, bench agent).

matplotlib comes with the ``[bench]`` extra; without it plots are skipped, not failed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` on the file-only Agg backend, or None when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save(plt: Any, fig: Any, path: Path) -> None:
    """Lay out, write ``path`` as PNG (creating its folder) and free the figure."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
