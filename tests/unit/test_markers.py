"""The test groups: ``make test`` runs them all, ``make test-fast`` leaves out the slow, deploy and browser ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # a pytest collection in a process of its own, a minute on a loaded machine


@pytest.fixture(scope="module")
def marks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """Each test of the deploy folder and of the observability page's module, with its markers as pytest selects by
    them: one collection (nothing runs) that ``tests/helpers/marker_listing.py`` lists."""
    listing = tmp_path_factory.mktemp("marks") / "marks.json"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        + ["-p", "tests.helpers.marker_listing", "tests/deploy", "tests/integration/test_observability.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "MARKER_LISTING": str(listing)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return {test: set(names) for test, names in json.loads(listing.read_text()).items()}


def test_every_deploy_test_is_in_the_deploy_group(marks: dict[str, set[str]]) -> None:
    deploy = {test: names for test, names in marks.items() if test.startswith("tests/deploy/")}
    assert deploy and all("deploy" in names for names in deploy.values())


def test_the_browser_group_is_the_page_test(marks: dict[str, set[str]]) -> None:
    page = [test.split("::")[-1] for test, names in marks.items() if "browser" in names]
    assert page == ["test_the_page_shows_coverage_and_redraws_when_a_node_stops"]
