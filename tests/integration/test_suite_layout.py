"""The test suite's own layout: one folder per package plus integration/, file names unique across the folders
(pytest imports test modules by file name), and no test module importing another: what tests share is in
tests/helpers/, the shared fixtures in tests/conftest.py."""

from __future__ import annotations

from helpers.config import REPO
from helpers.sources import imported_packages

TESTS = REPO / "tests"
PACKAGES = ["benchmarks", "core", "data", "models", "optim", "train"]
TEST_FILES = sorted(TESTS.rglob("test_*.py"))


def test_each_test_module_sits_in_its_package_folder_or_integration():
    assert all((REPO / package / "__init__.py").is_file() for package in PACKAGES)
    folders = {path.relative_to(TESTS).parent.as_posix() for path in TEST_FILES}
    assert folders == {*PACKAGES, "integration"}


def test_test_file_names_are_unique_across_the_folders():
    names = [path.name for path in TEST_FILES]
    assert sorted(names) == sorted(set(names))


def test_no_test_module_or_helper_imports_a_test_module_or_conftest():
    offenders = {}
    for path in [*TEST_FILES, *TESTS.glob("helpers/*.py")]:
        if bad := {name for name in imported_packages(path) if name.startswith("test_") or name == "conftest"}:
            offenders[path.relative_to(TESTS).as_posix()] = sorted(bad)
    assert offenders == {}
