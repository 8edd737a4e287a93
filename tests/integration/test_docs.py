"""Every `python -m ...` command in README.md and docs/**/*.md composes or parses as written (how each kind is
checked: helpers/doc_commands.py)."""

from __future__ import annotations

import re

import pytest
from helpers.doc_commands import (
    Command,
    check_command,
    collect,
    each_sweep_value,
    first_sweep_value,
    hydra_overrides,
    is_candidate,
    logical_lines,
    shell_blocks,
    simple_commands,
    split_command,
    sweep_values,
)

COMMANDS = collect()


@pytest.mark.parametrize("command", COMMANDS, ids=[c.id for c in COMMANDS])
def test_command_is_valid(command: Command, monkeypatch: pytest.MonkeyPatch) -> None:
    check_command(list(command.argv), monkeypatch)


def test_pages_show_commands() -> None:
    assert any(c.page == "README.md" and c.argv[-1] == "train" for c in COMMANDS), "README lost `python -m train`"
    assert len({c.page for c in COMMANDS}) > 5


def test_extraction_rules() -> None:
    text = "\n".join([
        "```bash",
        "HF_HUB_OFFLINE=1 python -m train optim=adamw \\",
        "    precision=bf16   # a comment",
        "export IMAGE=registry#image:tag",
        "python -m a.b; python -m c.d  # two",
        "```",
        "```python",
        "python -m not.shell",
        "```",
    ])
    lines = [(n, re.sub(r"(^|\s)#.*$", "", line)) for s, b in shell_blocks(text) for n, line in logical_lines(s, b)]
    commands = [(n, argv) for n, line in lines for argv in simple_commands(line) if is_candidate(argv)]
    assert commands == [
        (2, ["HF_HUB_OFFLINE=1", "python", "-m", "train", "optim=adamw", "precision=bf16"]),
        (5, ["python", "-m", "a.b"]),
        (5, ["python", "-m", "c.d"]),
    ]
    assert split_command(commands[0][1]) == ("train", ["optim=adamw", "precision=bf16"])
    assert hydra_overrides(["-m", "optim=lamb,adamw", "--cfg", "job", "hydra.run.dir=x", "+experiment=demo"]) == [
        "optim=lamb", "experiment=demo"]
    assert first_sweep_value("a=[1,2],b") == "a=[1,2]"
    assert sweep_values("a=x,[1,2],y") == ["a=x", "a=[1,2]", "a=y"]
    assert each_sweep_value(["-m", "o=a,b"]) == [["-m", "o=a,b"], ["-m", "o=b"]]
