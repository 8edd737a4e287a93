"""The generated part of `python -m train --help`: the options of the config groups a user picks, read where Hydra
reads them, so that a preset added under conf/ (an optimizer, a model, an experiment) is listed without editing the
help text."""

from __future__ import annotations

import textwrap

from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.object_type import ObjectType

HELP_WIDTH = 116  # characters per line of the help text
INDENT = 2  # the group names' indent in the help text
NAME_WIDTH = 11  # `optim:` and its padding: the options start in one column


def group_options(*groups: str) -> str:
    """`${help_groups:task,model,...}`: one line per group, `group: chosen, the others in name order`, wrapped
    under the first option. The chosen option is the composed config's."""
    choices = HydraConfig.get().runtime.choices
    lines = []
    for group in groups:
        options, chosen = _options(group), choices.get(group)
        ordered = [chosen, *(option for option in options if option != chosen)] if chosen in options else options
        lines.append(_wrapped(f"{group}:", ordered))
    return "\n".join(lines)


def experiment_list() -> str:
    """`${help_experiments:}`: every preset of conf/experiment/, the CPU demos (`*demo`) apart from the recipes."""
    names = _options("experiment")
    demos = [name for name in names if name.endswith("demo")]
    return "\n".join([_wrapped("CPU demos:", demos), _wrapped("recipes:", [n for n in names if n not in demos])])


def _options(group: str) -> list[str]:
    """The group's config files on the search path, in name order (typed schemas that Python stores in the same
    group, as data's, are left out)."""
    sources = [source for source in GlobalHydra.instance().config_loader().get_sources()
               if source.scheme() != "structured"]
    return sorted({option for source in sources if source.is_group(group)
                   for option in source.list(group, ObjectType.CONFIG)})


def _wrapped(label: str, items: list[str]) -> str:
    """`label items, ...` wrapped to the help's width, the items in one column under the first."""
    return textwrap.fill(", ".join(items), HELP_WIDTH, break_on_hyphens=False,
                         initial_indent=" " * INDENT + label.ljust(NAME_WIDTH),
                         subsequent_indent=" " * (INDENT + NAME_WIDTH))
