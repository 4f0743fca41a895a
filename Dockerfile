# xpulora: many LoRA adapters on one int4 AutoRound Qwen model, behind an OpenAI-compatible API.
#
#   docker build -t xpulora:xpu .                          # Intel GPUs (default)
#   docker build -t xpulora:cpu --build-arg DEVICE=cpu .   # CPU only (smaller; no GPU driver)
#
# Run lines for one and two Intel GPUs are in README.md and docs/docker.md. This file passes hadolint
# in `make test`, but the project's own tests have NOT built or run the image (no Docker engine and no
# Intel GPU were available to them): docs/docker.md says how to check it yourself (docs/smoke.sh).

ARG DEVICE=xpu
ARG UBUNTU_VERSION=24.04

# ---- base: Ubuntu 24.04 with its Python 3.12 -----------------------------------------------------------
FROM ubuntu:${UBUNTU_VERSION} AS base
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LANG=C.UTF-8
# Unpinned apt packages on purpose: the distribution's current security updates of these are wanted.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# ---- runtime-xpu: Intel GPU user-mode driver ------------------------------------------------------------
# What Intel documents for client and Arc Pro GPUs (Arc B580, Arc Pro B60/B70, ...) on Ubuntu 24.04
# (dgpu-docs.intel.com, "Installing Client GPUs"): the kobuk-team/intel-graphics PPA, then the compute
# packages. libze1 is the Level Zero loader, libze-intel-gpu1 the Level Zero GPU driver (what torch.xpu
# and oneCCL use), intel-opencl-icd the OpenCL driver, intel-metrics-discovery / intel-gsc what the
# driver stack expects beside them, clinfo a check tool. The kernel driver (i915 or xe) and the
# firmware are the HOST's; the container only needs these user-mode parts and /dev/dri.
# The oneAPI runtime (SYCL, oneDNN, oneCCL) comes with the torch XPU wheels, not from apt.
FROM base AS runtime-xpu
# PPA package versions move with every driver release; pinning them would break the build.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends software-properties-common gpg-agent \
 && add-apt-repository -y ppa:kobuk-team/intel-graphics \
 && apt-get update \
 && apt-get install -y --no-install-recommends \
        libze1 libze-intel-gpu1 intel-opencl-icd intel-metrics-discovery intel-gsc clinfo \
 && apt-get purge -y --auto-remove software-properties-common gpg-agent \
 && rm -rf /var/lib/apt/lists/*

# ---- runtime-cpu: nothing to add -------------------------------------------------------------------------
FROM base AS runtime-cpu

# ---- build: a virtualenv with torch for DEVICE and the project --------------------------------------------
# On top of the runtime stage, so that the import check at its end runs beside the same driver libraries
# as the final image.
# hadolint ignore=DL3006
FROM runtime-${DEVICE} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG DEVICE
# torch from PyTorch's own index for the device: /whl/xpu (brings pytorch-triton-xpu and the oneAPI
# runtime wheels) or /whl/cpu (a plain `pip install torch` would fetch a multi-GB CUDA build).
ARG TORCH_VERSION=2.13.0
# Extra packages for the XPU image: fla-core (Triton kernels for the Qwen3.5/3.6 Gated DeltaNet layers).
ARG XPU_EXTRA_PACKAGES="fla-core>=0.6"
# Optional extras of the project, e.g. --build-arg EXTRAS=quantize to add `xpulora quantize` (auto-round).
ARG EXTRAS=""
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir --index-url "https://download.pytorch.org/whl/${DEVICE}" "torch==${TORCH_VERSION}"
WORKDIR /opt/xpulora
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kernels ./kernels
COPY server ./server
COPY demo ./demo
COPY configs ./configs
COPY docs/smoke.sh ./docs/smoke.sh
# Editable install: the package stays in /opt/xpulora (the same path in the final stage), which is where
# `xpulora serve` with no model finds the bundled demo model and adapters.
# NVIDIA's `triton` must NOT be in the XPU image: it installs the same `triton` Python package as
# pytorch-triton-xpu and shadows it, so every Triton kernel would fail on the Intel GPU. If any
# dependency pulls it in, it is removed and pytorch-triton-xpu (the version torch pins) reinstalled over
# the files it overwrote; the last line fails the build if it is still there.
# The project's own dependencies are version ranges in pyproject.toml, not pins (DL3013).
# hadolint ignore=DL3013
RUN extras="${EXTRAS}"; pkgs=""; \
    if [ "${DEVICE}" = "xpu" ]; then extras="xpu${extras:+,${extras}}"; pkgs="${XPU_EXTRA_PACKAGES}"; fi; \
    pip install --no-cache-dir -e ".${extras:+[${extras}]}" ${pkgs} \
 && if [ "${DEVICE}" = "xpu" ] && pip show triton >/dev/null 2>&1; then \
        ptx="$(pip show pytorch-triton-xpu | sed -n 's/^Version: //p')"; \
        pip uninstall -y triton; \
        pip install --no-cache-dir --force-reinstall --no-deps \
            --index-url "https://download.pytorch.org/whl/xpu" "pytorch-triton-xpu==${ptx}"; \
    fi \
 && if [ "${DEVICE}" = "xpu" ]; then ! pip show triton >/dev/null 2>&1 && pip show pytorch-triton-xpu >/dev/null; fi \
 && python -c "import torch, engine, server.cli; print('torch', torch.__version__)"

# ---- final image --------------------------------------------------------------------------------------
# hadolint ignore=DL3006
FROM runtime-${DEVICE} AS final
ARG DEVICE
LABEL org.opencontainers.image.title="xpulora" \
      io.xpulora.device="${DEVICE}" \
      org.opencontainers.image.description="Many LoRA adapters on one int4 AutoRound Qwen model (Intel GPU first)" \
      org.opencontainers.image.licenses="Apache-2.0"
# The GPU device nodes (/dev/dri/renderD*) belong to the `render` group (and `video` on older
# systems); the user must be in them. Ubuntu's base image has `video` but not always `render`.
# The host's render group id may differ from the image's: `docker run --group-add render` adds the
# image's group; when /dev/dri/renderD* on the host has another gid, pass it instead:
# --group-add "$(stat -c %g /dev/dri/renderD128)".
RUN (getent group render >/dev/null || groupadd --system render) \
 && (getent group video >/dev/null || groupadd --system video) \
 && useradd --create-home --uid 10001 --user-group --groups render,video --shell /usr/sbin/nologin xpulora \
 && mkdir -p /models /adapters \
 && chown xpulora:xpulora /models /adapters
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/xpulora /opt/xpulora
ENV PATH=/opt/venv/bin:$PATH \
    HF_HOME=/home/xpulora/.cache/huggingface
WORKDIR /opt/xpulora
# By uid (hadolint DL3066); Docker still applies the user's groups (render, video) from /etc/group.
USER 10001
VOLUME ["/models", "/adapters"]
EXPOSE 8000
# /health answers 200 while the engine's step loop runs (503 after it failed). A large model takes
# minutes to load: the start period covers that. Another port: set XPULORA_HEALTH_URL.
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ.get('XPULORA_HEALTH_URL', 'http://127.0.0.1:8000/health'), timeout=8)"]
ENTRYPOINT ["xpulora", "serve"]
# Arguments given to `docker run IMAGE ...` REPLACE these: add --host 0.0.0.0 to them yourself,
# otherwise the server listens on the container's loopback only.
CMD ["--host", "0.0.0.0", "--port", "8000"]
