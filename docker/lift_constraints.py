"""Print a pip constraint file without the base image's constraints that refuse one of our pins.

NGC PyTorch bases (25.03+) constrain pip to the versions they were built with (/etc/pip/constraint.txt). Dropping the
whole file would let pip replace numpy, protobuf and the rest of what the base was tested with; only the lines that
cannot hold together with our pinned requirements go, so every other package of the base stays as it is.

    python lift_constraints.py CONSTRAINTS REQUIREMENTS... > constraints.txt
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name


def pins(requirement_files: Iterable[Path]) -> dict[str, str]:
    """Our `name==version` pins by canonical name."""
    found = {}
    for path in requirement_files:
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line and not line.startswith("-"):
                req = Requirement(line)
                found[canonicalize_name(req.name)] = next(iter(req.specifier)).version
    return found


def lift(constraints: str, pinned: dict[str, str]) -> tuple[str, list[str]]:
    """`constraints` less the lines that refuse a pin; returns the kept text and the lifted lines."""
    kept, lifted = [], []
    for line in constraints.splitlines():
        try:
            req = Requirement(line.split("#", 1)[0].strip())
        except InvalidRequirement:  # comments, blank lines, options: kept as they are
            kept.append(line)
            continue
        version = pinned.get(canonicalize_name(req.name))
        if version is not None and not req.specifier.contains(version, prereleases=True):
            lifted.append(line)
        else:
            kept.append(line)
    return "".join(f"{line}\n" for line in kept), lifted


def main(argv: list[str]) -> None:
    constraint_file, *requirement_files = map(Path, argv)
    text = constraint_file.read_text() if constraint_file.is_file() else ""  # bases before 25.03 have none
    kept, lifted = lift(text, pins(requirement_files))
    sys.stdout.write(kept)
    for line in lifted:
        print(f"lifted base constraint: {line}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
