"""What the "adding an X" tests share: the file list a docs/development.md section gives, and a copy of the
repository to add files to, so that the shared tests can be run there without touching the repository."""

from __future__ import annotations

import fnmatch
import re
import shutil
from pathlib import Path

from helpers.config import REPO


def listed_files(section: str) -> list[str]:
    """The numbered list of files in docs/development.md's section `section`, placeholders (`<name>`) kept."""
    text = (REPO / "docs" / "development.md").read_text()
    body = text.split(f"\n## {section}\n")[1].split("\n## ")[0]
    return re.findall(r"^\d+\. `([^`]+)`", body, re.MULTILINE)


def _git_ignored(root: Path) -> tuple[set[Path], list[str]]:
    """The repository's `.gitignore`: anchored paths (`/runs/`) and name patterns (`__pycache__/`, `*.pyc`)."""
    anchored, names = set(), []
    for line in (root / ".gitignore").read_text().splitlines():
        line = line.strip().rstrip("/")
        if line and not line.startswith(("#", "!")):
            (anchored.add(root / line.lstrip("/")) if line.startswith("/") else names.append(line))
    return anchored, names


def copy_sources(destination: Path) -> None:
    """The working tree as git would see it (tracked and untracked files, no ignored outputs or .git)."""
    anchored, names = _git_ignored(REPO)

    def ignore(directory: str, entries: list[str]) -> list[str]:
        return [entry for entry in entries if entry == ".git" or Path(directory, entry) in anchored
                or any(fnmatch.fnmatch(entry, pattern) for pattern in names)]

    shutil.copytree(REPO, destination, ignore=ignore)
