# xpulora: many LoRA adapters on one int4 AutoRound Qwen model, behind an OpenAI-compatible API.
#
#   docker build -t xpulora:xpu .                          # Intel GPUs (default)
#   docker build -t xpulora:cpu --build-arg DEVICE=cpu .   # CPU only (smaller; no GPU driver)
#
# Behind a proxy or without Docker Hub: --build-arg BASE_IMAGE=<your mirror's Ubuntu or Debian image>,
# --build-arg TORCH_INDEX_URL=<your PyTorch mirror>, --build-arg PIP_INDEX_URL=... / PIP_FIND_LINKS=... (pip
# reads them), and the proxy's CA bundle as a BuildKit secret: --secret id=ca,src=/path/to/ca-bundle.crt.
# `make docker-test` (tools/docker_test.sh) builds and runs the CPU image that way; docs/docker.md has its result.

ARG DEVICE=xpu
# A dated tag, not a moving one; any Debian-family image with python3 >= 3.11 in its archive works.
ARG BASE_IMAGE=ubuntu:noble-20251001

# ---- runtime: Python, and for DEVICE=xpu Intel's GPU user-mode driver ------------------------------------
# The driver packages are pinned: the exact releases of Intel's compute runtime (Level Zero GPU driver and
# OpenCL ICD), its graphics compiler (IGC) and memory manager (gmmlib), and the Level Zero loader, as .debs for
# Ubuntu 24.04 from their GitHub releases (what the compute-runtime release notes list together). The kernel
# driver (xe or i915) and the firmware are the HOST's; the container needs only these and /dev/dri. The oneAPI
# runtime (SYCL, oneDNN, oneCCL) comes with the torch XPU wheels.
FROM ${BASE_IMAGE} AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG DEVICE
ARG INTEL_COMPUTE_RUNTIME=25.44.36015.5
ARG INTEL_IGC=2.22.2
ARG INTEL_IGC_BUILD=20121
ARG INTEL_GMMLIB=22.8.2
ARG LEVEL_ZERO=1.24.2
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LANG=C.UTF-8
# hadolint ignore=DL3008 # python3, curl and the OpenCL loader from the base's archive: its security updates are wanted
RUN --mount=type=secret,id=ca \
    apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && if [ "${DEVICE}" = "xpu" ]; then \
        apt-get install -y --no-install-recommends curl ocl-icd-libopencl1 \
     && cr="https://github.com/intel/compute-runtime/releases/download/${INTEL_COMPUTE_RUNTIME}" \
     && igc="https://github.com/intel/intel-graphics-compiler/releases/download/v${INTEL_IGC}" \
     && mkdir /tmp/intel \
     && ca=/etc/ssl/certs/ca-certificates.crt && if [ -s /run/secrets/ca ]; then ca=/run/secrets/ca; fi \
     && for url in "${cr}/libze-intel-gpu1_${INTEL_COMPUTE_RUNTIME}-0_amd64.deb" \
                   "${cr}/intel-opencl-icd_${INTEL_COMPUTE_RUNTIME}-0_amd64.deb" \
                   "${cr}/libigdgmm12_${INTEL_GMMLIB}_amd64.deb" \
                   "${igc}/intel-igc-core-2_${INTEL_IGC}+${INTEL_IGC_BUILD}_amd64.deb" \
                   "${igc}/intel-igc-opencl-2_${INTEL_IGC}+${INTEL_IGC_BUILD}_amd64.deb" \
                   "https://github.com/oneapi-src/level-zero/releases/download/v${LEVEL_ZERO}/level-zero_${LEVEL_ZERO}+u24.04_amd64.deb"; do \
            echo "fetching ${url}"; \
            curl -fsSL --retry 3 --connect-timeout 20 --cacert "${ca}" -o "/tmp/intel/${url##*/}" "${url}" || exit 1; \
        done \
     && apt-get install -y --no-install-recommends /tmp/intel/*.deb \
     && apt-get purge -y --auto-remove curl \
     && rm -rf /tmp/intel; \
    fi \
 && rm -rf /var/lib/apt/lists/*

# ---- deps: a virtualenv with torch and the project's dependencies (no project code: a code edit keeps it) ---
FROM runtime AS deps
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG DEVICE
# torch from PyTorch's own index for the device: /whl/xpu (brings pytorch-triton-xpu and the oneAPI runtime
# wheels) or /whl/cpu (a plain `pip install torch` from PyPI would fetch a multi-GB CUDA build).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${DEVICE}
ARG TORCH_VERSION=2.13.0
# Read by pip itself when given: a mirror of PyPI, a folder or URL of wheels (docker-test serves its local torch).
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
# Extra packages for the XPU image: fla-core (Triton kernels for the Qwen3.5/3.6 Gated DeltaNet layers).
ARG XPU_EXTRA_PACKAGES="fla-core==0.6.0"
# Optional extras of the project, e.g. --build-arg EXTRAS=quantize to add `xpulora quantize` (auto-round).
ARG EXTRAS=""
ENV PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv
RUN --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY pyproject.toml deploy/docker/requirements.py /tmp/xpulora/
# NVIDIA's `triton` must NOT be in the XPU image: it installs the same `triton` Python package as
# pytorch-triton-xpu and shadows it, so every Triton kernel would fail on the Intel GPU. If a dependency pulls
# it in, it is removed and pytorch-triton-xpu (the version torch pins) reinstalled over the files it
# overwrote; the build fails if it is still there.
RUN --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    extras="${EXTRAS}"; pkgs=""; \
    if [ "${DEVICE}" = "xpu" ]; then extras="xpu${extras:+,${extras}}"; pkgs="${XPU_EXTRA_PACKAGES}"; fi; \
    python /tmp/xpulora/requirements.py /tmp/xpulora/pyproject.toml "${extras}" >/tmp/xpulora/requirements.txt \
 && pip install --no-cache-dir -r /tmp/xpulora/requirements.txt ${pkgs} \
 && if [ "${DEVICE}" = "xpu" ] && pip show triton >/dev/null 2>&1; then \
        ptx="$(pip show pytorch-triton-xpu | sed -n 's/^Version: //p')"; \
        pip uninstall -y triton; \
        pip install --no-cache-dir --force-reinstall --no-deps --index-url "${TORCH_INDEX_URL}" "pytorch-triton-xpu==${ptx}"; \
    fi \
 && if [ "${DEVICE}" = "xpu" ]; then ! pip show triton >/dev/null 2>&1 && pip show pytorch-triton-xpu >/dev/null; fi \
 && rm -rf /tmp/xpulora

# ---- build: the project's wheel ---------------------------------------------------------------------------
FROM deps AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kernels ./kernels
COPY server ./server
RUN pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels . \
 && rm -rf build ./*.egg-info

# ---- final image --------------------------------------------------------------------------------------------
FROM runtime AS final
ARG DEVICE
LABEL org.opencontainers.image.title="xpulora" \
      io.xpulora.device="${DEVICE}" \
      org.opencontainers.image.description="Many LoRA adapters on one int4 AutoRound Qwen model (Intel GPU first)" \
      org.opencontainers.image.licenses="Apache-2.0"
# The server runs as uid 10001. Opening /dev/dri/renderD* needs the HOST's group id of that node, which no
# image can know: `docker run --group-add "$(stat -c %g /dev/dri/renderD128)"` (docs/docker.md).
# ~/.cache/xpulora keeps the tuned int4 dispatch's tables, the compiled CUDA C module and (TRITON_CACHE_DIR)
# Triton's compiled kernels (docs/kernels.md): a volume there (`-v xpulora-cache:/home/xpulora/.cache/xpulora`)
# spares later starts the timing and the JIT; it exists here so that a new named volume takes its owner.
RUN useradd --create-home --uid 10001 --user-group --shell /usr/sbin/nologin xpulora \
 && mkdir -p /models /adapters /home/xpulora/.cache/xpulora \
 && chown xpulora:xpulora /models /adapters /home/xpulora/.cache /home/xpulora/.cache/xpulora
COPY --from=deps /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    HF_HOME=/home/xpulora/.cache/huggingface \
    TRITON_CACHE_DIR=/home/xpulora/.cache/xpulora/triton \
    XPULORA_HOST=0.0.0.0 \
    XPULORA_DEMO_DIR=/opt/xpulora/demo
# A regular install of the wheel (no source tree behind it), then an import check beside the driver libraries.
RUN --mount=type=bind,from=build,source=/wheels,target=/tmp/wheels \
    pip install --no-cache-dir --no-deps --no-index /tmp/wheels/xpulora-*.whl \
 && python -c "import torch, engine, server.cli; print('torch', torch.__version__)"
WORKDIR /opt/xpulora
COPY demo/model ./demo/model
COPY demo/adapters ./demo/adapters
COPY configs ./configs
COPY docs/smoke.sh ./docs/smoke.sh
COPY deploy/docker/healthcheck.py ./healthcheck.py
# By uid (hadolint DL3066).
USER 10001
VOLUME ["/models", "/adapters"]
EXPOSE 8000
# GET /health on the container's own non-loopback address and on the port the server was started with (read
# from its command line): a server that listens on the loopback only is unhealthy. A large model loads for
# minutes: the start period covers that.
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
    CMD ["python", "/opt/xpulora/healthcheck.py"]
# XPULORA_HOST=0.0.0.0 is the default of --host, so flags after the image name (`docker run IMAGE --port 9000
# ...`) keep the server reachable; no flags at all serve the bundled demo on 0.0.0.0:8000.
ENTRYPOINT ["xpulora", "serve"]
CMD []
