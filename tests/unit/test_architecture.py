"""The dependency direction holds: ``shared`` <- ``swarm_node``, ``shared`` <- ``gateway``, never sideways.

The contracts live in pyproject.toml ([tool.importlinter]); import-linter checks them here. A second test proves
they bite: it copies the packages, adds one forbidden import, and expects import-linter to fail.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shared", "swarm_node", "gateway", "sim")
SHARED_CONTRACT = "shared is independent of the node and the gateway"
SIDEWAYS_CONTRACT = "gateway and swarm_node never import each other"
HTTP_CONTRACT = "the HTTP layer sees the engine interface only, never torch or the swarm client"
CLIENT_CONTRACT = "the swarm client and the model never see OpenAI types"
SWARM_CONTRACT = "the swarm client never reaches into the local model"
TEXT_CONTRACT = "the text pipeline never sees the web, torch, the swarm or Redis state"
SIM_CONTRACT = "the simulator runs our pure decision code only: nothing async, no DHT, no torch, no web stack"


def lint_imports(project: Path) -> subprocess.CompletedProcess[str]:
    """Runs the venv's ``lint-imports`` on the project folder (its pyproject.toml and packages)."""
    executable = Path(sys.executable).parent / "lint-imports"
    return subprocess.run(
        [str(executable), "--no-cache", "--no-logo"],
        cwd=project,
        env={"PATH": str(executable.parent), "PYTHONPATH": str(project)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_import_contracts_are_kept() -> None:
    result = lint_imports(ROOT)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert f"{SHARED_CONTRACT} KEPT" in output
    assert f"{SIDEWAYS_CONTRACT} KEPT" in output
    assert f"{SIM_CONTRACT} KEPT" in " ".join(output.split())


@pytest.mark.parametrize(
    ("module", "forbidden_import", "contract"),
    [
        ("shared/errors.py", "import gateway", SHARED_CONTRACT),
        ("shared/wire.py", "import swarm_node", SHARED_CONTRACT),
        ("shared/weights.py", "import fastapi", SHARED_CONTRACT),
        ("gateway/__init__.py", "import swarm_node", SIDEWAYS_CONTRACT),
        ("swarm_node/__init__.py", "import gateway", SIDEWAYS_CONTRACT),
        # Inside the gateway: serving code that reached for torch or the swarm client, or a swarm client that
        # reached for OpenAI types or the local model.
        ("gateway/api/serving/choices.py", "import torch", HTTP_CONTRACT),
        # The text pipeline (detokenizer, stop strings, assembler, reasoning and tool parsers) is plain Python.
        ("gateway/text/stop_strings.py", "import torch", TEXT_CONTRACT),
        ("gateway/text/assembler.py", "import fastapi", TEXT_CONTRACT),
        ("gateway/text/tool_parsers.py", "import gateway.api.errors", TEXT_CONTRACT),
        ("gateway/text/chat_output.py", "import gateway.state.store", TEXT_CONTRACT),
        ("gateway/api/serving/common.py", "import gateway.model.engine", HTTP_CONTRACT),
        ("gateway/api/protocol/common.py", "import gateway.model.sampling", HTTP_CONTRACT),
        ("gateway/swarm/chain_session.py", "import gateway.api.protocol.common", CLIENT_CONTRACT),
        ("gateway/model/engine.py", "import fastapi", CLIENT_CONTRACT),
        ("gateway/swarm/router.py", "import gateway.model.head", SWARM_CONTRACT),
        # The simulator: an async import of its own, or decision code that grew one (routing reaching the DHT).
        ("sim/world.py", "import asyncio", SIM_CONTRACT),
        ("sim/swarm.py", "import torch", SIM_CONTRACT),
        ("gateway/swarm/routing.py", "import gateway.swarm.monitor", SIM_CONTRACT),
    ],
)
def test_a_forbidden_import_breaks_a_contract(
    tmp_path: Path, module: str, forbidden_import: str, contract: str
) -> None:
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    with (tmp_path / module).open("a") as source:
        source.write(f"\n\ndef _violation() -> None:\n    {forbidden_import}\n")

    result = lint_imports(tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert f"{contract} BROKEN" in " ".join(output.split())  # lint-imports wraps long names


CIRCLES_SCRIPT = """
import grimp
graph = grimp.build_graph("shared", "swarm_node", "gateway")  # TYPE_CHECKING imports included
for module in sorted(graph.modules):
    for imported in sorted(graph.find_modules_directly_imported_by(module)):
        if graph.chain_exists(importer=imported, imported=module):
            print(module, "<->", imported)
"""


def import_circles(project: Path) -> list[str]:
    """Pairs of our modules each of which imports the other, directly or through others."""
    result = subprocess.run(
        [sys.executable, "-c", CIRCLES_SCRIPT],
        cwd=project,
        env={"PYTHONPATH": str(project)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return result.stdout.splitlines()


def test_no_module_imports_itself_back() -> None:
    assert import_circles(ROOT) == []


def test_a_circle_through_a_type_checking_import_is_found(tmp_path: Path) -> None:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    with (tmp_path / "gateway/swarm/push_step.py").open("a") as source:
        source.write("\n\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n")
        source.write("    import gateway.swarm.chain_session\n")
    assert "gateway.swarm.chain_session <-> gateway.swarm.push_step" in import_circles(tmp_path)
