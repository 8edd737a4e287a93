"""What a Python file imports, read from its syntax tree: for the tests that hold the layering of the code."""

from __future__ import annotations

import ast
from pathlib import Path


def imported_packages(path: Path) -> set[str]:
    """The top-level name of every module `path` imports, function-level imports included (absolute imports only:
    the project uses no other)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found
