"""The test groups: ``make test`` runs them all, ``make test-fast`` leaves out the slow, deploy and browser ones."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # two pytest collections, a minute or two on a loaded machine


def collected(*args: str) -> list[str]:
    """Test ids pytest selects for ``args`` (collection only: nothing runs)."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode in (0, 5), result.stdout + result.stderr  # 5: every test deselected
    return [line for line in result.stdout.splitlines() if re.match(r"tests/\S+::", line)]


def test_every_deploy_test_is_in_the_deploy_group() -> None:
    assert collected("tests/deploy")
    assert collected("-m", "not deploy", "tests/deploy") == []


def test_the_browser_group_is_the_page_test() -> None:
    page = collected("-m", "browser", "tests/integration/test_observability.py")
    assert [test.split("::")[-1] for test in page] == ["test_the_page_shows_coverage_and_redraws_when_a_node_stops"]
