"""GET /v1/models, POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter.

Runtime loads read only from inside a --lora-root: the requested path and the roots are compared as
real paths, so neither `..` nor a symlink inside a root can reach outside it (403). Status codes
follow DESIGN.md §9: 400 invalid (bad name, rank too large, bad files, duplicate), 403 outside every
root, 404 missing path / unknown adapter. `load_inplace: true` (vLLM's) replaces a loaded adapter of
that name (new identity; requests already running finish on the old weights) instead of a 400.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import APIRouter, Request

from engine import EngineClient, resolve_under_roots, validate_name
from server.errors import ApiError
from server.openai_protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

log = logging.getLogger(__name__)
router = APIRouter()
_CREATED = int(time.time())


def _engine(request: Request) -> EngineClient:
    return request.app.state.engine


def list_models(engine: EngineClient) -> dict[str, Any]:
    served = engine.served

    def card(name: str, root: str, parent: str | None) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": _CREATED, "owned_by": "xpulora", "root": root,
                "parent": parent, "max_model_len": served.max_model_len}

    # Every served name is a card (as vLLM lists them); the first is the one adapters name as parent.
    data = [card(name, served.path, None) for name in served.names]
    data += [card(name, path, served.name) for name, path in engine.list_adapters()]
    return {"object": "list", "data": data}


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    return list_models(_engine(request))


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> dict[str, Any]:
    engine = _engine(request)
    cfg = engine.served.lora
    if not cfg.enable_lora:
        raise ApiError(400, "LoRA is not enabled on this server (start it with --enable-lora)")
    name = validate_name(body.lora_name)
    if name in engine.served.names:
        raise ApiError(400, f"adapter name {name!r} is the base model's name")
    path = resolve_under_roots(body.lora_path, cfg.lora_roots)  # 403 outside every root
    # roots: 403 also if the folder moved out since it was resolved
    await engine.load_adapter(name, path, cfg.lora_roots, replace=body.load_inplace)
    log.info("%s adapter %r from %s", "reloaded" if body.load_inplace else "loaded", name, path)
    return {"object": "lora_adapter", "lora_name": name, "lora_path": path, "status": "loaded"}


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> dict[str, Any]:
    engine = _engine(request)
    if not engine.served.lora_enabled:
        raise ApiError(400, "LoRA is not enabled on this server (start it with --enable-lora)")
    await engine.unload_adapter(body.lora_name)  # unknown name: AdapterNotLoadedError -> 404
    log.info("unloaded adapter %r", body.lora_name)
    return {"object": "lora_adapter", "lora_name": body.lora_name, "status": "unloaded"}
