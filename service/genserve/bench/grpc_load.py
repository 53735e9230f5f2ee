"""Closed-loop load against a running genserve over gRPC (``GenerateStream``).

At concurrency N, N streams run at once; each sends its next request when the previous one
ends.  A level is bounded twice: by a request count and by a duration after which no new
request is started (requests in flight finish, each under its own gRPC deadline).  Only
loopback addresses are accepted: the benchmark is a local tool, never a load generator
pointed at someone else's machine.

Streams start staggered: stream k sends its first request once stream 0's first request has
received ``k / N`` of its tokens.  With fixed output lengths, streams that start together
stay in lock-step forever: every request would arrive in a burst of N together with all the
others, and no request would ever "join a running batch".  Staggered, the streams finish at
evenly spread moments, so in the steady state every new request arrives into a batch of the
N - 1 others, which is what a server under real traffic sees.  Throughput is measured over
that steady window (all N streams started, none run out of work yet).
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import Callable, Sequence

import grpc

from genserve.bench.prompts import Prompt, TokenCounter
from genserve.bench.records import RequestRecord, RunResult
from genserve.v1 import generate_pb2, generate_pb2_grpc

_LOOPBACK_NAMES = ("localhost",)


def check_loopback(address: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` for IPv6) and insist the host is loopback.

    Raises ValueError with a message naming the problem otherwise.
    """
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"address must be host:port, got {address!r}")
    host = host.removeprefix("[").removesuffix("]")
    port = int(port_text)
    if not 0 < port < 65536:
        raise ValueError(f"port out of range in {address!r}")
    if host.lower() not in _LOOPBACK_NAMES:
        try:
            is_loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            is_loopback = False
        if not is_loopback:
            raise ValueError(
                f"only loopback targets are allowed (127.0.0.1, ::1, localhost), got {host!r}"
            )
    return host, port


def _finish_reason_name(value: int) -> str:
    name: str = generate_pb2.FinishReason.Name(value)
    return name.removeprefix("FINISH_REASON_").lower()


def generate_parameters(prompt: Prompt) -> generate_pb2.GenerateParameters:
    """Greedy, or sampled at the prompt's temperature with a seed of its own (so a run is
    repeatable and every request draws differently)."""
    params = generate_pb2.GenerateParameters(max_new_tokens=prompt.max_new_tokens)
    if prompt.adapter_id:
        params.adapter_id = prompt.adapter_id
    if prompt.temperature > 0:
        params.do_sample = True
        params.temperature = prompt.temperature
        params.seed = prompt.prompt_id + 1
    if prompt.json_schema:
        params.grammar.json_schema = prompt.json_schema
    return params


async def stream_one(
    stub: generate_pb2_grpc.TextGenerationServiceStub,
    prompt: Prompt,
    timeout_s: float,
    on_token: Callable[[int], None] | None = None,
) -> RequestRecord:
    """Send one ``GenerateStream`` request (greedy, or sampled when the prompt has a
    temperature) and time every token message.

    ``on_token(n)`` is called with the number of messages received so far after each one.
    Never raises for RPC failures: they come back as a record with ``error`` set.
    """
    request = generate_pb2.GenerateStreamRequest(
        inputs=prompt.text,
        parameters=generate_parameters(prompt),
    )
    token_times: list[float] = []
    num_generated = 0
    input_length = 0
    cached_tokens = 0
    finish_reason = ""
    error: str | None = None
    start = time.perf_counter()
    try:
        async for message in stub.GenerateStream(request, timeout=timeout_s):
            token_times.append(time.perf_counter())
            if on_token is not None:
                on_token(len(token_times))
            if message.HasField("details"):
                details = message.details
                num_generated = details.generated_tokens
                input_length = details.input_length
                cached_tokens = details.cached_tokens
                finish_reason = _finish_reason_name(details.finish_reason)
    except grpc.aio.AioRpcError as exc:
        error = f"{exc.code().name}: {exc.details()}"
    end = time.perf_counter()
    if not finish_reason and error is None:
        error = "stream ended without details"
    return RequestRecord(
        prompt_id=prompt.prompt_id,
        start=start,
        end=end,
        token_times=tuple(token_times),
        # The final message's count is authoritative; fall back to messages seen on failure.
        num_generated_tokens=num_generated or len(token_times),
        max_new_tokens=prompt.max_new_tokens,
        input_length=input_length,
        finish_reason=finish_reason,
        cached_tokens=cached_tokens,
        error=error,
    )


class _Ramp:
    """Releases stream k when stream 0's first request has ``k * step`` tokens (see the
    module docstring); everything is released when that request ends."""

    def __init__(self, concurrency: int, tokens_per_request: int) -> None:
        self._gates = [asyncio.Event() for _ in range(concurrency)]
        self._gates[0].set()
        self._step = tokens_per_request / concurrency
        self.first_starts: list[float] = []

    async def wait(self, stream: int) -> None:
        await self._gates[stream].wait()
        self.first_starts.append(time.perf_counter())

    def on_token(self, num_received: int) -> None:
        for k in range(1, len(self._gates)):
            if num_received >= k * self._step:
                self._gates[k].set()

    def release_all(self) -> None:
        for gate in self._gates:
            gate.set()


async def run_level(
    channels: Sequence[grpc.aio.Channel],
    prompts: Sequence[Prompt],
    concurrency: int,
    num_requests: int,
    max_duration_s: float,
    request_timeout_s: float,
    name: str = "",
    on_done: Callable[[RequestRecord], None] | None = None,
    stagger: bool = True,
) -> RunResult:
    """Run ``num_requests`` requests (prompts taken in order, cycling) over ``concurrency``
    closed-loop streams spread round-robin over ``channels``; stop starting new ones after
    ``max_duration_s``.  ``stagger`` spreads the streams' first requests (module docstring);
    without it they all start at once.

    ``on_done`` is called after every request (progress bars).
    """
    if concurrency < 1 or num_requests < 1 or not prompts or not channels:
        raise ValueError("concurrency, num_requests, channels and prompts must be non-empty")
    stubs = [generate_pb2_grpc.TextGenerationServiceStub(c) for c in channels]
    records: list[RequestRecord] = []
    stream_exits: list[float] = []
    next_index = 0
    ramp = _Ramp(concurrency, prompts[0].max_new_tokens) if stagger else None
    start = time.perf_counter()
    deadline = start + max_duration_s

    async def stream_loop(stream: int) -> None:
        nonlocal next_index
        stub = stubs[stream % len(stubs)]
        if ramp is not None:
            await ramp.wait(stream)
        first = True
        # Taking the index and checking the deadline happen without an await in between, so
        # the streams share the counter safely on one event loop.
        while next_index < num_requests and time.perf_counter() < deadline:
            prompt = prompts[next_index % len(prompts)]
            next_index += 1
            on_token = ramp.on_token if ramp is not None and stream == 0 and first else None
            record = await stream_one(stub, prompt, request_timeout_s, on_token)
            if on_token is not None and ramp is not None:
                ramp.release_all()
            first = False
            records.append(record)
            if on_done is not None:
                on_done(record)
        stream_exits.append(time.perf_counter())
        if ramp is not None:
            ramp.release_all()  # a stream that got no work must not hold back the others

    await asyncio.gather(*(stream_loop(k) for k in range(concurrency)))
    wall = max(r.end for r in records) - min(r.start for r in records)
    notes: tuple[str, ...] = ()
    if next_index < num_requests:
        notes = (f"time limit {max_duration_s:g}s hit: {next_index}/{num_requests} started",)
    steady: tuple[float, float] | None = None
    if concurrency > 1 and ramp is not None and len(ramp.first_starts) == concurrency:
        # From the moment all streams have a request in flight to the first stream's exit.
        window = (max(ramp.first_starts), min(stream_exits))
        if window[1] > window[0]:
            steady = window
    return RunResult(
        name=name or f"genserve_c{concurrency}",
        system="genserve",
        concurrency=concurrency,
        records=tuple(records),
        wall_s=wall,
        notes=notes,
        steady_window=steady,
    )


async def run_sequential(
    channel: grpc.aio.Channel, prompts: Sequence[Prompt], request_timeout_s: float, name: str
) -> RunResult:
    """Send ``prompts`` one after another on one stream (the prefix scenario's phases)."""
    return await run_level(
        [channel],
        prompts,
        concurrency=1,
        num_requests=len(prompts),
        max_duration_s=float("inf"),
        request_timeout_s=request_timeout_s,
        name=name,
    )


async def wait_until_healthy(address: str, timeout_s: float, poll_s: float = 0.5) -> None:
    """Poll ``Health`` until it answers OK; raise TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last_error = "no answer"
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.TextGenerationServiceStub(channel)
        while time.monotonic() < deadline:
            try:
                await stub.Health(generate_pb2.HealthRequest(), timeout=max(poll_s, 1.0))
                return
            except grpc.aio.AioRpcError as exc:
                last_error = f"{exc.code().name}: {exc.details()}"
            await asyncio.sleep(poll_s)
    raise TimeoutError(f"genserve at {address} not healthy after {timeout_s:g}s ({last_error})")


async def fetch_info(address: str, timeout_s: float = 10.0) -> dict[str, object]:
    """The server's ``Info`` as a plain dict (recorded in the results)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.TextGenerationServiceStub(channel)
        info = await stub.Info(generate_pb2.InfoRequest(), timeout=timeout_s)
    # Every field, zeros included (a zero limit is information too); repeated fields (e.g.
    # loaded_adapters) as lists, so the dict stays JSON-serialisable.
    values = {field.name: getattr(info, field.name) for field in info.DESCRIPTOR.fields}
    return {
        name: v if isinstance(v, str | int | float | bool) else list(v)
        for name, v in values.items()
    }


def server_token_counter(
    address: str, timeout_s: float = 10.0
) -> tuple[TokenCounter, grpc.Channel]:
    """A :data:`TokenCounter` backed by the server's ``Tokenize`` (the served tokenizer, with
    special tokens added as generation adds them).  Close the returned channel when done."""
    channel = grpc.insecure_channel(address)
    stub = generate_pb2_grpc.TextGenerationServiceStub(channel)

    def count_tokens(text: str) -> int:
        request = generate_pb2.TokenizeRequest(inputs=text, add_special_tokens=True)
        return len(stub.Tokenize(request, timeout=timeout_s).tokens)

    return count_tokens, channel
