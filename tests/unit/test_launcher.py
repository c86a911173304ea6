"""The tests' process launcher (``tests.helpers.launcher``): its children are processes as a fresh ``python -m``
makes them — their own command line, environment, folder, logs and session, nothing of ours imported — and their
exits read as ``subprocess.Popen`` reads them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.helpers.launcher import ProcessHandle, spawn

pytestmark = pytest.mark.slow  # the launcher's start imports torch, transformers and hivemind: 10-15 s
PROBE = "tests.helpers.launched_probe"


def launch(tmp_path: Path, *args: str, fork: bool = True, stderr: bool = False) -> tuple[ProcessHandle, Path]:
    env = {**os.environ, "PROBE_VARIABLE": "set for this child", "PYTHONPATH": str(tmp_path / "extra")}
    log = tmp_path / "probe.log"
    process = spawn([PROBE, str(tmp_path / "seen"), *args], env, log, tmp_path / "probe.err" if stderr else None, fork)
    return process, log


@pytest.mark.parametrize("fork", [True, False], ids=["launcher", "fresh"])
def test_a_child_starts_as_python_m_and_exits_as_a_python_process(tmp_path: Path, fork: bool) -> None:
    process, log = launch(tmp_path, "3", fork=fork)
    assert process.wait(60) == 3
    first, *rest = (tmp_path / "seen").read_text().splitlines()
    seen = json.loads(first)
    assert seen["argv"][0].endswith("launched_probe.py") and seen["argv"][1:] == [str(tmp_path / "seen"), "3"]
    assert seen["cwd"] == os.getcwd()
    assert seen["probe_variable"] == "set for this child"
    assert seen["path"][1] == str(tmp_path / "extra")  # PYTHONPATH's folders come after the main module's
    assert seen["own_session"]
    assert seen["ours_imported"] == []
    assert rest == ["thread", "atexit"]  # non-daemon threads joined first, then the atexit hooks
    assert log.read_text().splitlines() == ["to stdout", "to stderr"]


def test_a_childs_stderr_may_go_to_a_file_of_its_own(tmp_path: Path) -> None:
    process, log = launch(tmp_path, "0", stderr=True)
    assert process.wait(60) == 0
    assert (log.read_text(), (tmp_path / "probe.err").read_text()) == ("to stdout\n", "to stderr\n")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_child_killed_by_a_signal_reads_as_popen_reads_it(tmp_path: Path, sig: signal.Signals) -> None:
    process, _ = launch(tmp_path, "0", "60")
    assert process.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(0.1)
    os.killpg(process.pid, sig)  # its own group, as start_new_session gives
    assert process.wait(60) == -sig
    assert process.poll() == -sig
    process.kill()  # a no-op once it is reaped (its pid may be another process's by now)
