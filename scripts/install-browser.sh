#!/usr/bin/env bash
# Installs Debian's chromium, which the page test of tests/integration/test_observability.py drives headless
# (the swarm page, GET /; marker `browser`).
# From Debian's apt only, as root (CI runs as root); a no-op when `chromium` is already on PATH. Without it the
# page test skips and says why.
set -euo pipefail

if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install-browser: not root, cannot apt-get install chromium" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
chromium --version
