"""Generate and GenerateStream, output side: engine outputs → TGI-shaped replies.

Pure functions of the :class:`~genserve.server.conversion.convert.Conversion` and what the
engine produced; the servicer decides when to call them.  With best_of / n, the sequences of
one prompt are ranked by the cumulative logprob of their generated tokens (the quantity TGI's
``best_of`` maximises): the best ``n`` become results, the rest ``details.best_of_sequences``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from genserve.engine.outputs import FinalInfo, GenerationRequest, TokenInfo, TokenOutput
from genserve.engine.request import FinishReason
from genserve.server.conversion.convert import Conversion
from genserve.v1 import generate_pb2 as pb

TokenText = Callable[[int], str]  # a token id -> its own text (special tokens included)

_FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS_TOKEN: pb.FINISH_REASON_EOS_TOKEN,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
}


@dataclass(slots=True)
class Collected:
    """A unary result assembled from one sequence's token stream."""

    tokens: list[TokenInfo] = field(default_factory=list)
    top_tokens: list[tuple[TokenInfo, ...]] = field(default_factory=list)
    final: FinalInfo | None = None


def finish_reason_pb(final: FinalInfo) -> pb.FinishReason:
    return _FINISH_REASONS.get(final.finish_reason, pb.FINISH_REASON_UNSPECIFIED)


def token_pb(t: TokenInfo) -> pb.Token:
    # One constructor call (a None logprob leaves the optional field unset): about half the
    # cost of setting fields one by one, and it runs once per streamed token (#29).
    return pb.Token(id=t.token_id, text=t.text, special=t.special, logprob=t.logprob)


def stop_token_id(
    req: GenerationRequest, final: FinalInfo, last_token_id: int | None
) -> int | None:
    """The stop_token_ids entry that ended ``req`` (Details.stop_token_id), or None."""
    if (
        final.finish_reason is FinishReason.STOP_SEQUENCE
        and last_token_id is not None
        and last_token_id in req.stopping.stop_token_ids
    ):
        return last_token_id
    return None


def cumulative_logprob(tokens: list[TokenInfo]) -> float:
    return sum(t.logprob or 0.0 for t in tokens)


def ranked(logprob_sums: list[float]) -> list[int]:
    """Indices of the sequences, best (highest cumulative logprob) first; stable."""
    return sorted(range(len(logprob_sums)), key=lambda i: -logprob_sums[i])


def _full_text(prompt_text: str, generated: str, params: pb.GenerateParameters) -> str:
    return prompt_text + generated if params.return_full_text else generated


def details(
    req: GenerationRequest,
    collected: Collected,
    params: pb.GenerateParameters,
    token_text: TokenText | None = None,
) -> pb.Details:
    """``token_text``: a special token that ended generation (EOS) adds no text to the reply
    but is listed with its own text, as TGI lists it (#27)."""
    final = collected.final
    assert final is not None
    out = pb.Details(
        finish_reason=finish_reason_pb(final),
        generated_tokens=final.num_generated_tokens,
        input_length=final.num_prompt_tokens,
        cached_tokens=final.num_cached_tokens,
        prefill=[token_pb(t) for t in final.prefill],
        tokens=[_detail_token(t, token_text) for t in collected.tokens],
    )
    if req.seed is not None:
        out.seed = req.seed
    last = collected.tokens[-1].token_id if collected.tokens else None
    if (stop_id := stop_token_id(req, final, last)) is not None:
        out.stop_token_id = stop_id
    if params.HasField("top_n_tokens") and params.top_n_tokens > 0:
        out.top_tokens.extend(
            pb.TopTokens(tokens=[token_pb(t) for t in top]) for top in collected.top_tokens
        )
        # #27: the alternatives at prompt positions (OpenAI echo's prompt top_logprobs).
        out.prefill_top_tokens.extend(
            pb.TopTokens(tokens=[token_pb(t) for t in top]) for top in final.prefill_top
        )
    return out


def _detail_token(t: TokenInfo, token_text: TokenText | None) -> pb.Token:
    msg = token_pb(t)
    if token_text is not None and t.special and not t.text:
        msg.text = token_text(t.token_id)
    return msg


def generate_response(
    conv: Conversion, results: list[Collected], token_text: TokenText | None = None
) -> pb.GenerateResponse:
    """The reply to Generate; ``results`` in the order of ``conv.sequences``."""
    if conv.num_per_prompt > 1:
        return _parallel_response(conv, results)
    params = conv.params
    response = pb.GenerateResponse()
    for prompt, req, collected in zip(conv.prompts, conv.sequences, results, strict=True):
        assert collected.final is not None
        result = pb.GenerateResult(
            generated_text=_full_text(prompt.text, collected.final.generated_text, params)
        )
        if params.details or params.decoder_input_details:
            result.details.CopyFrom(details(req, collected, params, token_text))
        if params.decoder_input_details:
            result.prompt_text = prompt.text  # what OpenAI's echo returns (#27)
        response.results.append(result)
    return response


def _parallel_response(conv: Conversion, results: list[Collected]) -> pb.GenerateResponse:
    """best_of / n: per input, ``n`` results (the best first with best_of, else in sequence
    order); the rest go to ``details.best_of_sequences``."""
    params, count, seqs = conv.params, conv.num_per_prompt, conv.sequences
    n = params.n if params.HasField("n") else 1
    want_details = params.details or params.decoder_input_details
    response = pb.GenerateResponse()
    for p, prompt in enumerate(conv.prompts):
        group = range(p * count, (p + 1) * count)
        leader = results[p * count].final
        assert leader is not None
        group_details = []
        for i in group:
            d = details(seqs[i], results[i], params)
            if i != p * count and not d.prefill:  # followers skip prompt logprobs
                d.prefill.extend(token_pb(t) for t in leader.prefill)
            group_details.append(d)
        sums = [cumulative_logprob(results[i].tokens) for i in group]
        order = ranked(sums) if params.HasField("best_of") else list(range(count))
        for rank, j in enumerate(order[:n]):
            final = results[p * count + j].final
            assert final is not None
            result = pb.GenerateResult(
                generated_text=_full_text(prompt.text, final.generated_text, params)
            )
            if want_details:
                result.details.CopyFrom(group_details[j])
                if rank == 0:
                    result.details.best_of_sequences.extend(
                        _best_of_sequence(
                            group_details[k], results[p * count + k], prompt.text, params
                        )
                        for k in order[n:]
                    )
            response.results.append(result)
    return response


def _best_of_sequence(
    d: pb.Details, collected: Collected, prompt_text: str, params: pb.GenerateParameters
) -> pb.BestOfSequence:
    final = collected.final
    assert final is not None
    seq = pb.BestOfSequence(
        generated_text=_full_text(prompt_text, final.generated_text, params),
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


def stream_message(conv: Conversion, out: TokenOutput) -> pb.GenerateStreamResponse:
    """One GenerateStream message: a token, and on the last one the text and details.

    Runs on the gRPC event loop once per streamed token (#29): the common message (a token,
    no alternatives, not the last) is built in one constructor call, with no CopyFrom and no
    empty ``top_tokens`` extend; the bytes are the same as field-by-field building gives."""
    token = out.token
    msg = pb.GenerateStreamResponse(
        index=out.index,
        token=None if token is None else token_pb(token),
    )
    if out.top_tokens:
        msg.top_tokens.extend([token_pb(t) for t in out.top_tokens])
    final = out.final
    if final is not None:
        (req,) = conv.sequences
        msg.generated_text = _full_text(conv.prompts[0].text, final.generated_text, conv.params)
        details = msg.details
        details.finish_reason = finish_reason_pb(final)
        details.generated_tokens = final.num_generated_tokens
        details.input_length = final.num_prompt_tokens
        details.cached_tokens = final.num_cached_tokens
        if req.seed is not None:
            details.seed = req.seed
        last = token.token_id if token is not None else None
        if (stop_id := stop_token_id(req, final, last)) is not None:
            details.stop_token_id = stop_id
        if not msg.HasField("details"):  # every field zero: still sent, as before
            msg.details.SetInParent()
    return msg
