# kvdepot: the KV-cache daemon as a sidecar image.
#
#   docker build -t kvdepot .                                    # kernels for sm_80 .. sm_120 + PTX
#   docker build --build-arg KVDEPOT_KERNEL_ARCHS=90 -t kvdepot .  # one GPU generation, faster
#   docker run --gpus all --ipc=host -v kvdepot-sock:/run/kvdepot kvdepot --l1-bytes 64g
#
# The engine container mounts the same /run/kvdepot volume and runs as the same uid (10001 here;
# the socket is mode 0600). CUDA IPC needs both containers on the same GPU and able to see each
# other's memory: see deploy/kubernetes/README.md.

ARG CUDA_VERSION=13.0.0
ARG UBUNTU=ubuntu24.04

# ---------------------------------------------------------------- build: the wheel, with kernels
FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build
ARG KVDEPOT_KERNEL_ARCHS=80,86,89,90,100,120
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/build \
 && /opt/build/bin/pip install --no-cache-dir build==1.3.0
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in LICENSE README.md ./
COPY kvdepot ./kvdepot
# sdist first, then the wheel from it (what is released is what was built); the kernel library
# goes into the wheel, which is then tagged py3-none-linux_<arch>
RUN KVDEPOT_KERNEL_ARCHS="${KVDEPOT_KERNEL_ARCHS}" /opt/build/bin/python -m build --outdir /dist . \
 && test -n "$(find /dist -name 'kvdepot-*-py3-none-linux_*.whl')"

# ---------------------------------------------------------------- runtime
FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU}
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/kvdepot \
 && /opt/kvdepot/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
COPY --from=build /dist/ /tmp/dist/
RUN /opt/kvdepot/bin/pip install --no-cache-dir /tmp/dist/kvdepot-*.whl \
 && rm -rf /tmp/dist \
 && groupadd --system --gid 10001 kvdepot \
 && useradd --system --uid 10001 --gid kvdepot --no-create-home --shell /usr/sbin/nologin kvdepot \
 && mkdir -p /run/kvdepot \
 && chown kvdepot:kvdepot /run/kvdepot
# the image ships the kernels: never compile at run time (there is no nvcc here anyway)
ENV PATH=/opt/kvdepot/bin:${PATH} \
    KVDEPOT_ENDPOINT=ipc:///run/kvdepot/kvdepot.sock \
    KVDEPOT_METRICS_PORT=9400 \
    KVDEPOT_METRICS_ADDR=0.0.0.0 \
    KVDEPOT_NO_JIT=1 \
    PYTHONUNBUFFERED=1
VOLUME ["/run/kvdepot"]
EXPOSE 9400
USER 10001:10001
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["kvdepot", "ping", "--timeout-s", "3"]
ENTRYPOINT ["kvdepot", "serve"]
