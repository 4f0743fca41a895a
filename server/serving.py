"""OpenAI completions and chat completions over the EngineClient: request -> one engine request per
(prompt, choice), outputs -> a JSON body or SSE chunks ending with `data: [DONE]`.

Prompts are tokenized here, so the engine always gets token ids: a short completions prompt on the event
loop with its own tokenizer copy, the rest on one dedicated thread with another: a HF fast tokenizer used
from two threads at once can fail with "Already borrowed" (the receiver thread detokenizes with a third
copy), and encoding a 1 MiB prompt takes about half a second, which must not stall the event loop (the
tokenizer releases the GIL). Every engine request is closed (aborted if unfinished) when its HTTP
request ends, whatever the reason: a client disconnect frees KV blocks and the adapter slot at once.
"""

from __future__ import annotations

import asyncio
import copy
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from transformers import PreTrainedTokenizerBase

from engine import (
    EngineClient,
    OverloadedError,
    RequestError,
    RequestOutput,
    RequestStream,
    SamplingParams,
    StructuredSpec,
)
from server.chat_tools import ChatOptions, ChatOutput, plan_chat, reasoning_spec, template_message, think_close_id
from server.choices import Choice, reported_reason, usage
from server.errors import ApiError, error_body, error_response, output_error_status, status_of
from server.logprobs import TokenText
from server.metrics import Metrics, RequestTracker
from server.openai_protocol import ChatCompletionRequest, CompletionRequest, TokenizeChatRequest
from server.reasoning import prompt_reasoning_state
from server.sse import ClientGone, sse_event, until_disconnect
from server.structured_protocol import output_spec

T = TypeVar("T")
INLINE_PROMPT_SIZE = 2048
"""Characters (or token ids) of a request's prompts up to which they are encoded on the event loop."""


class Serving:
    def __init__(self, engine: EngineClient, metrics: Metrics, chat: ChatOptions | None = None) -> None:
        self.engine, self.metrics = engine, metrics
        served = engine.served
        self.chat_opts = chat or ChatOptions()
        vocab = served.tokenizer.get_vocab()
        self.think_close = think_close_id(vocab) if self.chat_opts.reasoning_parser else None
        self.tool_tags = "<tool_call>" in vocab and "</tool_call>" in vocab
        # Grammars compile here, never on the step thread or the event loop (llguidance drops the GIL).
        self._grammar_pool = ThreadPoolExecutor(2, thread_name_prefix="xpulora-grammar")
        self.grammars = served.grammar
        self.tok = copy.deepcopy(served.tokenizer)  # event loop only
        self.enc_tok = copy.deepcopy(served.tokenizer)  # the tokenizer thread only
        self._enc_pool = ThreadPoolExecutor(1, thread_name_prefix="xpulora-tokenize")
        self.tokens = TokenText(self.tok)
        self.base = served.name
        self.base_names = served.names
        self.max_model_len = served.max_model_len
        self.lora_enabled = served.lora_enabled

    def close(self) -> None:
        self._enc_pool.shutdown(wait=False, cancel_futures=True)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    async def on_tokenizer_thread(self, fn: Callable[[], T]) -> T:
        """Run fn on the tokenizer thread, the only one that may use `enc_tok`."""
        return await asyncio.get_running_loop().run_in_executor(self._enc_pool, fn)

    async def compiled(self, spec: StructuredSpec | None) -> StructuredSpec | None:
        """Compile spec into the engine's grammar cache off the event loop (RequestError: 400 if invalid)."""
        if spec is not None:
            await asyncio.get_running_loop().run_in_executor(self._grammar_pool, self.grammars.compile, spec)
        return spec

    # -- endpoints -----------------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        if req.echo and req.logprobs is not None:
            raise ApiError(400, "'echo' with 'logprobs' needs prompt logprobs, which this server does not support")
        prompts = req.prompts()

        def encode(tok: PreTrainedTokenizerBase) -> list[tuple[list[int], str]]:
            out = []
            for prompt in prompts:
                ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
                prefix = (prompt if isinstance(prompt, str) else tok.decode(ids)) if req.echo else ""
                out.append((ids, prefix))
            return out

        try:
            spec = await self.compiled(output_spec(req.response_format, req.structured_outputs))
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        choices: list[Choice] = []
        # A short prompt is encoded here, with the event loop's tokenizer (tens of microseconds: less than the
        # hand-off to the tokenizer thread and back); a long one on the tokenizer thread, as it may take a while.
        size = sum(len(p) for p in prompts)
        encoded = encode(self.tok) if size <= INLINE_PROMPT_SIZE else await self.on_tokenizer_thread(
            lambda: encode(self.enc_tok))
        for pi, (ids, prefix) in enumerate(encoded):
            for j in range(req.n):
                choices.append(Choice(len(choices), pi, ids,
                                       self._params(req, ids, j, req.max_tokens, req.logprobs, spec),
                                       prefix, offset=len(prefix), tokens_as_ids=req.return_tokens_as_token_ids))
        return await self._respond("cmpl", req, raw, choices, chat=False)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        plan = plan_chat(req.tools, req.tool_choice, req.parallel_tool_calls, req.response_format,
                         req.structured_outputs, self.chat_opts, self.tool_tags)
        text, ids = await self._render(req)
        state = prompt_reasoning_state(text) if self.chat_opts.reasoning_parser else None
        spec = await self.compiled(reasoning_spec(plan.spec, state, self.think_close))
        lp = (req.top_logprobs or 0) if req.logprobs else None
        # vLLM's rules: without a generation prompt the reply continues the last message's role, and
        # echo repeats the last message when it has that role.
        last = req.messages[-1]
        role = "assistant" if req.add_generation_prompt else last.role
        echo = last.text() if req.echo and last.role == role else ""
        choices = [Choice(j, 0, ids, self._params(req, ids, j, req.output_limit, lp, spec), echo, role=role,
                           out=ChatOutput(state, plan.parse_tools) if state or plan.parse_tools else None,
                           tokens_as_ids=req.return_tokens_as_token_ids)
                   for j in range(req.n)]
        return await self._respond("chatcmpl", req, raw, choices, chat=True)

    async def chat_prompt_ids(self, req: ChatCompletionRequest | TokenizeChatRequest) -> list[int]:
        return (await self._render(req))[1]

    async def _render(self, req: ChatCompletionRequest | TokenizeChatRequest) -> tuple[str, list[int]]:
        """The messages (and tools) rendered by the tokenizer's chat template with the request's template
        options (chat_template_kwargs are template variables, e.g. Qwen3's enable_thinking): text and ids."""
        if not self.tok.chat_template:
            raise ApiError(400, f"model {self.base!r} has no chat template; use /v1/completions")
        messages = [template_message(m) for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        tok = self.enc_tok

        def encode() -> tuple[str, list[int]]:
            try:
                text = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                               add_generation_prompt=req.add_generation_prompt,
                                               continue_final_message=req.continue_final_message,
                                               **(req.chat_template_kwargs or {}))
            except Exception as e:  # jinja errors from a model-supplied template: the client's input
                raise ApiError(400, f"the chat template failed on these messages: {e}") from e
            return text, tok.encode(text, add_special_tokens=req.add_special_tokens)

        return await self.on_tokenizer_thread(encode)

    def check_model(self, model: str) -> None:
        """404 unless `model` is a served base name or a loaded adapter (no load on first use)."""
        if model not in self.base_names and not self.engine.has_adapter(model):
            raise ApiError(404, f"model {model!r} does not exist (the base model is {self.base!r})")

    def _params(self, req: CompletionRequest | ChatCompletionRequest, ids: list[int], j: int,
                max_tokens: int | None, logprobs: int | None, structured: StructuredSpec | None) -> SamplingParams:
        return SamplingParams(
            # null max_tokens: whatever room the context leaves (>= 1 so a too-long prompt gets its own error)
            max_tokens=max_tokens if max_tokens is not None else max(1, self.max_model_len - len(ids)),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            seed=None if req.seed is None else req.seed + j,  # choice j: seed + j, so n > 1 is reproducible
            stop=req.stop_list, stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
            logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
            min_p=req.min_p or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=req.logit_bias_pairs, min_tokens=req.min_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output, structured=structured)

    # -- running ---------------------------------------------------------------------------------------
    async def _respond(self, kind: str, req: CompletionRequest | ChatCompletionRequest, raw: Request,
                       choices: list[Choice], chat: bool) -> Response:
        if req.model not in self.base_names and not self.lora_enabled:
            raise ApiError(404, f"model {req.model!r} does not exist (the base model is {self.base!r})")
        lora = None if req.model in self.base_names else req.model
        rid = f"{kind}-{uuid.uuid4().hex}"
        trackers = [self.metrics.tracker() for _ in choices]
        streams = await self._start(rid, choices, lora)

        def close() -> None:
            for s, t in zip(streams, trackers):
                s.close()
                t.close()

        if req.stream:
            async def closed() -> None:  # on the event loop (a plain function would go to a worker thread)
                close()

            gen = self._sse(rid, req, choices, streams, trackers, chat)
            return StreamingResponse(gen, media_type="text/event-stream", background=BackgroundTask(closed))
        try:
            await until_disconnect(raw, asyncio.gather(*(
                self._drain(c, s, t) for c, s, t in zip(choices, streams, trackers))))
        except ClientGone:
            return error_response(499, "client disconnected")
        finally:
            close()
        failed = next((c for c in choices if c.finish_reason == "error"), None)
        if failed is not None:
            raise ApiError(output_error_status(failed.error_kind), failed.error or "generation failed")
        if any(c.finish_reason == "abort" for c in choices):  # only shutdown aborts a request it still serves
            raise ApiError(503, "the request was aborted: the server is shutting down")
        body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": req.model, "choices": [self._full_choice(c, chat) for c in choices],
                "usage": usage(choices)}
        return JSONResponse(body)

    async def _start(self, rid: str, choices: list[Choice], lora: str | None) -> list[RequestStream]:
        """Queue every choice at once; if any is refused, close the accepted ones and raise its error."""
        results = await asyncio.gather(*(self.engine.add_request(f"{rid}-{c.index}", c.ids, c.params, lora)
                                         for c in choices), return_exceptions=True)
        streams = [r for r in results if isinstance(r, RequestStream)]
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            for s in streams:
                s.close()
            raise failure
        return streams

    @staticmethod
    async def _drain(c: Choice, stream: RequestStream, tracker: RequestTracker) -> None:
        async for out in stream:
            tracker.observe(out)
            c.apply(out)

    async def _merge(self, choices: list[Choice], streams: list[RequestStream],
                     trackers: list[RequestTracker]) -> AsyncIterator[list[tuple[Choice, RequestOutput]]]:
        """The choices' outputs as they come, in batches: each batch holds everything that was ready (a
        streaming response that fell behind the engine writes a batch at once). One choice (n = 1, the
        common case) reads its stream directly; several are interleaved through a queue."""
        if len(streams) == 1:
            c, stream, tracker = choices[0], streams[0], trackers[0]
            try:
                async for out in stream:
                    batch = [out, *stream.ready()]
                    for o in batch:
                        tracker.observe(o)
                        c.apply(o)
                    yield [(c, o) for o in batch]
            finally:
                stream.close()
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for out in streams[i]:
                    trackers[i].observe(out)
                    choices[i].apply(out)
                    queue.put_nowait((i, out))
            except Exception as e:  # forwarded to the consumer, which raises it
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
        try:
            remaining = len(tasks)
            while remaining:
                got = [await queue.get()]
                while not queue.empty():
                    got.append(queue.get_nowait())
                batch: list[tuple[Choice, RequestOutput]] = []
                for i, item in got:
                    if item is None:
                        remaining -= 1
                    elif isinstance(item, BaseException):
                        if batch:
                            yield batch
                        raise item
                    else:
                        batch.append((choices[i], item))
                if batch:
                    yield batch
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                s.close()

    # -- formatting ------------------------------------------------------------------------------------
    def _full_choice(self, c: Choice, chat: bool) -> dict[str, Any]:
        want = c.params.logprobs is not None
        if chat:
            lp = {"content": self.tokens.chat(c.logprobs, c.tokens_as_ids)} if want else None
            text = c.prefix + c.text
            msg = {"role": c.role, **(c.out.message(text) if c.out is not None else {"content": text})}
            return {"index": c.index, "message": msg, "logprobs": lp,
                    "finish_reason": reported_reason(c, c.finish_reason)}
        lp = self.tokens.completion(c.logprobs, len(c.prefix), c.tokens_as_ids)[0] if want else None
        return {"index": c.index, "text": c.prefix + c.text, "logprobs": lp, "finish_reason": c.finish_reason}

    def _delta(self, c: Choice, out: RequestOutput, chat: bool) -> dict[str, Any] | None:
        """One choice's part of a streamed chunk, or None when there is nothing to send."""
        finish = out.finish_reason if out.finished else None
        want = c.params.logprobs is not None and bool(out.new_logprobs)
        if chat:
            lp = {"content": self.tokens.chat(out.new_logprobs or [], c.tokens_as_ids)} if want else None
            text = out.new_text
            if not c.started:
                text, c.started = c.prefix + text, True
            if c.out is not None:
                delta = c.out.delta(text, out.finished)
            else:
                delta = {"content": text} if text else {}
            if not delta and lp is None and finish is None:
                return None
            return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": reported_reason(c, finish)}
        text = out.new_text
        if not c.started:
            text, c.started = c.prefix + text, True
        clp = None
        if want:
            clp, c.offset = self.tokens.completion(out.new_logprobs or [], c.offset, c.tokens_as_ids)
        if not text and clp is None and finish is None:
            return None
        return {"index": c.index, "text": text, "logprobs": clp, "finish_reason": finish}

    async def _sse(self, rid: str, req: CompletionRequest | ChatCompletionRequest, choices: list[Choice],
                   streams: list[RequestStream], trackers: list[RequestTracker], chat: bool) -> AsyncIterator[bytes]:
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": req.model}
        null_usage = {"usage": None} if req.include_usage else {}

        def chunk(parts: list[dict[str, Any]], **extra: Any) -> bytes:
            return sse_event({**head, "choices": parts, **null_usage, **extra})

        try:
            if chat:  # the role comes first, as OpenAI sends it
                for c in choices:
                    yield chunk([{"index": c.index, "delta": {"role": c.role, "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
            async for batch in self._merge(choices, streams, trackers):
                events: list[bytes] = []
                failed = False
                for c, out in batch:
                    if out.finish_reason == "error":
                        events.append(sse_event(error_body(output_error_status(out.error_kind),
                                                        out.error or "generation failed")))
                        failed = True
                        break
                    part = self._delta(c, out, chat)
                    if part is not None:
                        events.append(chunk([part]))
                if events:
                    yield b"".join(events)  # one write for what was ready
                if failed:
                    break
            else:
                if req.include_usage:
                    yield chunk([], usage=usage(choices))
        except (RequestError, OverloadedError) as e:  # e.g. the engine died mid-stream
            yield sse_event(error_body(status_of(e), str(e)))
        yield b"data: [DONE]\n\n"
