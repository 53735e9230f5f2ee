"""Chat and ChatStream, output side: the choices' engine outputs → OpenAI-shaped replies.

This is where a chat reply is assembled from detokenized text, so it is where parsers of
the model's output (tool calls, reasoning) plug in; the request side is
server/conversion/chat.py."""

from __future__ import annotations

from genserve.engine.outputs import FinalInfo, TokenInfo, TokenOutput
from genserve.server.chat_reply import ChoiceReply, ReplyPiece, whole_reply
from genserve.server.conversion.chat import ChatPlan
from genserve.server.generate_render import Collected, finish_reason_pb
from genserve.tokenizer import Tokenizer
from genserve.v1 import generate_pb2 as pb


def token_pb(t: TokenInfo, tokenizer: Tokenizer, with_logprob: bool) -> pb.Token:
    """The token with its own text (not the text it made final: OpenAI's logprobs list
    tokens as the tokenizer spells them)."""
    msg = pb.Token(id=t.token_id, text=tokenizer.token_text(t.token_id), special=t.special)
    if with_logprob and t.logprob is not None:
        msg.logprob = t.logprob
    return msg


def token_logprob(
    t: TokenInfo, top: tuple[TokenInfo, ...], tokenizer: Tokenizer, num_top: int
) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token=token_pb(t, tokenizer, True),
        top_logprobs=[token_pb(a, tokenizer, True) for a in top[:num_top]],
    )


def usage(plan: ChatPlan, finals: list[FinalInfo]) -> pb.Usage:
    """Prompt counted once (as OpenAI does for n > 1); completions summed over choices;
    cached tokens as the first choice saw them (the prompt as counted)."""
    prompt = len(plan.prompt_ids)
    completion = sum(f.num_generated_tokens for f in finals)
    return pb.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        cached_tokens=finals[0].num_cached_tokens if finals else 0,
    )


def chat_response(
    plan: ChatPlan, base_id: str, results: list[Collected], tokenizer: Tokenizer
) -> pb.ChatResponse:
    """The reply to Chat: one choice per result, in choice order."""
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
        # #27: reasoning and tool calls split out of the reply text (chat_reply.py).
        piece = whole_reply(final.generated_text, plan.extras.tools, plan.extras.reasoning)
        choice = pb.ChatChoice(
            index=index,
            message=pb.ChatMessage(
                role="assistant",
                content=piece.content,
                reasoning_content=piece.reasoning,
                tool_calls=piece.tool_calls,
            ),
            finish_reason=chat_finish_reason(plan, final, piece),
        )
        if plan.logprobs:
            choice.logprobs.extend(
                token_logprob(t, top, tokenizer, plan.num_top_logprobs)
                for t, top in zip(collected.tokens, collected.top_tokens, strict=True)
            )
        response.choices.append(choice)
    response.usage.CopyFrom(usage(plan, finals))
    return response


class ChatStreamAssembler:
    """Turns the choices' interleaved outputs into ChatStream messages; the last message
    of the call (the one that finishes the last choice) carries the usage."""

    def __init__(self, plan: ChatPlan, base_id: str, tokenizer: Tokenizer) -> None:
        self._plan = plan
        self._id = f"chatcmpl-{base_id}"
        self._tokenizer = tokenizer
        self._finals: list[FinalInfo | None] = [None] * (len(plan.choice_params))
        self._replies = [
            ChoiceReply(plan.extras.tools, plan.extras.reasoning) for _ in plan.choice_params
        ]

    def message(self, index: int, out: TokenOutput) -> pb.ChatStreamResponse:
        plan, tokenizer = self._plan, self._tokenizer
        msg = pb.ChatStreamResponse(
            id=self._id,
            model=plan.model,
            created=plan.created,
            index=index,
            system_fingerprint=plan.extras.system_fingerprint,
        )
        if out.token is not None:
            piece = self._replies[index].feed(out.token.text)
            msg.delta, msg.reasoning_delta = piece.content, piece.reasoning
            msg.token.CopyFrom(token_pb(out.token, tokenizer, plan.logprobs))
            if plan.num_top_logprobs:
                msg.top_logprobs.extend(
                    token_pb(t, tokenizer, True) for t in out.top_tokens[: plan.num_top_logprobs]
                )
        if out.final is not None:
            self._finals[index] = out.final
            last = self._replies[index].finish()
            msg.delta += last.content
            msg.reasoning_delta += last.reasoning
            msg.tool_calls.extend(
                pb.ToolCallDelta(index=i, call=c) for i, c in enumerate(last.tool_calls)
            )
            msg.finish_reason = chat_finish_reason(plan, out.final, last)
            if all(f is not None for f in self._finals):
                done = [f for f in self._finals if f is not None]
                msg.usage.CopyFrom(usage(plan, done))
        return msg


def chat_finish_reason(plan: ChatPlan, final: FinalInfo, piece: ReplyPiece) -> pb.FinishReason:
    """OpenAI's "tool_calls" when the reply is calls, except for a named tool_choice, which
    OpenAI answers with "stop"; a reply cut short keeps "length"."""
    reason = finish_reason_pb(final)
    calls = piece.tool_calls and plan.extras.tools.mode != "function"
    if calls and reason != pb.FINISH_REASON_LENGTH:
        return pb.FINISH_REASON_TOOL_CALLS
    return reason
