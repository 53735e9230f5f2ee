"""Full next-token distributions over a fixed token text, from genserve and from
``llama-server`` on the same GGUF file, compared with the float32 reference's: what
``genserve-bench quant-accuracy --llama-cpp`` adds (issue #28: the accuracy cost of the
integer kernels beside llama.cpp's on the same file).

Every side is sent the same token ids (the reference server's tokenization of the text).
At each position ``t`` (after the first) the side's distribution over the whole vocabulary
predicting token ``t`` is read:

* genserve: one request with ``decoder_input_details`` and ``top_n_tokens`` = the
  vocabulary, whose ``prefill_top_tokens`` list every token's logprob at every prompt
  position (the server is started with ``--max-top-n-tokens`` that large);
* llama-server: one ``/completion`` per position, the prompt being the ids up to it,
  ``n_predict`` 1 and ``n_probs`` = the vocabulary (its pre-sampling softmax over the
  logits, ``post_sampling_probs`` off); ``cache_prompt`` makes each request compute one new
  token.  llama.cpp has no prompt logprobs, and ``llama-perplexity`` is not built here.

Measures of a side ``q`` against the reference ``p``, over the positions (pure functions,
unit-tested): top-1 agreement (``argmax q == argmax p``), mean ``KL(p || q)`` in nats (what
``llama-perplexity --kl-divergence`` reports), and the perplexity of the text under ``q``
over that under ``p``.
"""

from __future__ import annotations

import asyncio
import math
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np

from genserve.bench import llama_cpp_repack
from genserve.v1 import generate_pb2, generate_pb2_grpc

# gRPC's default 4 MiB receive limit is far below a vocabulary's logprobs at every position.
_GRPC_OPTIONS = [("grpc.max_receive_message_length", 1 << 30)]
# A probability llama-server rounds to zero (float32 underflow) counts as this.
_FLOOR = -1e4


@dataclass(slots=True)
class Distributions:
    """One side's log-probabilities ``[positions, vocab]`` predicting ``ids[1:]``."""

    name: str
    logprobs: np.ndarray  # float64, row t predicts ids[t + 1]

    def __post_init__(self) -> None:
        if self.logprobs.ndim != 2:
            raise ValueError(f"{self.name}: logprobs must be [positions, vocab]")


def dense(entries: Sequence[tuple[int, float]], vocab: int, what: str) -> np.ndarray:
    """One position's ``(token id, logprob)`` pairs as a dense vector; every id of the
    vocabulary must be listed (a partial list cannot give a KL divergence)."""
    row = np.full(vocab, np.nan)
    for token, logprob in entries:
        if 0 <= token < vocab:
            row[token] = max(logprob, _FLOOR)
    missing = int(np.isnan(row).sum())
    if missing:
        raise ValueError(f"{what}: {missing} of {vocab} token logprobs missing at a position")
    return row


def compare(ref: Distributions, other: Distributions, ids: Sequence[int]) -> dict[str, float]:
    """Top-1 agreement, mean KL(ref || other) and the perplexity ratio of ``ids[1:]``."""
    p, q = ref.logprobs, other.logprobs
    if p.shape != q.shape or p.shape[0] != len(ids) - 1:
        raise ValueError(f"shapes differ: {p.shape} vs {q.shape} for {len(ids)} ids")
    # Renormalise: the sides' float32 softmaxes (and the floor) sum to 1 within rounding.
    p = p - np.logaddexp.reduce(p, axis=1, keepdims=True)
    q = q - np.logaddexp.reduce(q, axis=1, keepdims=True)
    kl = (np.exp(p) * (p - q)).sum(axis=1)
    target = np.asarray(ids[1:])
    rows = np.arange(len(target))
    ppl_p = math.exp(-float(p[rows, target].mean()))
    ppl_q = math.exp(-float(q[rows, target].mean()))
    return {
        "top1_agreement": float((p.argmax(1) == q.argmax(1)).mean()),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "perplexity": ppl_q,
        "ppl_ratio": ppl_q / ppl_p,
    }


def markdown_table(rows: Sequence[dict[str, float | str]], reference: str, positions: int) -> str:
    lines = [
        f"| side (vs {reference}, {positions} positions) | top-1 agreement | mean KL (nats) "
        "| max KL | perplexity | ppl ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['side']} | {float(r['top1_agreement']):.3f} | {float(r['mean_kl']):.6f} "
            f"| {float(r['max_kl']):.6f} | {float(r['perplexity']):.2f} "
            f"| {float(r['ppl_ratio']):.5f} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# genserve


async def genserve_distributions(
    address: str, name: str, ids: Sequence[int], vocab: int, timeout_s: float
) -> Distributions:
    """Every prompt position's distribution from the genserve server at ``address`` (started
    with ``--max-top-n-tokens`` at least ``vocab``)."""
    async with grpc.aio.insecure_channel(address, options=_GRPC_OPTIONS) as channel:
        stub = generate_pb2_grpc.TextGenerationServiceStub(channel)
        request = generate_pb2.GenerateRequest(
            input_ids=[generate_pb2.TokenIds(ids=list(ids))],
            parameters=generate_pb2.GenerateParameters(
                max_new_tokens=1, details=True, decoder_input_details=True, top_n_tokens=vocab
            ),
        )
        response = await stub.Generate(request, timeout=timeout_s)
    details = response.results[0].details
    if [t.id for t in details.prefill] != list(ids):
        raise RuntimeError(f"{name}: the server's prefill tokens are not the ids sent")
    positions = list(details.prefill_top_tokens)[1:]  # the first: nothing predicts it
    rows = [
        dense([(t.id, t.logprob) for t in pos.tokens], vocab, f"{name} position {i + 1}")
        for i, pos in enumerate(positions)
    ]
    return Distributions(name, np.stack(rows))


# ---------------------------------------------------------------------------------------------
# llama.cpp


def llama_server_command(
    binary_dir: Path, model: Path, port: int, threads: int, context: int
) -> list[str]:
    """One slot, ``context`` tokens, ``threads`` threads, on 127.0.0.1:``port``; repacked
    layouts as :mod:`genserve.bench.llama_cpp_repack` decides."""
    return [
        str(binary_dir / "llama-server"),
        "-m",
        str(model),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-c",
        str(context),
        "-np",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *llama_cpp_repack.server_flags(llama_cpp_repack.default_on()),
    ]


async def _llama_completion(
    client: httpx.AsyncClient, url: str, prompt: Sequence[int], n_predict: int, vocab: int
) -> dict[str, Any]:
    body = {
        "prompt": list(prompt),
        "n_predict": n_predict,
        "n_probs": vocab,
        "post_sampling_probs": False,
        "temperature": 0.0,
        "top_k": 1,
        "cache_prompt": True,
        "return_tokens": True,
    }
    reply: dict[str, Any] = (await client.post(f"{url}/completion", json=body)).json()
    return reply


async def llama_distributions(
    url: str, name: str, ids: Sequence[int], vocab: int, timeout_s: float
) -> Distributions:
    """Every position's distribution from the ``llama-server`` at ``url`` (see the module
    docstring: one request per position, the prompt cached between them)."""
    rows = []
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        for t in range(1, len(ids)):
            # llama-server returns no probabilities while the text ends inside a UTF-8
            # sequence (a byte token chosen greedily): then a few more tokens are generated
            # to complete it, and the first one's distribution is still position t's.
            for n_predict in (1, 4):
                reply = await _llama_completion(client, url, ids[:t], n_predict, vocab)
                if int(reply.get("tokens_evaluated", t)) != t:  # a BOS would shift positions
                    raise RuntimeError(
                        f"{name}: llama-server evaluated {reply.get('tokens_evaluated')} prompt "
                        f"tokens for {t} ids"
                    )
                if reply.get("completion_probabilities"):
                    break
            else:
                raise RuntimeError(f"{name} position {t}: llama-server answered {reply!r:.500}")
            probs = reply["completion_probabilities"][0]
            entries = [(int(e["id"]), float(e["logprob"])) for e in probs["top_logprobs"]]
            rows.append(dense(entries, vocab, f"{name} position {t}"))
    return Distributions(name, np.stack(rows))


def run_llama_server(
    command: list[str], port: int, log: Path, ids: Sequence[int], vocab: int, timeout_s: float
) -> Distributions:
    """Start ``llama-server`` (``command``), read :func:`llama_distributions`, stop it."""
    from genserve.bench.server_compare import _spawn, _wait_http

    url = f"http://127.0.0.1:{port}"
    process = _spawn(command, log)
    try:
        started = time.perf_counter()
        asyncio.run(_wait_http(url, process, 600))
        healthy = time.perf_counter()
        dists = asyncio.run(llama_distributions(url, "llama.cpp", ids, vocab, timeout_s))
        print(
            f"llama.cpp: healthy after {healthy - started:.0f} s, "
            f"measured in {time.perf_counter() - healthy:.0f} s",
            flush=True,
        )
        return dists
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


class DistRun:
    """The ``--llama-cpp`` side of a run: each genserve configuration's distributions over
    the passage's first ids (read while its server runs), then llama-server's."""

    def __init__(
        self, model: Path, dist_tokens: int, timeout: float, llama_cpp_bin: Path, port: int,
        threads: int,
    ) -> None:  # fmt: skip
        from genserve.model.gguf_index import GGUFIndex

        self.model, self.dist_tokens, self.timeout = model, dist_tokens, timeout
        self.llama_cpp_bin, self.port, self.threads = llama_cpp_bin, port, threads
        embedding = next(t for t in GGUFIndex(model).tensors if t.name == "token_embd.weight")
        self.vocab = int(embedding.shape[1])  # GGUF dimensions: innermost first
        self.ids: list[int] = []
        self.sides: dict[str, Distributions] = {}

    def collector(self, name: str) -> Callable[[str, list[int]], None]:
        def collect(address: str, passage_ids: list[int]) -> None:
            self.ids = list(passage_ids[: self.dist_tokens])
            self.sides[name] = asyncio.run(
                genserve_distributions(address, name, self.ids, self.vocab, self.timeout)
            )

        return collect

    def run_llama_cpp(self, log_dir: Path) -> None:
        command = llama_server_command(
            self.llama_cpp_bin, self.model, self.port, self.threads, 4096
        )
        print(f"llama.cpp: {shlex.join(command)}", flush=True)
        self.sides["llama.cpp"] = run_llama_server(
            command,
            self.port,
            log_dir / "llama-server.log",
            self.ids,
            self.vocab,
            self.timeout,
        )

    def rows(self, baseline: str) -> list[dict[str, float | str]]:
        ref = self.sides[baseline]
        return [
            {"side": name, **compare(ref, side, self.ids)}
            for name, side in self.sides.items()
            if name != baseline
        ]
