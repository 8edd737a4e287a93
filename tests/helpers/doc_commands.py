"""The `python -m ...` commands that README.md and docs/**/*.md show, and how each is checked to compose or parse.

The fenced shell blocks of the pages are read, `\\` continuations joined, comments dropped and each command split
into simple commands (`;`, `&&`, `|`). Each command is one case, named `page:line`:

- `python -m train ...` (and `torchrun ... -m train ...`): Hydra's compose API over `conf/`, in this process, with
  Hydra's own flags dropped and each value of a sweep's `a,b` in turn. Unknown groups, experiments and keys
  fail here; the data need not exist.
- `python -m data.prepare ...`: compose over `conf/prepare/`.
- `python -m train.pipeline ...`: the pipeline's own parser, then a compose of each stage's `python -m train`.
- other project modules (argparse): their parser, run by `main()` and stopped as soon as the arguments are parsed.
- `python -m pytest ...` and `pytest ...`: the named test files exist.

Commands run by another program (docker, sbatch, srun, pip) cannot be checked offline and are skipped by rule.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.config import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console"}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PYTHON = re.compile(r"^python[0-9.]*$")
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")", "$("}
HYDRA_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--info", "--config-path", "-cp", "--config-name", "-cn",
                          "--config-dir", "-cd", "--experimental-rerun"}
HYDRA_FLAGS = {"-m", "--multirun", "--resolve", "--run", "-r", "--hydra-help", "--shell-completion", "-sc"}


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    argv: tuple[str, ...]

    index: int = 0  # the second command of a line (`a; b`) is 1

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}" + (f"+{self.index}" if self.index else "")


def shell_blocks(text: str):
    """(first line number, lines) of each fenced block whose language is a shell's or none."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^\s*```\s*([\w-]*)", lines[i])
        if not fence:
            i += 1
            continue
        language, start, i = fence.group(1).lower(), i + 2, i + 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        if language in SHELL_LANGUAGES:
            yield start, body if language else unlabelled_commands(body)


def starts_with_command(line: str) -> bool:
    """In an unlabelled block (a listing, a tree, a command) only lines that start with a command count."""
    words = [w for w in line.lstrip("$ ").split() if not ENV_ASSIGNMENT.match(w)]
    return bool(words) and (PYTHON.match(Path(words[0]).name) is not None or words[0] in ("torchrun", "pytest"))


def unlabelled_commands(body: list[str]) -> list[str]:
    """The lines of an unlabelled block that belong to a command (blanked otherwise, to keep line numbers)."""
    kept, continued = [], False
    for line in body:
        keep = continued or starts_with_command(line)
        kept.append(line if keep else "")
        continued = keep and line.rstrip().endswith("\\")
    return kept


def logical_lines(start: int, body: list[str]):
    """(line number, text) with `\\` continuations joined and a console's `$ ` prompt dropped."""
    pending, first = "", start
    for number, raw in enumerate(body, start):
        line = raw.rstrip()
        if not pending:
            first = number
            line = re.sub(r"^\s*\$ ", "", line)
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        yield first, pending + line
        pending = ""
    if pending:
        yield first, pending


def simple_commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line: comments dropped, split at `;`, `&&`, `|`, with redirections removed."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    try:
        tokens = list(lexer)
    except ValueError as error:  # an unbalanced quote: the command cannot run as shown
        raise ValueError(f"{error}: {line}") from None
    commands, current = [], []
    skip_next = False
    for token in tokens:
        if skip_next:
            skip_next = False
        elif token in SEPARATORS or set(token) <= set("();&|"):
            commands.append(current)
            current = []
        elif set(token) <= set("<>&") or re.fullmatch(r"\d?[<>]+&?", token):
            skip_next = True
        else:
            current.append(token)
    commands.append(current)
    return [c for c in commands if c]


def is_candidate(argv: list[str]) -> bool:
    words = [Path(w).name for w in argv]
    return (any(PYTHON.match(w) for w in words) and "-m" in argv) or "torchrun" in words or "pytest" in words


def collect() -> list[Command]:
    found = []
    for page in PAGES:
        name = page.relative_to(REPO).as_posix()
        for start, body in shell_blocks(page.read_text()):
            for number, line in logical_lines(start, body):
                # a comment starts a word: `registry#image:tag` is one word, `cmd   # note` ends at the note
                line = re.sub(r"(^|\s)#.*$", "", line)
                candidates = [argv for argv in simple_commands(line) if is_candidate(argv)]
                found += [Command(name, number, tuple(argv), i) for i, argv in enumerate(candidates)]
    return found




# ---------------------------------------------------------------------------------------------------------------
# How each kind of command is checked


def hydra_overrides(args: list[str]) -> list[str]:
    """A `python -m train` argument list as compose() takes it: Hydra's flags and `hydra.*` overrides dropped, a
    multirun's sweeps reduced to their first value, `+experiment=` read as `experiment=` (as `python -m train` does)."""
    from train.__main__ import accept_appended_experiment

    multirun = any(a in ("-m", "--multirun") for a in args)
    overrides, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in HYDRA_FLAGS_WITH_VALUE:
            skip = True
        elif arg in HYDRA_FLAGS or arg.startswith("--"):
            if arg.split("=")[0] not in HYDRA_FLAGS_WITH_VALUE | HYDRA_FLAGS:
                raise AssertionError(f"unknown flag for a Hydra app: {arg}")
        elif re.match(r"^[+~]*hydra[./]", arg):
            continue
        else:
            overrides.append(first_sweep_value(arg) if multirun else arg)
    return accept_appended_experiment(overrides)


def sweep_values(arg: str) -> list[str]:
    """`key=a,b` as [`key=a`, `key=b`] (top-level commas only: `key=[1,2]` is one value)."""
    values = []
    while True:
        first = first_sweep_value(arg)
        values.append(first)
        if first == arg:
            return values
        key = arg.partition("=")[0]
        arg = key + "=" + arg[len(first) + 1:]


def first_sweep_value(arg: str) -> str:
    key, sep, value = arg.partition("=")
    depth, quote = 0, None
    for i, char in enumerate(value):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[({":
            depth += 1
        elif char in "])}":
            depth -= 1
        elif char == "," and depth == 0:
            return key + sep + value[:i]
    return arg


def compose(config_dir: Path, overrides: list[str]) -> None:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        hydra_compose(config_name="config", overrides=overrides)


def each_sweep_value(args: list[str]) -> list[list[str]]:
    """The argument lists a sweep's checks compose: its first job, then each further value of each swept key."""
    if not any(a in ("-m", "--multirun") for a in args):
        return [args]
    variants = [args]
    for i, arg in enumerate(args):
        for value in sweep_values(arg)[1:]:
            variants.append([*args[:i], value, *args[i + 1:]])
    return variants


def check_train(args: list[str]) -> None:
    from train.config import register_configs

    register_configs()
    for variant in each_sweep_value(args):
        compose(REPO / "conf", hydra_overrides(variant))


def check_prepare(args: list[str]) -> None:
    from data.prepare import register_prepare_configs

    register_prepare_configs()
    compose(REPO / "conf" / "prepare", hydra_overrides(args))


def check_pipeline(args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Parse with the pipeline's parser, then compose every stage's `python -m train` command."""
    import train.pipeline as pipeline

    stages = []

    class Finished:
        returncode = 0

    def record(command, *_, **__):
        stages.append(command)
        return Finished()

    monkeypatch.setattr(pipeline, "run_stage", record)
    monkeypatch.setattr(pipeline, "squad_result", lambda run_dir: (0.0, 0.0))
    parse_or_fail(lambda: pipeline.main(args))
    assert len(stages) == len(pipeline.STAGES)
    for command in stages:
        assert command[1:3] == ["-m", "train"]
        check_train(command[3:])


class _Parsed(Exception):
    """Raised by the patched parser once a command line is parsed: the module's work never starts."""


def parse_or_fail(call) -> None:
    try:
        call()
    except SystemExit as exit_:
        raise AssertionError(f"the module's parser rejected the arguments (exit {exit_.code})") from None


def check_argparse(module_name: str, args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Parse `args` with the module's own parser: its `build_parser()` or `parser` when it has one, else its
    `main()` with argparse stopped right after parsing."""
    module = importlib.import_module(module_name)
    build = getattr(module, "build_parser", None)
    parser = build() if callable(build) else getattr(module, "parser", None)
    if isinstance(parser, argparse.ArgumentParser):
        parse_or_fail(lambda: parser.parse_args(args))
        return
    main = getattr(module, "main", None)
    assert callable(main), f"{module_name} has neither a parser nor a main() to parse its arguments"
    parse_known = argparse.ArgumentParser.parse_known_args

    def parse_args(self, args=None, namespace=None):
        namespace, extras = parse_known(self, args, namespace)
        if extras:
            self.error("unrecognized arguments: " + " ".join(extras))
        raise _Parsed(namespace)

    def parse_known_args(self, args=None, namespace=None):
        raise _Parsed(parse_known(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)
    monkeypatch.setattr(sys, "argv", [module_name, *args])
    try:
        parse_or_fail(main)
    except _Parsed:
        return
    raise AssertionError(f"{module_name}.main() returned without parsing a command line")


def check_pytest(args: list[str]) -> None:
    paths = [a.split("::")[0] for a in args if a.startswith("tests") or a.endswith(".py")]
    missing = [p for p in paths if not (REPO / p).exists()]
    assert not missing, f"no such test path: {missing}"


def split_command(argv: list[str]) -> tuple[str, list[str]] | str:
    """(module, its arguments) of a `python -m` / `torchrun -m` / `pytest` command, or why it is skipped."""
    words = list(argv)
    while words and ENV_ASSIGNMENT.match(words[0]):
        words.pop(0)
    program = Path(words[0]).name if words else ""
    if program == "pytest":
        return "pytest", words[1:]
    if program == "torchrun":
        if "-m" not in words:
            return "torchrun runs a script, not a module"
        i = words.index("-m")
        return words[i + 1], words[i + 2:]
    if PYTHON.match(program):
        assert words[1:2] == ["-m"], f"expected `{program} -m <module>`: {shlex.join(argv)}"
        return words[2], words[3:]
    return f"run by {program}, which cannot be checked offline"


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def check_command(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Check one command as its kind is checked (see the module's docstring); skip what cannot be checked offline."""
    split = split_command(argv)
    if isinstance(split, str):
        pytest.skip(split)
    module, args = split
    if module == "pytest":
        check_pytest(args)
    elif module == "train":
        check_train(args)
    elif module == "data.prepare":
        check_prepare(args)
    elif module == "train.pipeline":
        check_pipeline(args, monkeypatch)
    else:
        assert module_exists(module), f"no module {module}"
        if (REPO / module.split(".")[0]).is_dir():  # the project's own: parse its arguments
            check_argparse(module, args, monkeypatch)
