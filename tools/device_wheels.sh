#!/usr/bin/env bash
# Wheels a device run needs beside the device image's own packages (Python 3.12, x86-64), downloaded here into
# .whl/ (ignored by git; name it in the device call's `carry`). benchmarks/run_h200.sh installs whatever .whl/
# holds. The server (fastapi, uvicorn, pydantic; pyzmq + msgspec between its two processes), llguidance and
# google-re2 (engine imports), fla-core (GDN), and for `run_h200.sh check`'s e2e tests auto-round (the int4 oracle
# and test checkpoints) and openai.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
plat=()
for n in 17 26 27 28 31; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" --platform manylinux2014_x86_64 -d .whl \
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 uvicorn==0.54.0 \
  annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 typing-extensions==4.16.0 anyio==4.16.0 \
  opentelemetry-api==1.45.2 llguidance==1.9.1 google-re2==1.1.20251105 fla-core==0.6.0 \
  auto-round==0.16.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 sniffio==1.3.1 \
  pyzmq==27.3.0 msgspec==0.23.0
ls .whl
