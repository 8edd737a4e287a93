"""The ground floor every package builds on: user errors and option checks, atomic writes, NVIDIA apex detection,
and the registry type of what a config selects by name. It imports nothing else of the project."""
