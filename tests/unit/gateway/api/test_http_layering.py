"""The HTTP layer's import contracts (pyproject.toml) bite: serving code that reached for torch or the swarm client,
or a swarm client that reached for OpenAI types or the local model, fails lint-imports."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_architecture import lint_with_violation

HTTP_CONTRACT = "the HTTP layer sees the engine interface only, never torch or the swarm client"
CLIENT_CONTRACT = "the swarm client and the model never see OpenAI types"
SWARM_CONTRACT = "the swarm client never reaches into the local model"


@pytest.mark.parametrize(
    ("module", "forbidden_import", "contract"),
    [
        ("gateway/api/stop.py", "import torch", HTTP_CONTRACT),
        ("gateway/api/serving_common.py", "import gateway.model.engine", HTTP_CONTRACT),
        ("gateway/api/protocol.py", "import gateway.model.sampling", HTTP_CONTRACT),
        ("gateway/swarm/remote_session.py", "import gateway.api.protocol", CLIENT_CONTRACT),
        ("gateway/model/engine.py", "import fastapi", CLIENT_CONTRACT),
        ("gateway/swarm/router.py", "import gateway.model.head", SWARM_CONTRACT),
    ],
)
def test_a_forbidden_import_breaks_an_http_contract(
    tmp_path: Path, module: str, forbidden_import: str, contract: str
) -> None:
    result = lint_with_violation(tmp_path, module, forbidden_import)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert f"{contract} BROKEN" in output
