"""The generated part of `python -m train --help`: the options of the config groups a user picks, read where Hydra
reads them, so that a preset added under conf/ (an optimizer, a model) is listed without editing the help text."""

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
    under the first option. The options are the group's config files on the search path (typed schemas that
    Python stores in the same group, as data's, are left out); the chosen one is the composed config's."""
    sources = [source for source in GlobalHydra.instance().config_loader().get_sources()
               if source.scheme() != "structured"]
    choices = HydraConfig.get().runtime.choices
    lines = []
    for group in groups:
        options = sorted({option for source in sources if source.is_group(group)
                          for option in source.list(group, ObjectType.CONFIG)})
        chosen = choices.get(group)
        ordered = [chosen, *(option for option in options if option != chosen)] if chosen in options else options
        lines.append(textwrap.fill(", ".join(ordered), HELP_WIDTH, break_on_hyphens=False,
                                   initial_indent=" " * INDENT + f"{group}:".ljust(NAME_WIDTH),
                                   subsequent_indent=" " * (INDENT + NAME_WIDTH)))
    return "\n".join(lines)
