"""The per-token GenerateStream path made cheaper for #29 keeps its bytes and its order:
``stream_message`` against a field-by-field reference build, the engine's request mailbox,
and the stream_host bench's /proc reading."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from genserve.bench.stream_host import cpu_between, thread_times
from genserve.engine.mailbox import Mailbox
from genserve.engine.outputs import FinalInfo, GenerationRequest, TokenInfo, TokenOutput
from genserve.engine.request import FinishReason, StoppingCriteria
from genserve.server.conversion.convert import Conversion
from genserve.server.conversion.prompts import Prompt
from genserve.server.generate_render import finish_reason_pb, stream_message
from genserve.step import SamplingParams
from genserve.v1 import generate_pb2 as pb


def _reference(conv: Conversion, out: TokenOutput) -> pb.GenerateStreamResponse:
    """The message as it was built before #29: field by field, CopyFrom, always extend."""

    def token(t: TokenInfo) -> pb.Token:
        msg = pb.Token(id=t.token_id, text=t.text, special=t.special)
        if t.logprob is not None:
            msg.logprob = t.logprob
        return msg

    (req,) = conv.sequences
    msg = pb.GenerateStreamResponse(index=out.index)
    if out.token is not None:
        msg.token.CopyFrom(token(out.token))
    msg.top_tokens.extend(token(t) for t in out.top_tokens)
    final = out.final
    if final is not None:
        text = final.generated_text
        msg.generated_text = conv.prompts[0].text + text if conv.params.return_full_text else text
        details = pb.StreamDetails(
            finish_reason=finish_reason_pb(final),
            generated_tokens=final.num_generated_tokens,
            input_length=final.num_prompt_tokens,
            cached_tokens=final.num_cached_tokens,
        )
        if req.seed is not None:
            details.seed = req.seed
        last = out.token.token_id if out.token is not None else None
        if (
            final.finish_reason is FinishReason.STOP_SEQUENCE
            and last is not None
            and last in req.stopping.stop_token_ids
        ):
            details.stop_token_id = last
        msg.details.CopyFrom(details)
    return msg


def _conversion(seed: int | None, full_text: bool) -> Conversion:
    req = GenerationRequest(
        req_id="r",
        prompt_token_ids=(1, 2, 3),
        sampling=SamplingParams(),
        stopping=StoppingCriteria(max_new_tokens=8, stop_token_ids=frozenset({7})),
        seed=seed,
    )
    params = pb.GenerateParameters(max_new_tokens=8, return_full_text=full_text)
    return Conversion(prompts=(Prompt("Hi"),), sequences=(req,), num_per_prompt=1, params=params)


def _final(reason: FinishReason, n: int = 3) -> FinalInfo:
    return FinalInfo(reason, "abc", n, 3, 0, 0)


TOKEN = TokenInfo(7, "c", -0.25, False)
OUTPUTS = [
    TokenOutput(0, TokenInfo(5, "a", None, False)),
    TokenOutput(1, TokenInfo(6, "", -1.5, True)),
    TokenOutput(2, TOKEN, top_tokens=(TOKEN, TokenInfo(9, "x", -2.0, False))),
    TokenOutput(3, TOKEN, final=_final(FinishReason.STOP_SEQUENCE)),
    TokenOutput(3, TOKEN, final=_final(FinishReason.LENGTH)),
    TokenOutput(0, None, final=_final(FinishReason.ERROR, n=0)),  # every detail zero
    TokenOutput(2, None, final=_final(FinishReason.EOS_TOKEN)),
]


@pytest.mark.parametrize("seed", [None, 0, 42])
@pytest.mark.parametrize("full_text", [False, True])
@pytest.mark.parametrize("out", OUTPUTS)
def test_stream_message_bytes_unchanged(
    out: TokenOutput, seed: int | None, full_text: bool
) -> None:
    conv = _conversion(seed, full_text)
    got, want = stream_message(conv, out), _reference(conv, out)
    assert got == want
    assert got.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)
    assert got.HasField("details") == (out.final is not None)
    assert got.HasField("token") == (out.token is not None)


def test_mailbox_keeps_order_and_wakes_its_reader() -> None:
    async def scenario() -> list[int]:
        box = Mailbox()
        got: list[int] = []

        async def reader() -> None:
            for _ in range(5):
                got.append((await box.get()).index)

        task = asyncio.create_task(reader())
        await asyncio.sleep(0)  # the reader now waits on an empty mailbox
        box.put_nowait(TokenOutput(0, None))
        await asyncio.sleep(0)
        for i in range(1, 5):  # several waiting at once come out in order
            box.put_nowait(TokenOutput(i, None))
        await asyncio.wait_for(task, 10)
        return got

    assert asyncio.run(scenario()) == [0, 1, 2, 3, 4]


def test_mailbox_reader_cancelled_while_waiting() -> None:
    async def scenario() -> int:
        box = Mailbox()
        task = asyncio.create_task(box.get())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        box.put_nowait(TokenOutput(1, None))  # no waiter left to wake: no error
        return (await asyncio.wait_for(box.get(), 10)).index

    assert asyncio.run(scenario()) == 1


def test_thread_times_reads_this_process() -> None:
    stop = threading.Event()
    worker = threading.Thread(target=lambda: stop.wait(10))
    worker.start()
    try:
        before = thread_times(os.getpid())
        sum(i * i for i in range(200_000))  # some CPU on this (the main) thread
        after = thread_times(os.getpid())
    finally:
        stop.set()
        worker.join()
    assert os.getpid() in after and worker.native_id in before
    spent = {t.tid: t.cpu_s for t in cpu_between(os.getpid(), before, after)}
    assert all(v >= 0 for v in spent.values())
    assert after[os.getpid()].cpu_s >= before[os.getpid()].cpu_s
