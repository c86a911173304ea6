"""The test helpers' process handles: a freeze or crash signal reaches the whole process group, or says it cannot."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.processes import ManagedProcess

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_sigkill_reaches_a_process_in_its_own_group(tmp_path: Path) -> None:
    process = ManagedProcess("sleeper", subprocess.Popen(SLEEPER, start_new_session=True), tmp_path / "log")
    process.send(signal.SIGKILL)
    assert process.popen.wait(10) == -signal.SIGKILL


def test_sigkill_to_a_process_without_its_own_group_is_refused_not_lost(tmp_path: Path) -> None:
    process = ManagedProcess("sleeper", subprocess.Popen(SLEEPER), tmp_path / "log")
    try:
        with pytest.raises(RuntimeError, match="no process group"):
            process.send(signal.SIGKILL)
    finally:
        process.popen.kill()
        process.popen.wait()
