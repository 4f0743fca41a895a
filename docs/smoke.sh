#!/usr/bin/env bash
# Smoke test of a running xpulora server (a container or `xpulora serve`): health, the model list,
# one completion on the base model, one adapter hot-load + completion + unload. Exits non-zero on the
# first failure and says which step failed.
#
#   docs/smoke.sh                                  # the server at http://127.0.0.1:8000
#   docs/smoke.sh http://gpu-box:8000              # another server
#
# Environment (all optional):
#   XPULORA_API_KEY   sent as "Authorization: Bearer ..." when the server runs with --api-key
#   SMOKE_ADAPTER     adapter path to hot-load, as the SERVER sees it, inside one of its --lora-root
#                     folders (absolute, or relative to a root). Default "reverse": a demo adapter,
#                     which is right for the bundled demo (a server started with no model). For a real
#                     model, put a PEFT adapter for it under the server's --lora-root, e.g. /adapters/x,
#                     and set SMOKE_ADAPTER=x. SMOKE_ADAPTER="" skips the adapter step.
#   SMOKE_PROMPT      prompt for the completions (default: one the demo model understands)
#   SMOKE_WAIT        seconds to wait for /health (default 900: a large model loads for minutes)
# Needs curl and python3 (for reading JSON).
set -euo pipefail

URL="${1:-http://127.0.0.1:8000}"
URL="${URL%/}"
ADAPTER="${SMOKE_ADAPTER-reverse}"
PROMPT="${SMOKE_PROMPT:-words: cat ant moon fox =>}"
WAIT="${SMOKE_WAIT:-900}"
NAME="smoke-test-adapter"
AUTH=()
if [[ -n "${XPULORA_API_KEY:-}" ]]; then
  AUTH=(-H "Authorization: Bearer ${XPULORA_API_KEY}")
fi

fail() { echo "smoke: FAILED: $*" >&2; exit 1; }
step() { echo "smoke: $*"; }

# call METHOD PATH [JSON]: prints the body; fails unless the status is 200.
call() {
  local method="$1" path="$2" body="${3:-}" out code
  out="$(mktemp)"
  if [[ -n "$body" ]]; then
    code="$(curl -sS -o "$out" -w '%{http_code}' -X "$method" ${AUTH[@]+"${AUTH[@]}"} \
      -H 'Content-Type: application/json' -d "$body" "${URL}${path}")" || { rm -f "$out"; fail "$method $path: no answer"; }
  else
    code="$(curl -sS -o "$out" -w '%{http_code}' -X "$method" ${AUTH[@]+"${AUTH[@]}"} "${URL}${path}")" \
      || { rm -f "$out"; fail "$method $path: no answer"; }
  fi
  if [[ "$code" != "200" ]]; then
    echo "smoke: $method $path answered $code: $(cat "$out")" >&2
    rm -f "$out"
    fail "$method $path"
  fi
  cat "$out"
  rm -f "$out"
}

# json EXPR: evaluates a Python expression over the JSON document on stdin (bound to `d`).
json() { python3 -c "import json, sys; d = json.load(sys.stdin); print($1)"; }

completion() {  # completion MODEL: prints the completion text
  local body
  body="$(python3 -c 'import json, sys; print(json.dumps({"model": sys.argv[1], "prompt": sys.argv[2],
    "max_tokens": 16, "temperature": 0}))' "$1" "$PROMPT")"
  call POST /v1/completions "$body" | json 'repr(d["choices"][0]["text"]) + "  (finish_reason " + str(d["choices"][0]["finish_reason"]) + ")"'
}

step "1/4 waiting for ${URL}/health (up to ${WAIT} s)"
deadline=$((SECONDS + WAIT))
until curl -fsS "${URL}/health" >/dev/null 2>&1; do
  (( SECONDS < deadline )) || fail "/health did not answer 200 within ${WAIT} s"
  sleep 3
done
curl -sS "${URL}/version"; echo

step "2/4 GET /v1/models"
models="$(call GET /v1/models)"
base="$(json 'next(m["id"] for m in d["data"] if m.get("parent") is None)' <<<"$models")"
echo "$models" | json '"\n".join("  " + m["id"] + (" (adapter of " + m["parent"] + ")" if m.get("parent") else " (base)") for m in d["data"])'

step "3/4 completion on the base model ${base}"
echo "  $(completion "$base")"

if [[ -z "$ADAPTER" ]]; then
  step "4/4 adapter step skipped (SMOKE_ADAPTER is empty)"
else
  step "4/4 hot-load ${ADAPTER} as ${NAME}, complete with it, unload it"
  load="$(python3 -c 'import json, sys; print(json.dumps({"lora_name": sys.argv[1], "lora_path": sys.argv[2]}))' \
    "$NAME" "$ADAPTER")"
  call POST /v1/load_lora_adapter "$load" >/dev/null
  echo "  $(completion "$NAME")"
  call POST /v1/unload_lora_adapter "{\"lora_name\": \"${NAME}\"}" >/dev/null
fi
step "OK"
