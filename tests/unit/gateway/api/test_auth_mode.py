"""Authentication is on or off because the operator said so: `--auth`, the listening address, operator keys."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from gateway.api.auth import Authenticator
from gateway.api.serving.common import ServingConfig
from gateway.app import create_app
from gateway.settings import GatewaySettings, is_loopback
from tests.helpers.scripted_engine import ScriptedEngine, completion


def settings(**fields: object) -> GatewaySettings:
    return GatewaySettings(model="m", **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True), ("localhost", True)]
    + [("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("gateway.example", False)],
)
def test_only_loopback_addresses_count_as_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_auth_defaults_to_keys_beyond_loopback_and_to_none_on_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SWARMGATE_AUTH", "SWARMGATE_API_KEYS", "SWARMGATE_ADMIN_KEY", "SWARMGATE_ADMIN_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert settings().auth_mode() == "none"
    assert settings(host="0.0.0.0").auth_mode() == "keys"
    assert settings(host="::").auth_mode() == "keys"
    assert settings(host="0.0.0.0", auth="none").auth_mode() == "none"  # the operator said so
    assert settings(auth="keys").auth_mode() == "keys"
    assert settings(require_api_key=True).auth_mode() == "keys"
    assert settings(admin_key="sk-op").auth_mode() == "keys"  # an operator key on loopback turns it on
    monkeypatch.setenv("SWARMGATE_AUTH", "keys")
    assert settings().auth_mode() == "keys"


def test_operator_keys_come_from_the_flag_the_file_and_the_list(tmp_path: Path) -> None:
    key_file = tmp_path / "admin.key"
    key_file.write_text("sk-from-file\n")
    given = settings(admin_key="sk-flag", admin_key_file=str(key_file), api_keys=["sk-a", "sk-b"])
    assert sorted(given.operator_keys()) == ["sk-a", "sk-b", "sk-flag", "sk-from-file"]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"auth": "none", "admin_key": "sk-op"}, "--auth none contradicts"),
        ({"auth": "none", "require_api_key": True}, "--auth none contradicts"),
        ({"admin_key_file": "/nonexistent/admin.key"}, "cannot read --admin-key-file"),
        ({"auth": "maybe"}, "auth"),
    ],
)
def test_contradictory_or_unreadable_auth_settings_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        settings(**fields)


def test_an_empty_admin_key_file_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.key"
    empty.write_text("\n")
    with pytest.raises(ValidationError, match="is empty"):
        settings(admin_key_file=str(empty))


def client(authenticator: Authenticator) -> httpx.AsyncClient:
    engine = ScriptedEngine()
    app = create_app(engine, ServingConfig(engine.model_name), authenticator=authenticator)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


async def test_with_auth_on_and_no_key_store_only_operator_keys_pass() -> None:
    async with client(Authenticator(["sk-operator"], None, enabled=True)) as http:
        for headers in ({}, {"Authorization": "Bearer sk-unknown"}, {"Authorization": "Basic c2stb3BlcmF0b3I="}):
            refused = await http.get("/v1/sessions", headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        admin = {"Authorization": "Bearer sk-operator"}
        assert (await http.post("/v1/completions", json=completion(max_tokens=2), headers=admin)).status_code == 200
        listed = (await http.get("/v1/sessions", headers=admin)).json()["data"]
        assert len(listed) == 1  # the operator key is an admin: it lists every session


async def test_with_auth_off_every_caller_is_the_admin() -> None:
    async with client(Authenticator([], None, enabled=False)) as http:
        assert (await http.post("/v1/completions", json=completion(max_tokens=2))).status_code == 200
        assert len((await http.get("/v1/sessions")).json()["data"]) == 1
