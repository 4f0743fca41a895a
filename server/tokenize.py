"""POST /tokenize and POST /detokenize in vLLM's shapes.

/tokenize takes {model?, prompt, add_special_tokens (true)} or {model?, messages, add_generation_prompt,
continue_final_message, add_special_tokens (false), chat_template_kwargs} (the chat template renders the
messages exactly as /v1/chat/completions does) and answers {count, max_model_len, tokens, token_strs}
(token_strs only when return_token_strs is true). /detokenize takes {model?, tokens} and answers
{prompt}. A `model` must be a served base name or a loaded adapter (they share the tokenizer); ids
outside the vocabulary are a 400.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from server.errors import ApiError
from server.openai_protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeRequest
from server.serving import Serving

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    serving: Serving = request.app.state.serving
    if body.model is not None:
        serving.check_model(body.model)
    if isinstance(body, TokenizeChatRequest):
        ids = await serving.chat_prompt_ids(body)
    else:
        prompt, special = body.prompt, body.add_special_tokens
        tok = serving.enc_tok
        ids = await serving.on_tokenizer_thread(lambda: list(tok.encode(prompt, add_special_tokens=special)))
    strs = serving.tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    serving: Serving = request.app.state.serving
    if body.model is not None:
        serving.check_model(body.model)
    vocab = serving.engine.served.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {vocab})")
    ids = body.tokens
    return {"prompt": await serving.on_tokenizer_thread(lambda: serving.enc_tok.decode(ids))}
