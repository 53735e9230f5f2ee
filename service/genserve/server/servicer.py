"""genserve.v1.TextGenerationService: protobuf ↔ engine, streaming, cancellation, status codes.

Thin by design: validation lives in ``validation``, generation in the engine.  Every way a
call can end maps to one gRPC status with a message a person can act on."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import structlog

from genserve.chat_template import ChatRenderer
from genserve.engine.async_engine import AsyncEngine, EngineUnavailableError
from genserve.engine.grammar_spec import GrammarError
from genserve.engine.outputs import FinalInfo, GenerationRequest, TokenInfo, TokenOutput
from genserve.engine.request import FinishReason
from genserve.model.lora import AdapterError
from genserve.server import best_of, chat
from genserve.server.chat_reply import ChatFeatures, ChoiceReply, ReplyPiece, whole_reply
from genserve.server.fim import FimUnsupportedError, fim_prompts
from genserve.server.grammar_params import GrammarUnsupportedError, attach_grammar
from genserve.server.observe import RequestObserver, bind_call
from genserve.server.param_validation import prompt_inputs, stop_token_id
from genserve.server.validation import (
    Limits,
    UnsupportedError,
    ValidationError,
    validate,
    validate_batch_size,
)
from genserve.tokenizer import Tokenizer
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from genserve.worker.adapters import AdapterNotFoundError

if TYPE_CHECKING:
    from genserve.engine.grammar import GrammarCompiler

log = structlog.get_logger(__name__)

_FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS_TOKEN: pb.FINISH_REASON_EOS_TOKEN,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
}


class _CallFailed(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(slots=True)
class _Collected:
    """A unary result assembled from the token stream."""

    tokens: list[TokenInfo] = field(default_factory=list)
    top_tokens: list[tuple[TokenInfo, ...]] = field(default_factory=list)
    final: FinalInfo | None = None


def _token_pb(t: TokenInfo) -> pb.Token:
    msg = pb.Token(id=t.token_id, text=t.text, special=t.special)
    if t.logprob is not None:
        msg.logprob = t.logprob
    return msg


def _request_id(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id" and isinstance(value, str) and value:
            bind_call(value[:128])
            return value[:128]
    req_id = uuid.uuid4().hex
    bind_call(req_id)  # logs and the call's span carry it
    return req_id


@dataclass(frozen=True, slots=True)
class Serving:
    """What the servicer needs once the model is loaded."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    limits: Limits
    info: pb.InfoResponse
    max_concurrent_requests: int
    chat: ChatRenderer | None = None  # None: Chat answers FAILED_PRECONDITION
    grammars: GrammarCompiler | None = None  # None: --disable-grammar-support
    chat_features: ChatFeatures | None = None  # tool-call / reasoning parsers (#27)


class TextGenerationServicer(pb_grpc.TextGenerationServiceServicer):  # type: ignore[misc]
    """Registered before the model loads (so health probes get NOT_SERVING, not a refused
    connection); every RPC answers UNAVAILABLE until :meth:`attach` is called."""

    def __init__(self, observer: RequestObserver | None = None) -> None:
        self._serving: Serving | None = None
        self._in_flight = 0
        self.observer = observer or RequestObserver()  # metrics, spans, request log lines

    def attach(self, serving: Serving) -> None:
        self._serving = serving

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    def _require(self) -> Serving:
        if self._serving is None:
            raise _CallFailed(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        return self._serving

    # ------------------------------------------------------------------ helpers
    def _admit(self, num_sequences: int) -> None:
        serving = self._require()
        if not serving.engine.is_ready:
            raise _CallFailed(
                grpc.StatusCode.UNAVAILABLE,
                serving.engine.dead_reason or "the server is not serving (shutting down)",
            )
        limit = serving.max_concurrent_requests
        if self._in_flight + num_sequences > limit:
            raise _CallFailed(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"Model is overloaded: {self._in_flight} sequences in flight, limit "
                f"{limit} (--max-concurrent-requests); retry later",
            )

    def _validate(
        self,
        req_id: str,
        text: str,
        params: pb.GenerateParameters,
        prompt_ids: tuple[int, ...] | None = None,
    ) -> GenerationRequest:
        serving = self._require()
        try:
            return self.observer.validate(
                req_id,
                text,
                lambda: validate(
                    req_id, text, params, serving.tokenizer, serving.limits, prompt_ids=prompt_ids
                ),
            )
        except ValidationError as exc:
            raise _CallFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except UnsupportedError as exc:
            raise _CallFailed(grpc.StatusCode.UNIMPLEMENTED, str(exc)) from None

    def _prompts(
        self, texts: Sequence[str], id_lists: Sequence[Sequence[int]], suffix: str | None = None
    ) -> list[tuple[str, tuple[int, ...] | None]]:
        """``inputs`` or ``input_ids`` (never both) as ``(text, ids or None)`` per prompt;
        with a ``suffix``, text prompts become fill-in-the-middle prompts (server/fim.py)."""
        serving = self._require()
        vocab = serving.limits.vocab_size or serving.tokenizer.vocab_size
        try:
            if suffix is not None:
                texts = fim_prompts(serving.tokenizer, texts, bool(id_lists), suffix)
            return prompt_inputs(texts, id_lists, serving.tokenizer, vocab)
        except (ValidationError, FimUnsupportedError) as exc:
            raise _CallFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None

    async def _with_grammar(
        self, req: GenerationRequest, params: pb.GenerateParameters
    ) -> GenerationRequest:
        """Compile the request's grammar (off the event loop, cached) before it is queued."""
        try:
            return await attach_grammar(req, params, self._require().grammars)
        except GrammarError as exc:
            raise _CallFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except GrammarUnsupportedError as exc:
            raise _CallFailed(grpc.StatusCode.UNIMPLEMENTED, str(exc)) from None

    def _failure_for(self, final: FinalInfo) -> _CallFailed | None:
        if final.finish_reason is FinishReason.ERROR:
            if self._require().engine.dead_reason is not None:
                return _CallFailed(grpc.StatusCode.UNAVAILABLE, final.error or "engine failed")
            return _CallFailed(grpc.StatusCode.INTERNAL, final.error or "generation failed")
        if final.finish_reason is FinishReason.ABORTED:
            return _CallFailed(grpc.StatusCode.UNAVAILABLE, final.error or "request aborted")
        return None

    async def _stream(self, req: GenerationRequest) -> AsyncIterator[TokenOutput]:
        try:
            with self.observer.track(req) as record:
                async for out in self._require().engine.generate(req):
                    if out.final is not None:
                        record.finished(out.final)
                        failure = self._failure_for(out.final)
                        if failure is not None:
                            raise failure
                    yield out
        except EngineUnavailableError as exc:
            raise _CallFailed(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        except AdapterNotFoundError as exc:
            raise _CallFailed(grpc.StatusCode.NOT_FOUND, str(exc)) from None
        except AdapterError as exc:
            raise _CallFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None

    async def _collect_all(self, reqs: list[GenerationRequest]) -> list[_Collected]:
        """Generate admitted sequences concurrently (counted in flight meanwhile); raises the
        first _CallFailed.  A TaskGroup cancels the sibling sequences when one fails or the
        call is cancelled, so none keeps generating for a caller that is gone."""
        self._in_flight += len(reqs)
        failure: _CallFailed | None = None
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._collect(r)) for r in reqs]
        except* _CallFailed as failures:
            failure = failures.exceptions[0]  # type: ignore[assignment]
        finally:
            self._in_flight -= len(reqs)
        if failure is not None:
            raise failure
        return [t.result() for t in tasks]

    async def _collect(self, req: GenerationRequest) -> _Collected:
        collected = _Collected()
        async for out in self._stream(req):
            if out.token is not None:
                collected.tokens.append(out.token)
                collected.top_tokens.append(out.top_tokens)
            if out.final is not None:
                collected.final = out.final
        return collected

    def _details(
        self, req: GenerationRequest, collected: _Collected, params: pb.GenerateParameters
    ) -> pb.Details:
        final = collected.final
        assert final is not None
        details = pb.Details(
            finish_reason=_FINISH_REASONS.get(final.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
            generated_tokens=final.num_generated_tokens,
            input_length=final.num_prompt_tokens,
            cached_tokens=final.num_cached_tokens,
            prefill=[_token_pb(t) for t in final.prefill],
            tokens=[self._detail_token(t) for t in collected.tokens],
        )
        if req.seed is not None:
            details.seed = req.seed
        last = collected.tokens[-1].token_id if collected.tokens else None
        if (stop_id := stop_token_id(req, final, last)) is not None:
            details.stop_token_id = stop_id
        if params.HasField("top_n_tokens") and params.top_n_tokens > 0:
            details.top_tokens.extend(
                pb.TopTokens(tokens=[_token_pb(t) for t in top]) for top in collected.top_tokens
            )
            details.prefill_top_tokens.extend(
                pb.TopTokens(tokens=[_token_pb(t) for t in top]) for top in final.prefill_top
            )
        return details

    def _detail_token(self, t: TokenInfo) -> pb.Token:
        """A generated token for Details: a special token that ended generation (EOS) adds
        no text to the reply but is listed with its own text, as TGI lists it (#27)."""
        msg = _token_pb(t)
        if t.special and not t.text:
            msg.text = self._require().tokenizer.token_text(t.token_id)
        return msg

    # ------------------------------------------------------------------ RPCs
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse:
        try:
            limits = self._require().limits
            validate_batch_size(len(request.inputs) or len(request.input_ids), limits)
            prompts = self._prompts(
                request.inputs,
                [t.ids for t in request.input_ids],
                request.suffix if request.HasField("suffix") else None,
            )
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except _CallFailed as exc:
            await context.abort(exc.code, exc.message)
        base_id = _request_id(context)
        params = request.parameters
        num = len(prompts)
        try:
            reqs = [
                self._validate(base_id if num == 1 else f"{base_id}-{i}", text, params, ids)
                for i, (text, ids) in enumerate(prompts)
            ]
            reqs = [await self._with_grammar(r, params) for r in reqs]
            count = best_of.num_sequences(params, limits, not reqs[0].sampling.greedy)
            seqs = [s for r in reqs for s in best_of.fork(r, count)]
            self._admit(len(seqs))
        except _CallFailed as exc:
            await context.abort(exc.code, exc.message)
        try:
            results = await self._collect_all(seqs)
        except _CallFailed as exc:
            await context.abort(exc.code, exc.message)
        if count > 1:
            return self._parallel_response(prompts, seqs, results, params, count)
        response = pb.GenerateResponse()
        for (text, _), req, collected in zip(prompts, reqs, results, strict=True):
            assert collected.final is not None
            generated = collected.final.generated_text
            result = pb.GenerateResult(
                generated_text=text + generated if params.return_full_text else generated
            )
            if params.details or params.decoder_input_details:
                result.details.CopyFrom(self._details(req, collected, params))
            if params.decoder_input_details:
                result.prompt_text = text
            response.results.append(result)
        return response

    def _parallel_response(
        self,
        prompts: list[tuple[str, tuple[int, ...] | None]],
        seqs: list[GenerationRequest],
        results: list[_Collected],
        params: pb.GenerateParameters,
        count: int,
    ) -> pb.GenerateResponse:
        """best_of / n (server/best_of.py): per input, ``n`` results (the best first with
        best_of, else in sequence order); the rest go to ``details.best_of_sequences``."""
        n = params.n if params.HasField("n") else 1
        want_details = params.details or params.decoder_input_details
        response = pb.GenerateResponse()
        for p, (text, _) in enumerate(prompts):
            group = range(p * count, (p + 1) * count)
            leader = results[p * count].final
            assert leader is not None
            details = []
            for i in group:
                d = self._details(seqs[i], results[i], params)
                if i != p * count and not d.prefill:  # followers skip prompt logprobs
                    d.prefill.extend(_token_pb(t) for t in leader.prefill)
                details.append(d)
            sums = [best_of.cumulative_logprob(results[i].tokens) for i in group]
            order = best_of.ranked(sums) if params.HasField("best_of") else list(range(count))
            for rank, j in enumerate(order[:n]):
                final = results[p * count + j].final
                assert final is not None
                generated = final.generated_text
                result = pb.GenerateResult(
                    generated_text=text + generated if params.return_full_text else generated
                )
                if want_details:
                    result.details.CopyFrom(details[j])
                    if rank == 0:
                        result.details.best_of_sequences.extend(
                            self._best_of_sequence(details[k], results[p * count + k], text, params)
                            for k in order[n:]
                        )
                response.results.append(result)
        return response

    @staticmethod
    def _best_of_sequence(
        d: pb.Details, collected: _Collected, text: str, params: pb.GenerateParameters
    ) -> pb.BestOfSequence:
        final = collected.final
        assert final is not None
        generated = final.generated_text
        seq = pb.BestOfSequence(
            generated_text=text + generated if params.return_full_text else generated,
            finish_reason=d.finish_reason,
            generated_tokens=d.generated_tokens,
            prefill=d.prefill,
            tokens=d.tokens,
            top_tokens=d.top_tokens,
            cached_tokens=d.cached_tokens,
        )
        if d.HasField("seed"):
            seq.seed = d.seed
        return seq

    async def GenerateStream(
        self, request: pb.GenerateStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        params = request.parameters
        try:
            try:
                best_of.check_stream(params)
            except ValidationError as exc:
                raise _CallFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            ((text, ids),) = self._prompts(
                [request.inputs] if request.inputs or not request.input_ids else [],
                [request.input_ids] if request.input_ids else [],
                request.suffix if request.HasField("suffix") else None,
            )
            req = self._validate(_request_id(context), text, params, ids)
            req = await self._with_grammar(req, params)
            self._admit(1)
        except _CallFailed as exc:
            await context.abort(exc.code, exc.message)
        self._in_flight += 1
        try:
            async for out in self._stream(req):
                yield self._stream_message(request, req, out, text)
        except _CallFailed as exc:
            await context.abort(exc.code, exc.message)
        finally:
            self._in_flight -= 1

    def _stream_message(
        self,
        request: pb.GenerateStreamRequest,
        req: GenerationRequest,
        out: TokenOutput,
        prompt_text: str,
    ) -> pb.GenerateStreamResponse:
        msg = pb.GenerateStreamResponse(index=out.index)
        if out.token is not None:
            msg.token.CopyFrom(_token_pb(out.token))
        msg.top_tokens.extend(_token_pb(t) for t in out.top_tokens)
        final = out.final
        if final is not None:
            text = final.generated_text
            msg.generated_text = prompt_text + text if request.parameters.return_full_text else text
            details = pb.StreamDetails(
                finish_reason=_FINISH_REASONS.get(
                    final.finish_reason, pb.FINISH_REASON_UNSPECIFIED
                ),
                generated_tokens=final.num_generated_tokens,
                input_length=final.num_prompt_tokens,
                cached_tokens=final.num_cached_tokens,
            )
            if req.seed is not None:
                details.seed = req.seed
            last = out.token.token_id if out.token is not None else None
            if (stop_id := stop_token_id(req, final, last)) is not None:
                details.stop_token_id = stop_id
            msg.details.CopyFrom(details)
        return msg

    async def Health(
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthResponse:
        serving = self._serving
        if serving is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        elif not serving.engine.is_ready:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                serving.engine.dead_reason or "the server is not serving (shutting down)",
            )
        return pb.HealthResponse()

    async def Info(
        self, request: pb.InfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.InfoResponse:
        try:
            serving = self._require()
            adapters = serving.engine.adapters
            if adapters is None:
                return serving.info
            info = pb.InfoResponse()
            info.CopyFrom(serving.info)
            info.loaded_adapters.extend(adapters.loaded)  # changes as adapters come and go
            return info
        except _CallFailed as exc:
            await context.abort(exc.code, exc.message)
            raise  # abort() raises; this keeps the type checker informed

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        try:
            tokenizer = self._require().tokenizer
        except _CallFailed as exc:
            await context.abort(exc.code, exc.message)
        spans = tokenizer.tokenize(request.inputs, add_special_tokens=add_special)
        return pb.TokenizeResponse(
            tokens=[
                pb.SimpleToken(id=s.token_id, text=s.text, start=s.start, stop=s.stop)
                for s in spans
            ]
        )

    # ------------------------------------------------------------------ chat
    def _plan_chat(
        self, request: chat.ChatRequestPb, base_id: str
    ) -> tuple[chat.ChatPlan, list[GenerationRequest]]:
        """Render the conversation once; one engine request per choice (``base_id-i``)."""
        serving = self._require()
        try:
            plan = chat.plan_chat(
                request,
                serving.chat,
                serving.limits,
                serving.info.served_model_name or serving.info.model_id,
                serving.info.model_id,
                serving.chat_features,
            )
        except ValidationError as exc:
            raise _CallFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except UnsupportedError as exc:
            raise _CallFailed(grpc.StatusCode.UNIMPLEMENTED, str(exc)) from None
        except chat.ModelNotFoundError as exc:
            raise _CallFailed(grpc.StatusCode.NOT_FOUND, str(exc)) from None
        except chat.NoTemplateError as exc:
            raise _CallFailed(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        num = len(plan.choice_params)
        reqs = [
            self._validate(
                base_id if num == 1 else f"{base_id}-{i}",
                plan.prompt_text,
                params,
                prompt_ids=plan.prompt_ids,
            )
            for i, params in enumerate(plan.choice_params)
        ]
        # Choices share the rendered prompt's KV: prefilled once (engine/prompt_fork.py).
        reqs[1:] = [dataclasses.replace(r, fork_of=reqs[0].req_id) for r in reqs[1:]]
        return plan, reqs

    async def _plan_chat_with_grammar(
        self, request: pb.ChatRequest | pb.ChatStreamRequest, base_id: str
    ) -> tuple[chat.ChatPlan, list[GenerationRequest]]:
        plan, reqs = self._plan_chat(request, base_id)
        reqs = [
            await self._with_grammar(r, p) for r, p in zip(reqs, plan.choice_params, strict=True)
        ]
        return plan, reqs

    async def Chat(
        self, request: pb.ChatRequest, context: grpc.aio.ServicerContext
    ) -> pb.ChatResponse:
        base_id = _request_id(context)
        try:
            plan, reqs = await self._plan_chat_with_grammar(request, base_id)
            self._admit(len(reqs))
        except _CallFailed as exc:
            await context.abort(exc.code, exc.message)
        try:
            results = await self._collect_all(reqs)
        except _CallFailed as exc:
            await context.abort(exc.code, exc.message)
        tokenizer = self._require().tokenizer
        response = pb.ChatResponse(
            id=f"chatcmpl-{base_id}",
            model=plan.model,
            created=plan.created,
            system_fingerprint=plan.extras.system_fingerprint,
        )
        finals: list[FinalInfo] = []
        for index, collected in enumerate(results):
            final = collected.final
            assert final is not None
            finals.append(final)
            piece = whole_reply(final.generated_text, plan.extras.tools, plan.extras.reasoning)
            choice = pb.ChatChoice(
                index=index,
                message=pb.ChatMessage(
                    role="assistant",
                    content=piece.content,
                    reasoning_content=piece.reasoning,
                    tool_calls=piece.tool_calls,
                ),
                finish_reason=_chat_finish(plan, final, piece),
            )
            if plan.logprobs:
                choice.logprobs.extend(
                    chat.token_logprob(t, top, tokenizer, plan.num_top_logprobs)
                    for t, top in zip(collected.tokens, collected.top_tokens, strict=True)
                )
            response.choices.append(choice)
        response.usage.CopyFrom(chat.usage(plan, finals))
        return response

    async def ChatStream(
        self, request: pb.ChatStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ChatStreamResponse]:
        base_id = _request_id(context)
        try:
            plan, reqs = await self._plan_chat_with_grammar(request, base_id)
            self._admit(len(reqs))
        except _CallFailed as exc:
            await context.abort(exc.code, exc.message)
        self._in_flight += len(reqs)
        tokenizer = self._require().tokenizer
        # Choices generate concurrently; their outputs meet in one queue, in arrival order.
        queue: asyncio.Queue[tuple[int, TokenOutput | None] | _CallFailed] = asyncio.Queue()

        async def pump(index: int, req: GenerationRequest) -> None:
            try:
                async for out in self._stream(req):
                    queue.put_nowait((index, out))
                queue.put_nowait((index, None))
            except _CallFailed as exc:
                queue.put_nowait(exc)

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
        finals: list[FinalInfo | None] = [None] * len(reqs)
        replies = [ChoiceReply(plan.extras.tools, plan.extras.reasoning) for _ in reqs]
        try:
            remaining = len(reqs)
            while remaining:
                item = await queue.get()
                if isinstance(item, _CallFailed):
                    await context.abort(item.code, item.message)
                    return
                index, out = item
                if out is None:
                    remaining -= 1
                    continue
                msg = pb.ChatStreamResponse(
                    id=f"chatcmpl-{base_id}",
                    model=plan.model,
                    created=plan.created,
                    index=index,
                    system_fingerprint=plan.extras.system_fingerprint,
                )
                if out.token is not None:
                    piece = replies[index].feed(out.token.text)
                    msg.delta, msg.reasoning_delta = piece.content, piece.reasoning
                    msg.token.CopyFrom(chat.token_pb(out.token, tokenizer, plan.logprobs))
                    if plan.num_top_logprobs:
                        msg.top_logprobs.extend(
                            chat.token_pb(t, tokenizer, True)
                            for t in out.top_tokens[: plan.num_top_logprobs]
                        )
                if out.final is not None:
                    finals[index] = out.final
                    last = replies[index].finish()
                    msg.delta += last.content
                    msg.reasoning_delta += last.reasoning
                    msg.tool_calls.extend(
                        pb.ToolCallDelta(index=i, call=c) for i, c in enumerate(last.tool_calls)
                    )
                    msg.finish_reason = _chat_finish(plan, out.final, last)
                    if all(f is not None for f in finals):
                        done = [f for f in finals if f is not None]
                        msg.usage.CopyFrom(chat.usage(plan, done))
                yield msg
        finally:
            # The caller is gone or the call failed: stop every choice (their KV is freed).
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._in_flight -= len(reqs)


def _chat_finish(plan: chat.ChatPlan, final: FinalInfo, piece: ReplyPiece) -> pb.FinishReason:
    """OpenAI's "tool_calls" when the reply is calls, except for a named tool_choice, which
    OpenAI answers with "stop"; a reply cut short keeps "length"."""
    reason = chat.finish_reason(final)
    calls = piece.tool_calls and plan.extras.tools.mode != "function"
    if calls and reason != pb.FINISH_REASON_LENGTH:
        return pb.FINISH_REASON_TOOL_CALLS
    return reason
