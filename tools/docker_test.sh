#!/usr/bin/env bash
# `make docker-test`: build the CPU image from ./Dockerfile on this machine and use it as a user would.
#
#   1. a Docker daemon: the running one, or one started here (stopped again at the end);
#   2. a base image: DOCKER_TEST_BASE if it exists, else one made with debootstrap (kept, like a pulled base);
#   3. `docker build --build-arg DEVICE=cpu` with the host network and the CA bundle as a build secret; torch
#      comes from DOCKER_TEST_WHEELS (a folder holding the CPU torch wheel, served on the loopback) if there
#      is one, else from PyTorch's CPU index (the Dockerfile's default);
#   4. `docker run -p ... IMAGE` with no arguments: docs/smoke.sh (health, models, completion, hot-load of a
#      demo adapter), then the container's HEALTHCHECK must say `healthy`;
#   5. `docker run ... IMAGE --port 9000 ...` with serve flags and an adapter volume: still on 0.0.0.0,
#      docs/smoke.sh with a hot-load from the mounted /adapters, healthy;
#   6. `docker run ... IMAGE --host 127.0.0.1`: unreachable from outside, so it must turn `unhealthy`.
# Everything it started (containers, the wheel server, the daemon) is stopped and removed on exit, also on
# failure or timeout. The image stays (reruns reuse its layers); `docker rmi` it when done.
#
# Needs root (or a docker group member), docker.io and debootstrap (`apt-get install docker.io debootstrap`),
# curl and python3. Environment (all optional):
#   DOCKER_TEST_TIMEOUT  seconds for the whole run (default 2400)
#   DOCKER_TEST_IMAGE    tag to build (default xpulora:cpu-test)
#   DOCKER_TEST_BASE     base image (default xpulora-base:bookworm, made here if missing)
#   DOCKER_TEST_WHEELS   folder with a CPU torch wheel (default /opt/wheels when it holds one)
#   DOCKER_TEST_WHEEL_PORT  loopback port that serves DOCKER_TEST_WHEELS to the build (default 18765)
#   DOCKER_TEST_CA       CA bundle given to the build (default /etc/ssl/certs/ca-certificates.crt)
#   DOCKER               client binary (default: `docker` if it can use BuildKit, else Debian's /usr/bin/docker)
set -euo pipefail
cd "$(dirname "$0")/.."

LIMIT="${DOCKER_TEST_TIMEOUT:-2400}"
if [[ -z "${XPL_DOCKER_TEST_INNER:-}" ]]; then
  # One deadline for everything; the EXIT trap below still cleans up when it fires.
  XPL_DOCKER_TEST_INNER=1 exec timeout --kill-after=90 "$LIMIT" "$0" "$@"
fi

IMAGE="${DOCKER_TEST_IMAGE:-xpulora:cpu-test}"
BASE="${DOCKER_TEST_BASE:-xpulora-base:bookworm}"
CA="${DOCKER_TEST_CA:-/etc/ssl/certs/ca-certificates.crt}"
WHEELS="${DOCKER_TEST_WHEELS:-/opt/wheels}"
WORK="$(mktemp -d /tmp/xpulora-docker-test.XXXXXX)"
TAG="xpl-dt-$$"
T0=$SECONDS
CONTAINERS=()
DOCKERD_PID=""
WHEEL_PID=""

say() { printf 'docker-test [%4ds]: %s\n' "$((SECONDS - T0))" "$*"; }
die() { say "FAILED: $*"; exit 1; }

if [[ -z "${DOCKER:-}" ]]; then
  DOCKER=docker
  if ! docker buildx version >/dev/null 2>&1 && [[ -x /usr/bin/docker ]]; then
    DOCKER=/usr/bin/docker  # Debian's client has BuildKit built in; a bare static client needs buildx
  fi
fi

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  for c in "${CONTAINERS[@]}"; do
    if [[ $rc -ne 0 ]]; then
      say "logs of $c:"; "$DOCKER" logs --tail 40 "$c" 2>&1 | sed 's/^/    /' || true
    fi
    "$DOCKER" rm -f "$c" >/dev/null 2>&1 || true
  done
  if [[ -n "$WHEEL_PID" ]]; then kill "$WHEEL_PID" 2>/dev/null || true; fi
  if [[ -n "$DOCKERD_PID" ]]; then
    say "stopping the daemon started here (pid $DOCKERD_PID)"
    kill "$DOCKERD_PID" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 1; done
  fi
  rm -rf "$WORK"
  if [[ $rc -eq 0 ]]; then say "PASSED in $((SECONDS - T0)) s"; else say "FAILED (exit $rc) after $((SECONDS - T0)) s"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# -- 1. daemon -------------------------------------------------------------------------------------------------
if "$DOCKER" info >/dev/null 2>&1; then
  say "using the running Docker daemon"
else
  command -v dockerd >/dev/null || die "no Docker daemon runs and dockerd is missing (apt-get install docker.io)"
  say "starting dockerd (log: $WORK/dockerd.log)"
  dockerd >"$WORK/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 60); do "$DOCKER" info >/dev/null 2>&1 && break; sleep 1; done
  "$DOCKER" info >/dev/null 2>&1 || { tail -20 "$WORK/dockerd.log"; die "dockerd did not come up in 60 s"; }
fi

# -- 2. base image ----------------------------------------------------------------------------------------------
if "$DOCKER" image inspect "$BASE" >/dev/null 2>&1; then
  say "base image $BASE is there"
else
  command -v debootstrap >/dev/null || die "base image $BASE is missing and debootstrap is not installed"
  say "making base image $BASE with debootstrap (Debian bookworm, minbase)"
  debootstrap --variant=minbase bookworm "$WORK/rootfs" http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap.log"; die "debootstrap failed"; }
  tar -C "$WORK/rootfs" -c . | "$DOCKER" import - "$BASE" >/dev/null
  rm -rf "$WORK/rootfs"
fi

# -- 3. build ---------------------------------------------------------------------------------------------------
build=(--network host --build-arg DEVICE=cpu --build-arg "BASE_IMAGE=$BASE" -t "$IMAGE")
if [[ -s "$CA" ]]; then build+=(--secret "id=ca,src=$CA"); fi
torch_wheel="$(find "$WHEELS" -maxdepth 1 -name 'torch-*+cpu-*.whl' 2>/dev/null | sort | tail -1)"
if [[ -n "$torch_wheel" ]]; then
  # A fixed port: PIP_FIND_LINKS is part of the layer cache key of every pip step after it.
  port="${DOCKER_TEST_WHEEL_PORT:-18765}"
  python3 -m http.server --bind 127.0.0.1 --directory "$WHEELS" "$port" >"$WORK/wheels.log" 2>&1 &
  WHEEL_PID=$!
  version="$(basename "$torch_wheel" | cut -d- -f2)"
  # The local wheel through --find-links, everything else from PyPI: the wheel's local version (+cpu) sorts
  # above PyPI's CUDA build of the same release, so pip takes it.
  build+=(--build-arg "PIP_FIND_LINKS=http://127.0.0.1:$port/" --build-arg "TORCH_INDEX_URL=https://pypi.org/simple"
          --build-arg "TORCH_VERSION=${version%%+*}")
  for _ in $(seq 20); do curl -fsS "http://127.0.0.1:$port/" >/dev/null 2>&1 && break; sleep 0.5; done
  say "torch from $torch_wheel (served on 127.0.0.1:$port)"
fi
say "building $IMAGE (log: last lines below on failure)"
if ! DOCKER_BUILDKIT=1 "$DOCKER" build --progress plain "${build[@]}" . >"$WORK/build.log" 2>&1; then
  tail -40 "$WORK/build.log"; die "docker build"
fi
# steps cached|run: the build's stage steps (`deps:4/4`, ...) that came from the layer cache, or that ran.
steps() {
  awk -v want="$1" '/^#[0-9]+ \[[a-z]+ [0-9]+\/[0-9]+\]/ {s[$1] = substr($2, 2) ":" substr($3, 1, length($3) - 1)}
    /^#[0-9]+ CACHED/ {c[$1] = 1}
    END {for (k in s) if ((k in c) == (want == "cached")) print s[k]}' "$WORK/build.log" | sort -V | paste -sd' '
}
# After a code or README edit only the project's own steps (build:*, final:3/9 on) should run.
say "build steps cached: $(steps cached)"
say "build steps run: $(steps run)"
say "built $IMAGE: $("$DOCKER" image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1 / 1e6}')"

# -- 4..6. run it ----------------------------------------------------------------------------------------------
# start NAME HOST_PORT CONTAINER_PORT [docker run flags --] [serve flags]: a detached container with a fast
# health check (the image's own interval is 30 s) published on the loopback.
start() {
  local name="$TAG-$1" hp="$2" cp="$3"; shift 3
  local opts=()
  while [[ $# -gt 0 && "$1" != "--" ]]; do opts+=("$1"); shift; done
  [[ "${1:-}" == "--" ]] && shift
  CONTAINERS+=("$name")
  "$DOCKER" run -d --name "$name" -p "127.0.0.1:$hp:$cp" --health-interval 3s --health-timeout 5s \
    --health-start-period 5s --health-retries 3 ${opts[@]+"${opts[@]}"} "$IMAGE" "$@" >/dev/null
}

# wait_health NAME WANT SECONDS
wait_health() {
  local name="$TAG-$1" want="$2" deadline=$((SECONDS + $3)) got=""
  while (( SECONDS < deadline )); do
    got="$("$DOCKER" inspect --format '{{.State.Health.Status}}' "$name")"
    [[ "$got" == "$want" ]] && { say "$name is $got"; return 0; }
    [[ "$("$DOCKER" inspect --format '{{.State.Running}}' "$name")" == "true" ]] || die "$name exited"
    sleep 2
  done
  die "$name is '$got', not '$want', after $3 s"
}

p1="$(free_port)"
say "run 1: docker run -p $p1:8000 $IMAGE  (no arguments: the bundled demo)"
start demo "$p1" 8000
SMOKE_WAIT=300 docs/smoke.sh "http://127.0.0.1:$p1" | sed 's/^/    /' || die "smoke test on run 1"
wait_health demo healthy 60

p2="$(free_port)"
say "run 2: docker run -p $p2:9000 -v demo/adapters:/adapters:ro $IMAGE --port 9000 --max-num-seqs 4 --lora-root /adapters"
start flags "$p2" 9000 -v "$PWD/demo/adapters:/adapters:ro" -- --port 9000 --max-num-seqs 4 --lora-root /adapters
SMOKE_WAIT=300 SMOKE_ADAPTER=/adapters/upper docs/smoke.sh "http://127.0.0.1:$p2" | sed 's/^/    /' \
  || die "smoke test on run 2"
wait_health flags healthy 60

p3="$(free_port)"
say "run 3: docker run $IMAGE --host 127.0.0.1  (loopback only: must be unhealthy and unreachable)"
start loopback "$p3" 8000 -- --host 127.0.0.1
wait_health loopback unhealthy 120
if curl -fsS -m 5 "http://127.0.0.1:$p3/health" >/dev/null 2>&1; then die "run 3 answered from outside"; fi
"$DOCKER" exec "$TAG-loopback" python -c \
  "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=5)" \
  || die "run 3: the server is not up inside the container either, so 'unhealthy' proves nothing"
last_check="$("$DOCKER" inspect --format '{{json .State.Health.Log}}' "$TAG-loopback" \
  | python3 -c 'import json, sys; print(json.load(sys.stdin)[-1]["Output"].strip())')"
say "run 3 serves on the loopback only and is reported unhealthy (last check: $last_check)"
