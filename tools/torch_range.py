"""Is this torch one the course supports? `make setup` asks, whichever torch it installed or found.

The course is tested on the oldest and the newest torch of the range (`make test` on the pinned one,
`make test-oldest-torch` on the oldest); a torch outside it may lack an API a lesson uses or print
other words than the notebooks store."""

from __future__ import annotations

import sys

OLDEST, NEWEST = "2.11", "2.14.1"  # also in README.md and pyproject.toml


def release(version: str) -> tuple[int, ...]:
    """'2.11.0+cu130' -> (2, 11, 0)."""
    numbers = version.split("+")[0].split(".")
    return tuple(int("".join(ch for ch in part if ch.isdigit()) or 0) for part in numbers[:3])


def supported(version: str) -> bool:
    return release(OLDEST) <= release(version)[:len(release(OLDEST))] and release(version) <= release(NEWEST)


def main() -> int:
    try:
        import torch
    except ImportError:
        print(f"{sys.executable} has no torch: make setup TORCH=system uses the torch that PYTHON=... already "
              f"has; leave TORCH out to install the pinned one", file=sys.stderr)
        return 1
    try:
        import torchvision
    except ImportError:
        print(f"torch {torch.__version__} has no torchvision beside it: install the torchvision built for it "
              f"(the chapters use its models and transforms)", file=sys.stderr)
        return 1
    if not supported(torch.__version__):
        print(f"torch {torch.__version__} is outside the range this course supports ({OLDEST} to {NEWEST}): "
              f"use a torch in that range (PYTHON=... another Python), or leave TORCH out to install the "
              f"pinned one", file=sys.stderr)
        return 1
    print(f"ringside is ready: torch {torch.__version__}, torchvision {torchvision.__version__} "
          f"(supported: {OLDEST} to {NEWEST})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
