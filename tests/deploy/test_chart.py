"""charts/swarmgate: lint, render for two Kubernetes versions, validate strictly, and check what matters."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import (
    ADMIN_KEY_SECRET,
    CHART,
    CI_VALUES,
    DEFAULT_REQUIRED,
    HELMS,
    KUBE_VERSIONS,
    NAMESPACE,
    Manifest,
    Rendering,
    Tools,
    containers,
    env_of,
    load_manifests,
    pod_specs,
    template_args,
    values_id,
)

VALUE_SETS = ["default", *(values_id(v) for v in CI_VALUES)]
SECRET_ENV = {"SWARMGATE_SWARM_SECRET", "SWARMGATE_API_KEYS", "HF_TOKEN", "REDIS_PASSWORD", "REDISCLI_AUTH"}
SWARMGATE_CONTAINERS = {"identity", "dht", "publish", "node", "gateway"}


def shape(renderings: dict[tuple[str, str, str], Rendering], vid: str) -> Rendering:
    return renderings["helm", vid, KUBE_VERSIONS[-1]]


def values_of(vid: str) -> dict[str, object]:
    merged = yaml.safe_load((CHART / "values.yaml").read_text())
    if vid != "default":
        _merge(merged, yaml.safe_load((CHART / "ci" / f"{vid}-values.yaml").read_text()))
    return merged


def _merge(base: dict[str, object], override: dict[str, object]) -> None:
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)  # type: ignore[arg-type]
        else:
            base[key] = value


def test_every_shape_has_ci_values() -> None:
    assert {values_id(v) for v in CI_VALUES} >= {"embedded-redis", "external-redis", "ingress"}


@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=VALUE_SETS)
def test_lint_strict(tools: Tools, helm: str, values: Path | None) -> None:
    tools.ok(helm, ["lint", "--strict", CHART, *(["-f", values] if values else [])])


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_rendered_manifests_validate_strictly(
    tools: Tools, renderings: dict[tuple[str, str, str], Rendering], kube_version: str
) -> None:
    files = [r.path for (_, _, kv), r in renderings.items() if kv == kube_version]
    result = tools.run("kubernetes-validate", ["--strict", "--quiet", "-k", kube_version, *files])
    # A kind or apiVersion without a schema is only a WARN to kubernetes-validate; here it fails too.
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), (
        result.stdout + result.stderr
    )


@pytest.mark.parametrize("vid", VALUE_SETS)
def test_both_helm_majors_render_the_same_objects(renderings: dict[tuple[str, str, str], Rendering], vid: str) -> None:
    def objects(r: Rendering) -> list[Manifest]:
        return sorted(r.manifests, key=lambda m: (m["kind"], m["metadata"]["name"]))

    assert objects(renderings["helm", vid, "1.33.0"]) == objects(renderings["helm4", vid, "1.33.0"])


@pytest.mark.parametrize("vid", VALUE_SETS)
def test_gateway_probes_health_and_ready(renderings: dict[tuple[str, str, str], Rendering], vid: str) -> None:
    (gateway,) = shape(renderings, vid).one("Deployment", "gateway")["spec"]["template"]["spec"]["containers"]
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert gateway["startupProbe"]["httpGet"]["path"] == "/health"
    assert {"name": "http", "containerPort": values_of(vid)["gateway"]["port"], "protocol": "TCP"} in gateway["ports"]  # type: ignore[index]


@pytest.mark.parametrize("vid", VALUE_SETS)
def test_every_long_running_container_is_probed(renderings: dict[tuple[str, str, str], Rendering], vid: str) -> None:
    for name, spec in pod_specs(shape(renderings, vid)):
        for container in spec["containers"]:
            assert "readinessProbe" in container or "livenessProbe" in container, f"{name}/{container['name']}"


@pytest.mark.parametrize("vid", VALUE_SETS)
def test_pods_are_non_root_read_only_without_capabilities(
    renderings: dict[tuple[str, str, str], Rendering], vid: str
) -> None:
    for name, spec in pod_specs(shape(renderings, vid)):
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] != 0, name
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert spec["automountServiceAccountToken"] is False, name
        for container in containers(spec):
            context = container["securityContext"]
            where = f"{name}/{container['name']}"
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["capabilities"]["drop"] == ["ALL"], where
            assert "add" not in context["capabilities"], where
            # A read-only root needs somewhere to write: hivemind's daemon sockets live in /tmp.
            if container["name"] in SWARMGATE_CONTAINERS - {"publish"}:
                assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}, where


@pytest.mark.parametrize("vid", VALUE_SETS)
def test_secrets_are_referenced_never_inlined(renderings: dict[tuple[str, str, str], Rendering], vid: str) -> None:
    rendering = shape(renderings, vid)
    assert not rendering.kind("Secret"), "the chart must not create Secrets: it references existing ones"
    for name, spec in pod_specs(rendering):
        for container in containers(spec):
            for var_name, var in env_of(container).items():
                if var_name in SECRET_ENV:
                    assert set(var) == {"name", "valueFrom"}, f"{name}/{container['name']}: {var_name} inlined"
                    assert "secretKeyRef" in var["valueFrom"]


def secret_refs(rendering: Rendering) -> dict[str, set[tuple[str, str]]]:
    """env var name → {(secret name, key)} over every container."""
    refs: dict[str, set[tuple[str, str]]] = {}
    for _, spec in pod_specs(rendering):
        for container in containers(spec):
            for var_name, var in env_of(container).items():
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs.setdefault(var_name, set()).add((ref["name"], ref["key"]))
    return refs


def test_secret_names_from_values_reach_the_pods(renderings: dict[tuple[str, str, str], Rendering]) -> None:
    embedded = secret_refs(shape(renderings, "embedded-redis"))
    assert embedded["SWARMGATE_SWARM_SECRET"] == {("swarmgate-swarm", "swarm-secret")}
    assert embedded["SWARMGATE_API_KEYS"] == {("swarmgate-api-keys", "api-keys")}
    assert embedded["REDIS_PASSWORD"] == {("swarmgate-redis", "redis-password")}
    external = secret_refs(shape(renderings, "external-redis"))
    assert external["HF_TOKEN"] == {("hf-token", "token")}
    assert external["SWARMGATE_REDIS_URL"] == {("swarmgate-redis-url", "redis-url")}
    assert secret_refs(shape(renderings, "default")) == {}
    # Every swarm member, the DHT bootstrap included, holds the swarm secret.
    rendering = shape(renderings, "embedded-redis")
    for component in ("dht", "node"):
        spec = rendering.one("StatefulSet", component)["spec"]["template"]["spec"]
        assert "SWARMGATE_SWARM_SECRET" in env_of(spec["containers"][0])


def gateway_env(rendering: Rendering) -> dict[str, Manifest]:
    (gateway,) = rendering.one("Deployment", "gateway")["spec"]["template"]["spec"]["containers"]
    return env_of(gateway)


def test_embedded_redis_url_is_wired_into_the_gateway(renderings: dict[tuple[str, str, str], Rendering]) -> None:
    rendering = shape(renderings, "embedded-redis")
    service = rendering.one("Service", "redis")
    redis = rendering.one("StatefulSet", "redis")
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    assert service["spec"]["ports"][0]["port"] == 6379
    assert service["spec"]["selector"] == redis["spec"]["selector"]["matchLabels"]
    assert container["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
    env = gateway_env(rendering)
    host = f"{service['metadata']['name']}.{NAMESPACE}.svc:6379"
    assert env["SWARMGATE_REDIS_URL"]["value"] == f"redis://:$(REDIS_PASSWORD)@{host}/0"
    # Kubernetes expands $(REDIS_PASSWORD) only from variables defined before it.
    names = list(env)
    assert names.index("REDIS_PASSWORD") < names.index("SWARMGATE_REDIS_URL")
    default = gateway_env(shape(renderings, "default"))
    assert default["SWARMGATE_REDIS_URL"]["value"] == f"redis://{host}/0"


def test_external_redis_replaces_the_embedded_one(renderings: dict[tuple[str, str, str], Rendering]) -> None:
    for vid in ("external-redis", "ingress"):
        rendering = shape(renderings, vid)
        assert not [m for m in rendering.manifests if m["metadata"]["name"].endswith("-redis")]
    env = gateway_env(shape(renderings, "ingress"))
    assert env["SWARMGATE_REDIS_URL"] == {"name": "SWARMGATE_REDIS_URL", "value": "redis://redis.sessions.svc:6379/2"}


@pytest.mark.parametrize("vid", VALUE_SETS)
def test_gateway_replicas_and_pdb_below_them(renderings: dict[tuple[str, str, str], Rendering], vid: str) -> None:
    rendering = shape(renderings, vid)
    deployment = rendering.one("Deployment", "gateway")
    pdb = rendering.one("PodDisruptionBudget", "gateway")
    replicas = deployment["spec"]["replicas"]
    assert replicas >= 2
    assert 1 <= pdb["spec"]["minAvailable"] < replicas
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


@pytest.mark.parametrize("vid", VALUE_SETS)
def test_nodes_choose_spans_with_num_blocks(renderings: dict[tuple[str, str, str], Rendering], vid: str) -> None:
    values = values_of(vid)["nodes"]
    nodes = shape(renderings, vid).one("StatefulSet", "node")
    assert nodes["spec"]["replicas"] == values["count"]  # type: ignore[index]
    (node,) = nodes["spec"]["template"]["spec"]["containers"]
    args = node["args"]
    assert args[:3] == ["swarm_node", "serve", values_of(vid)["model"]["name"]]  # type: ignore[index]
    assert args[args.index("--num-blocks") + 1] == str(values["numBlocks"])  # type: ignore[index]
    assert "--blocks" not in args
    assert args[args.index("--quant") + 1] == values["quant"]  # type: ignore[index]
    if values["cacheTokens"] == 0:  # type: ignore[index]
        assert "--cache-tokens" not in args  # the node sizes its pool from free memory
    else:
        assert args[args.index("--cache-tokens") + 1] == str(values["cacheTokens"])  # type: ignore[index]
    # Each node announces its own pod IP; POD_IP must be defined before the args that use it.
    announce = args[args.index("--announce-maddrs") + 1]
    assert re.fullmatch(r"/ip4/\$\(POD_IP\)/tcp/31337", announce)
    assert env_of(node)["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert args[args.index("--host-maddrs") + 1] == "/ip4/0.0.0.0/tcp/31337"
    grace = nodes["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > int(args[args.index("--drain-timeout") + 1])


def test_nodes_and_gateways_are_scrapable_by_prometheus(
    renderings: dict[tuple[str, str, str], Rendering], tools: Tools
) -> None:
    rendering = shape(renderings, "embedded-redis")
    nodes = rendering.one("StatefulSet", "node")["spec"]["template"]
    (node,) = nodes["spec"]["containers"]
    args = node["args"]
    assert args[args.index("--metrics-port") + 1] == "9100" and args[args.index("--metrics-host") + 1] == "0.0.0.0"
    assert {"name": "metrics", "containerPort": 9100, "protocol": "TCP"} in node["ports"]
    assert nodes["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "9100",
        "prometheus.io/path": "/metrics",
    }
    gateway = rendering.one("Deployment", "gateway")["spec"]["template"]["metadata"]["annotations"]
    assert gateway["prometheus.io/port"] == "8000" and gateway["prometheus.io/path"] == "/metrics"
    swarm = rendering.one("NetworkPolicy", "swarm")["spec"]["ingress"]
    assert swarm[1] == {"ports": [{"port": 9100, "protocol": "TCP"}]}  # from anywhere: a scraper's namespace


def test_gpu_nodes_get_gpu_resources(renderings: dict[tuple[str, str, str], Rendering]) -> None:
    spec = shape(renderings, "external-redis").one("StatefulSet", "node")["spec"]["template"]["spec"]
    (node,) = spec["containers"]
    assert node["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert node["args"][node["args"].index("--device") + 1] == "cuda"
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_ipv6_pod_networks(tools: Tools) -> None:
    rendering = load_rendering(tools, "--set", "swarm.ipFamily=IPv6")
    (node,) = rendering.one("StatefulSet", "node")["spec"]["template"]["spec"]["containers"]
    assert node["args"][node["args"].index("--announce-maddrs") + 1] == "/ip6/$(POD_IP)/tcp/31337"
    assert node["args"][node["args"].index("--host-maddrs") + 1] == "/ip6/::/tcp/31337"


def load_rendering(tools: Tools, *extra: str) -> Rendering:
    text = tools.ok("helm", template_args(None, KUBE_VERSIONS[-1], *extra))
    return Rendering(Path("-"), load_manifests(text))


def members(rendering: Rendering) -> list[Manifest]:
    gateway = rendering.one("Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]
    node = rendering.one("StatefulSet", "node")["spec"]["template"]["spec"]["containers"][0]
    return [gateway, node]


@pytest.mark.parametrize("vid", VALUE_SETS)
def test_dht_bootstrap_identity_is_persistent_and_published(
    renderings: dict[tuple[str, str, str], Rendering], vid: str
) -> None:
    rendering = shape(renderings, vid)
    dht = rendering.one("StatefulSet", "dht")
    spec = dht["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    main, publish = spec["containers"]
    key_file = main["args"][main["args"].index("--identity-path") + 1]
    assert init["command"][:2] == ["swarmgate-identity", key_file]
    identity_dir = str(Path(key_file).parent)
    for container in (init, main):
        assert {"name": "identity", "mountPath": identity_dir} in [
            {k: m[k] for k in ("name", "mountPath")} for m in container["volumeMounts"]
        ]
    existing_secret = values_of(vid)["dht"]["identity"]["existingSecret"]  # type: ignore[index]
    volumes = {v["name"]: v for v in spec["volumes"]}
    if existing_secret:
        # One key per replica in the Secret: each replica takes the one of its own index.
        assert volumes["identity"]["secret"]["secretName"] == existing_secret
        assert Path(key_file).name == "identity-$(POD_INDEX).key"
        assert "volumeClaimTemplates" not in dht["spec"]
    else:
        assert "identity" not in volumes
        (claim,) = dht["spec"]["volumeClaimTemplates"]
        assert claim["metadata"]["name"] == "identity"
        assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    # Each replica announces its own pod's DNS name (through the headless Service) and publishes its full multiaddr.
    headless = next(s for s in rendering.kind("Service") if s["metadata"]["name"] == dht["spec"]["serviceName"])
    domain = f"{headless['metadata']['name']}.{NAMESPACE}.svc"
    announce = f"/dns4/$(POD_NAME).{domain}/tcp/31337"
    assert main["args"][main["args"].index("--announce-maddrs") + 1] == announce
    assert init["command"][init["command"].index("--announce") + 1] == announce
    for container in (init, main):
        env = env_of(container)
        assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert list(env).index("POD_NAME") == 0  # defined before anything that names it
    published = init["command"][init["command"].index("--write-peers") + 1]
    assert publish["command"][-1] == str(Path(published).parent)
    assert publish["readinessProbe"]["httpGet"]["path"] == "/" + Path(published).name
    ports = {p["name"]: p["port"] for p in headless["spec"]["ports"]}
    assert ports["p2p"] == 31337


@pytest.mark.parametrize("vid", VALUE_SETS)
def test_dht_bootstrap_runs_replicas_that_every_member_joins_through(
    renderings: dict[tuple[str, str, str], Rendering], vid: str
) -> None:
    rendering = shape(renderings, vid)
    dht = rendering.one("StatefulSet", "dht")
    replicas = dht["spec"]["replicas"]
    assert replicas == values_of(vid)["dht"]["replicas"] >= 2  # type: ignore[index]
    # Each replica has its own identity: its own PVC (a claim template), or its own key in the Secret.
    assert (
        "volumeClaimTemplates" in dht["spec"]
        or "$(POD_INDEX)" in dht["spec"]["template"]["spec"]["initContainers"][0]["command"][1]
    )
    assert dht["spec"].get("podManagementPolicy", "OrderedReady") == "OrderedReady"
    domain = f"{dht['spec']['serviceName']}.{NAMESPACE}.svc"
    urls = [f"http://{dht['metadata']['name']}-{i}.{domain}:8080/initial-peers.json" for i in range(replicas)]
    for member in members(rendering):  # every node and gateway reads every replica's address
        assert env_of(member)["SWARMGATE_BOOTSTRAP_URL"]["value"].split() == urls
    # The replicas join each other: any that answer at start (never waiting, never themselves).
    main = dht["spec"]["template"]["spec"]["containers"][0]
    env = env_of(main)
    assert env["SWARMGATE_BOOTSTRAP_URL"]["value"].split() == urls
    assert env["SWARMGATE_BOOTSTRAP_OPTIONAL"]["value"] == "1"
    assert env["SWARMGATE_BOOTSTRAP_SKIP"]["value"] == f"$(POD_NAME).{domain}"


def test_ingress_routes_to_the_gateway_service(renderings: dict[tuple[str, str, str], Rendering]) -> None:
    rendering = shape(renderings, "ingress")
    ingress = rendering.one("Ingress", "gateway")
    service = rendering.one("Service", "gateway")
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] == "swarm.example.com"
    backend = rule["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": service["metadata"]["name"], "port": {"name": "http"}}
    assert ingress["spec"]["tls"] == [{"hosts": ["swarm.example.com"], "secretName": "swarm-example-com-tls"}]
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert not shape(renderings, "default").kind("Ingress")


def test_network_policies_guard_redis_and_the_swarm(renderings: dict[tuple[str, str, str], Rendering]) -> None:
    rendering = shape(renderings, "embedded-redis")
    redis = rendering.one("NetworkPolicy", "redis")
    (rule,) = redis["spec"]["ingress"]
    assert rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    swarm = rendering.one("NetworkPolicy", "swarm")
    assert {p["port"] for p in swarm["spec"]["ingress"][0]["ports"]} == {31337, 8080}
    assert not shape(renderings, "default").kind("NetworkPolicy")


def test_no_remote_subchart_and_no_hooks() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert "dependencies" not in chart
    assert not (CHART / "charts").exists()


def test_notes_print_a_curl_line(tools: Tools) -> None:
    # helm 3 wants a cluster even for a client-side dry run; helm 4 renders NOTES.txt without one.
    out = tools.ok("helm4", ["install", "ci", CHART, "--dry-run=client", "--namespace", NAMESPACE, *DEFAULT_REQUIRED])
    notes = out.split("NOTES:", 1)[1]
    assert "curl http://127.0.0.1:8000/v1/chat/completions" in notes
    assert '"model": "SmolLM2-135M-Instruct.Q4_1"' in notes
    assert '-H "Authorization: Bearer $SWARMGATE_API_KEY"' in notes and "get secret swarmgate-admin-key" in notes
    ingress = tools.ok(
        "helm4",
        ["install", "ci", CHART, "--dry-run=client", "-n", NAMESPACE, "-f", CHART / "ci" / "ingress-values.yaml"],
    )
    assert "curl https://swarm.example.com/v1/chat/completions" in ingress.split("NOTES:", 1)[1]


# values.schema.json rejects each of these, so `helm lint` and `helm template` (and install) fail.
BAD_VALUES = {
    "unknown-key": ["--set", "gateway.replicaCount=3"],
    "zero-replicas": ["--set", "gateway.replicas=0"],
    "quant-typo": ["--set", "nodes.quant=fp4"],
    "device-typo": ["--set", "nodes.device=gpu"],
    "num-blocks-zero": ["--set", "nodes.numBlocks=0"],
    "privileged-port": ["--set", "swarm.p2pPort=80"],
    "root-pods": ["--set", "podSecurityContext.runAsNonRoot=false"],
    "privilege-escalation": ["--set", "containerSecurityContext.allowPrivilegeEscalation=true"],
    "keep-capabilities": ["--set-json", 'containerSecurityContext.capabilities={"drop":["NET_RAW"]}'],
    "external-redis-without-url": ["--set", "redis.mode=external"],
    "redis-password-inlined": ["--set", "redis.mode=external,redis.external.url=redis://:hunter2@redis:6379/0"],
    "secret-name-invalid": ["--set", "swarm.secret.existingSecret=Not_A_Name"],
    "empty-model": ["--set", "model.name="],
    "string-for-count": ["--set-string", "nodes.count=two"],
    "auth-typo": ["--set", "gateway.auth=off"],
    "one-dht-replica": ["--set", "dht.replicas=1"],
    "node-probes-off": ["--set", "nodes.metricsPort=0"],
}


@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize("args", list(BAD_VALUES.values()), ids=list(BAD_VALUES))
def test_schema_violations_fail(tools: Tools, helm: str, args: list[str]) -> None:
    rendered = tools.run(helm, template_args(None, KUBE_VERSIONS[-1], *args))
    assert rendered.returncode != 0, f"{helm} template accepted {args}"
    linted = tools.run(helm, ["lint", "--strict", CHART, *args])
    assert linted.returncode != 0, f"{helm} lint accepted {args}"


# What a schema cannot say (one value against another) a template's `fail` says: `helm template` and install fail.
# (`helm lint` only logs a template's `fail` as INFO, by design, so it is not asked here.)
TEMPLATE_FAILS = {
    "pdb-not-below-replicas": (["--set", "gateway.pdb.minAvailable=2"], "must be below gateway.replicas"),
    "single-replica-with-pdb": (["--set", "gateway.replicas=1"], "must be below gateway.replicas"),
    "auth-without-operator-key": (
        ["--set", "gateway.adminKey.existingSecret="],
        "gateway.auth is keys (the default), which needs an operator key",
    ),
}


@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize("case", list(TEMPLATE_FAILS.values()), ids=list(TEMPLATE_FAILS))
def test_template_refuses_inconsistent_values(tools: Tools, helm: str, case: tuple[list[str], str]) -> None:
    args, message = case
    rendered = tools.run(helm, template_args(None, KUBE_VERSIONS[-1], *args))
    assert rendered.returncode != 0 and message in rendered.stderr, rendered.stderr


def test_single_replica_renders_without_pdb(tools: Tools) -> None:
    rendering = load_rendering(tools, "--set", "gateway.replicas=1,gateway.pdb.enabled=false")
    assert not rendering.kind("PodDisruptionBudget")


def test_schema_is_strict_everywhere() -> None:
    """Every object in values.schema.json with fixed properties forbids others, so a misspelt key fails."""
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(node: object, where: str) -> None:
        if isinstance(node, dict):
            if "properties" in node:
                assert node.get("additionalProperties") is False, where
            for key, value in node.items():
                if key not in ("if", "then", "anyOf"):  # conditions select, they don't define objects
                    walk(value, f"{where}/{key}")
        elif isinstance(node, list):
            for index, value in enumerate(node):
                walk(value, f"{where}/{index}")

    walk(schema, "#")


def gateway_container(rendering: Rendering) -> Manifest:
    (gateway,) = rendering.one("Deployment", "gateway")["spec"]["template"]["spec"]["containers"]
    return gateway


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


@pytest.mark.parametrize("vid", VALUE_SETS)
def test_gateways_authenticate_with_an_operator_key_file_by_default(
    renderings: dict[tuple[str, str, str], Rendering], vid: str
) -> None:
    rendering = shape(renderings, vid)
    gateway = gateway_container(rendering)
    assert flag(gateway["args"], "--auth") == "keys"
    key_file = flag(gateway["args"], "--admin-key-file")
    assert key_file is not None
    mount = next(m for m in gateway["volumeMounts"] if key_file.startswith(m["mountPath"] + "/"))
    assert mount["readOnly"] is True
    spec = rendering.one("Deployment", "gateway")["spec"]["template"]["spec"]
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == ADMIN_KEY_SECRET
    assert volume["secret"]["items"] == [{"key": "admin-key", "path": Path(key_file).name}]


def test_an_open_gateway_needs_auth_none_said_explicitly(tools: Tools) -> None:
    open_gateway = gateway_container(
        load_rendering(tools, "--set", "gateway.auth=none,gateway.adminKey.existingSecret=")
    )
    assert flag(open_gateway["args"], "--auth") == "none"
    assert flag(open_gateway["args"], "--admin-key-file") is None
    assert "SWARMGATE_API_KEYS" not in env_of(open_gateway)  # --auth none with keys would refuse to start
    with_list = gateway_container(
        load_rendering(tools, "--set", "gateway.adminKey.existingSecret=,gateway.apiKeys.existingSecret=keys")
    )
    assert flag(with_list["args"], "--auth") == "keys" and "SWARMGATE_API_KEYS" in env_of(with_list)


@pytest.mark.parametrize("vid", VALUE_SETS)
def test_gateways_get_replicas_and_their_own_replica_id(
    renderings: dict[tuple[str, str, str], Rendering], vid: str
) -> None:
    rendering = shape(renderings, vid)
    gateway = gateway_container(rendering)
    replicas = rendering.one("Deployment", "gateway")["spec"]["replicas"]
    assert flag(gateway["args"], "--replicas") == str(replicas) == str(values_of(vid)["gateway"]["replicas"])  # type: ignore[index]
    assert flag(gateway["args"], "--replica-id") == "$(POD_NAME)"
    assert list(env_of(gateway))[0] == "POD_NAME"


def test_embedded_redis_appends_to_a_persistent_volume_by_default(
    renderings: dict[tuple[str, str, str], Rendering], tools: Tools
) -> None:
    for vid in ("default", "embedded-redis"):
        redis = shape(renderings, vid).one("StatefulSet", "redis")
        (container,) = redis["spec"]["template"]["spec"]["containers"]
        args = container["args"]
        assert flag(args, "--appendonly") == "yes" and flag(args, "--appendfsync") == "everysec"
        data_dir = flag(args, "--dir")
        (claim,) = redis["spec"]["volumeClaimTemplates"]
        assert {"name": claim["metadata"]["name"], "mountPath": data_dir} in container["volumeMounts"]
        assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
        assert not [v for v in redis["spec"]["template"]["spec"]["volumes"] if v["name"] == claim["metadata"]["name"]]
    ephemeral = load_rendering(tools, "--set", "redis.embedded.persistence.enabled=false").one("StatefulSet", "redis")
    assert "volumeClaimTemplates" not in ephemeral["spec"]
    assert flag(ephemeral["spec"]["template"]["spec"]["containers"][0]["args"], "--appendonly") == "no"


@pytest.mark.parametrize("vid", VALUE_SETS)
def test_probes_tell_the_truth(renderings: dict[tuple[str, str, str], Rendering], vid: str) -> None:
    rendering = shape(renderings, vid)
    # Gateways: /ready is "this process can answer"; a swarm gap never takes them out of the Service.
    gateway = gateway_container(rendering)
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert "swarm=complete" not in gateway["readinessProbe"]["httpGet"]["path"]
    # Nodes: HTTP probes on the metrics port, ready only once the span is loaded and announced.
    (node,) = rendering.one("StatefulSet", "node")["spec"]["template"]["spec"]["containers"]
    port = values_of(vid)["nodes"]["metricsPort"]  # type: ignore[index]
    assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in node["ports"]
    assert flag(node["args"], "--metrics-port") == str(port)
    assert node["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "metrics"}
    assert node["livenessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert node["startupProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
