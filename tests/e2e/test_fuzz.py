"""Hostile input from the API's own OpenAPI document: schemathesis generates requests for every operation
(valid and invalid bodies, wrong methods, missing auth) against the CPU demo server in a subprocess, with
a bounded, derandomized example count. No 5xx, every answer as documented (status code, content type,
JSON error shape), auth enforced, and afterwards the server is healthy, still serves correctly and its log
holds no traceback. Also the default 1 MiB body limit."""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tools.loadgen import DEMO
from tools.serverlib import API_KEY, ServerProcess

# Per operation (8 operations). Derandomized, so `make test` sends the same cases every run; a longer random
# hunt: XPULORA_FUZZ_EXAMPLES=2000 pytest tests/e2e/test_fuzz.py (docs/RELIABILITY.md).
EXAMPLES = int(os.environ.get("XPULORA_FUZZ_EXAMPLES", "40"))
HUNT = "XPULORA_FUZZ_EXAMPLES" in os.environ
# Not checked: positive_data_acceptance. Some schema-valid bodies are refused by design with a 400 that the
# schema cannot express (max_tokens beyond max_model_len, token ids beyond the vocabulary, a prompt that is
# too long in tokens, the neutral-only values of fields OpenAI defines but this server does not implement).
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection, ignored_auth]


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory) -> ServerProcess:
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    # A short context keeps every generated request cheap; default body limit (1 MiB).
    srv = ServerProcess(str(DEMO / "model"), ["--max-model-len", "64", "--max-num-seqs", "16"], log)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _document() -> dict:
    """The OpenAPI document of the app the server runs (built here: no engine is needed for it), with the
    API key on, as the server below has it. (schemathesis' lazy from_fixture loader fails on pytest 9.)"""
    from engine import EngineConfig, ModelConfig
    from server.app import create_app

    return create_app(EngineConfig(ModelConfig(str(DEMO / "model"))), api_key=API_KEY).openapi()


schema = schemathesis.openapi.from_dict(_document())
SERVED = ("model", "reverse", "upper", "sort")  # the demo's base model and adapters


@schema.hook
def map_body(_ctx: schemathesis.HookContext, body: object) -> object:
    """Half the generated bodies name a served model, so that they get past the model lookup (a random
    name is a 404) into tokenization, the engine and the response writers."""
    if isinstance(body, dict) and isinstance(body.get("model"), str) and len(body["model"]) % 2 == 0:
        return {**body, "model": SERVED[len(body["model"]) // 2 % len(SERVED)]}
    return body


def test_the_document_is_the_servers(fuzz_server: ServerProcess) -> None:
    import httpx

    assert httpx.get(fuzz_server.url + "/openapi.json", timeout=30).json() == _document()


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=not HUNT, database=None,
          suppress_health_check=list(HealthCheck))
def test_api_from_its_openapi_schema(case: schemathesis.Case, fuzz_server: ServerProcess) -> None:
    case.call_and_validate(base_url=fuzz_server.url, headers=fuzz_server.headers, checks=CHECKS, timeout=60)


def test_the_server_survived_the_fuzzing(fuzz_server: ServerProcess) -> None:
    import httpx

    assert fuzz_server.proc.poll() is None
    with httpx.Client(base_url=fuzz_server.url, headers=fuzz_server.headers, timeout=30) as http:
        assert http.get("/health").status_code == 200
        for model, text in (("reverse", " fox moon ant cat"), ("sort", " ant cat fox moon")):
            body = {"model": model, "prompt": "words: cat ant moon fox =>", "max_tokens": 8, "temperature": 0}
            r = http.post("/v1/completions", json=body)
            if r.status_code == 404:  # the fuzzer may have unloaded it: load it back from the demo root, ask again
                assert http.post("/v1/load_lora_adapter", json={"lora_name": model, "lora_path": model}
                                 ).status_code == 200
                r = http.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == text, r.text
    log = fuzz_server.log_tail(10**8)
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]


def test_default_body_limit_is_1_mib(fuzz_server: ServerProcess) -> None:
    import httpx

    def body(n: int) -> bytes:
        head, tail = b'{"model": "model", "prompt": "', b'"}'
        return head + b"a" * (n - len(head) - len(tail)) + tail

    with httpx.Client(base_url=fuzz_server.url, headers={**fuzz_server.headers, "Content-Type": "application/json"},
                      timeout=60) as http:
        r = http.post("/v1/completions", content=body((1 << 20) + 1))
        assert r.status_code == 413 and r.json()["error"]["message"].endswith("limit of 1048576 bytes")
        r = http.post("/v1/completions", content=body(1 << 20))  # at the limit: read, then too long in tokens
        assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"], r.text
