"""One benchmark invocation end to end: (launch,) warm up, load levels, prefix scenario,
(stop,) baselines, report.  The only module that sequences the others."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import math
import os
import platform
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from tqdm import tqdm

from genserve.bench import report
from genserve.bench.bench_config import BenchConfig
from genserve.bench.grpc_load import (
    check_loopback,
    fetch_info,
    run_level,
    run_sequential,
    server_token_counter,
)
from genserve.bench.launch import LaunchedServer
from genserve.bench.load_processes import STREAMS_PER_CHANNEL, run_level_processes
from genserve.bench.prompts import Prompt, TokenCounter, make_prefix_scenario, make_prompts
from genserve.bench.records import RunResult
from genserve.bench.stats import summarise


def resolve_concurrency(
    token: str, info: dict[str, Any], mean_prompt_tokens: float, max_new_tokens: int
) -> int:
    """An integer token as is; ``kv<F>x`` as F times the number of requests of mean size
    (prompt + ``max_new_tokens``) whose blocks fit in the server's KV cache (from ``Info``)."""
    if token.isdigit():
        return int(token)
    factor = float(token[2:-1])
    num_blocks = int(info.get("num_kv_blocks", 0))
    block_size = int(info.get("block_size", 0))
    if num_blocks <= 0 or block_size <= 0:
        raise RuntimeError(f"{token}: the server's Info reports no num_kv_blocks/block_size")
    blocks_per_request = math.ceil((mean_prompt_tokens + max_new_tokens) / block_size)
    capacity = max(1, num_blocks // blocks_per_request)
    return max(1, round(factor * capacity))


def requests_per_level(num_prompts: int, concurrency: int) -> int:
    """``num_prompts``, but at least three per stream: the first round is the ramp-up, the
    later ones join a running batch inside the steady window."""
    return max(num_prompts, 3 * concurrency)


def _hf_num_prompts(batch_size: int, min_prompts: int) -> int:
    return math.ceil(max(batch_size, min_prompts) / batch_size) * batch_size


def _record_rows(run: RunResult) -> list[dict[str, Any]]:
    """Per-request rows for the JSON (token times left out)."""
    return [
        {
            "prompt_id": r.prompt_id,
            "input_length": r.input_length,
            "num_generated_tokens": r.num_generated_tokens,
            "finish_reason": r.finish_reason,
            "cached_tokens": r.cached_tokens,
            "ttft_ms": None if r.ttft is None else r.ttft * 1000,
            "e2e_ms": r.e2e * 1000,
            # Stalls show here: a long pause mid-stream hides behind a fine median ITL.
            "max_itl_ms": max(r.inter_token_latencies, default=0.0) * 1000,
            "decode_tok_s": r.decode_rate,
            "error": r.error,
        }
        for r in run.records
    ]


async def _load_levels(
    config: BenchConfig, prompts: Sequence[Prompt], concurrencies: Sequence[int]
) -> list[RunResult]:
    num_channels = math.ceil(max(concurrencies) / STREAMS_PER_CHANNEL)
    channels = [grpc.aio.insecure_channel(config.address) for _ in range(num_channels)]
    try:
        if config.warmup_requests > 0:
            await run_level(
                channels[:1],
                prompts,
                concurrency=min(2, config.warmup_requests),
                num_requests=config.warmup_requests,
                max_duration_s=config.max_duration_s,
                request_timeout_s=config.request_timeout_s,
                name="warmup",
                stagger=False,
            )
        results = []
        for concurrency in concurrencies:
            num_requests = requests_per_level(config.num_prompts, concurrency)
            with tqdm(
                total=num_requests,
                desc=f"genserve c={concurrency}",
                unit="req",
                disable=not config.progress,
            ) as bar:
                if config.client_processes > 1:
                    level = run_level_processes(
                        config.address,
                        prompts,
                        concurrency=concurrency,
                        num_requests=num_requests,
                        max_duration_s=config.max_duration_s,
                        request_timeout_s=config.request_timeout_s,
                        processes=config.client_processes,
                        on_done=lambda _record: bar.update(1),
                        stagger=config.stagger,
                    )
                else:
                    level = run_level(
                        channels,
                        prompts,
                        concurrency=concurrency,
                        num_requests=num_requests,
                        max_duration_s=config.max_duration_s,
                        request_timeout_s=config.request_timeout_s,
                        on_done=lambda _record: bar.update(1),
                        stagger=config.stagger,
                    )
                results.append(await level)
        return results
    finally:
        for channel in channels:
            await channel.close()


async def _prefix_phases(
    config: BenchConfig, count_tokens: TokenCounter, salt: str
) -> tuple[RunResult, RunResult]:
    scenario = make_prefix_scenario(
        config.prefix_requests,
        config.prefix_max_new_tokens,
        config.seed,
        salt,
        system_prompt_tokens=config.prefix_tokens,
        count_tokens=count_tokens,
    )
    timeout = config.request_timeout_s
    async with grpc.aio.insecure_channel(config.address) as channel:
        cold = await run_sequential(channel, scenario.cold_prompts, timeout, "prefix_cold")
        await run_sequential(channel, (scenario.warm_primer,), timeout, "prefix_primer")
        warm = await run_sequential(channel, scenario.warm_prompts, timeout, "prefix_warm")
    return cold, warm


def _baseline_model_dir(config: BenchConfig) -> Path:
    """The weights the baseline loads: ``--model-id`` when it is a directory; otherwise what
    genserve itself resolves from the same arguments (server args after ``--``, then
    ``--model-id``, then the environment) — for the embedded default model that is the
    converted safetensors cache the server loads."""
    if config.model_id is not None and Path(config.model_id).is_dir():
        return Path(config.model_id)
    from genserve.config import load_config
    from genserve.model.loader import resolve_model

    extra = ["--model-id", config.model_id] if config.model_id is not None else []
    server_config = load_config([*config.server_args, *extra])
    resolved = resolve_model(
        server_config.model_id,
        revision=server_config.revision,
        hub_cache=server_config.huggingface_hub_cache,
        cache_dir=server_config.genserve_cache / "models",
        trust_remote_code=server_config.trust_remote_code,
    )
    return Path(resolved.local_dir)


def _run_baselines(config: BenchConfig, prompts: Sequence[Prompt]) -> list[RunResult]:
    from genserve.bench import hf_baseline

    model_dir = _baseline_model_dir(config)
    model, tokenizer = hf_baseline.load_model(
        model_dir, config.dtype, config.threads, config.hf_device
    )
    # One short unmeasured call: the first generate() pays one-time setup costs.
    hf_baseline.run_padded_generate(
        model, tokenizer, [Prompt(-1, prompts[0].text, 0, 4)], batch_size=1
    )
    results = []
    for batch_size in config.hf_batch_sizes:
        num = _hf_num_prompts(batch_size, config.hf_min_prompts)
        with tqdm(
            total=num, desc=f"HF generate() b={batch_size}", unit="req", disable=not config.progress
        ) as bar:
            if "eager" in config.hf_modes:
                results.append(
                    hf_baseline.run_padded_generate(
                        model, tokenizer, prompts[:num], batch_size, on_done=bar.update
                    )
                )
            for mode in ("static", "static-compile"):  # fixed batch, compiled once
                if mode in config.hf_modes:
                    results.append(
                        hf_baseline.run_static_generate(
                            model, tokenizer, prompts[:num], batch_size,
                            compile=mode == "static-compile",
                        )
                    )  # fmt: skip
    if config.hf_generate_batch and hf_baseline.has_generate_batch(model):
        num = max(config.hf_batch_sizes)
        if config.progress:
            print(f"HF generate_batch() on {num} prompts ...", flush=True)
        results.append(hf_baseline.run_generate_batch(model, tokenizer, prompts[:num]))
    return results


def _environment(config: BenchConfig) -> dict[str, Any]:
    env: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "threads": config.threads,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    if config.hf_baseline:
        import torch
        import transformers

        env["torch"] = torch.__version__
        env["transformers"] = transformers.__version__
    return env


def run_suite(config: BenchConfig) -> dict[str, Any]:
    """Run everything ``config`` asks for, print the tables, write ``results.json`` and
    ``bench.png`` under ``config.out`` and return the results dict."""
    host, port = check_loopback(config.address)
    server = None
    if config.launch:
        server = LaunchedServer(
            list(config.server_args), host, port, config.threads, config.out / "server.log"
        )
        print(f"launching: {' '.join(server.command)}", flush=True)
        server.start()
    try:
        if server is not None:
            asyncio.run(server.wait_healthy(config.launch_timeout_s))
        info = asyncio.run(fetch_info(config.address))
        count_tokens, token_channel = server_token_counter(config.address)
        salt = secrets.token_hex(4)
        try:
            prompts, concurrencies = _prompt_set(config, count_tokens, info)
            genserve_runs: list[RunResult] = []
            if config.scenario in ("load", "all"):
                genserve_runs = asyncio.run(_load_levels(config, prompts, concurrencies))
            prefix_runs = None
            if config.scenario in ("prefix", "all"):
                prefix_runs = asyncio.run(_prefix_phases(config, count_tokens, salt))
        finally:
            token_channel.close()
    finally:
        if server is not None:
            # Stopped before the baselines so the two never compete for the cores.
            server.stop()
    baseline_runs = _run_baselines(config, prompts) if config.hf_baseline else []
    return _report(config, info, salt, genserve_runs, prefix_runs, baseline_runs)


def _prompt_set(
    config: BenchConfig, count_tokens: TokenCounter, info: dict[str, Any]
) -> tuple[list[Prompt], list[int]]:
    """The prompts every run draws from (enough for the largest one) and the levels."""
    probe = make_prompts(
        8, config.prompt_len_mean, config.max_new_tokens, config.seed, config.prompt_len_std
    )
    mean_tokens = sum(p.num_target_tokens for p in probe) / len(probe)
    concurrencies = [
        resolve_concurrency(token, info, mean_tokens, config.max_new_tokens)
        for token in config.concurrency
    ]
    limit = int(info.get("max_concurrent_requests", 0))
    if limit and max(concurrencies) > limit:
        # Every stream past the limit would be refused at once (RESOURCE_EXHAUSTED): that
        # measures the admission limit, not the scheduler.
        raise RuntimeError(
            f"{max(concurrencies)} streams exceed the server's --max-concurrent-requests "
            f"({limit}); raise it, or shrink the KV cache (--max-batch-total-tokens) for kvNx"
        )
    needed = [requests_per_level(config.num_prompts, c) for c in concurrencies]
    if config.hf_baseline:
        needed += [_hf_num_prompts(b, config.hf_min_prompts) for b in config.hf_batch_sizes]
    prompts = make_prompts(
        max(needed),
        config.prompt_len_mean,
        config.max_new_tokens,
        config.seed,
        config.prompt_len_std,
        count_tokens=count_tokens,
    )
    if config.temperature > 0:
        prompts = [dataclasses.replace(p, temperature=config.temperature) for p in prompts]
    return prompts, concurrencies


def _report(
    config: BenchConfig,
    info: dict[str, Any],
    salt: str,
    genserve_runs: Sequence[RunResult],
    prefix_runs: tuple[RunResult, RunResult] | None,
    baseline_runs: Sequence[RunResult],
) -> dict[str, Any]:
    genserve = [summarise(run) for run in genserve_runs]
    for token, summary in zip(config.concurrency, genserve, strict=False):
        summary["kv_factor"] = None if token.isdigit() else float(token[2:-1])
    baselines = [summarise(run) for run in baseline_runs]
    prefix = None
    prefix_rows: list[dict[str, Any]] = []
    if prefix_runs is not None:
        cold, warm = (summarise(run) for run in prefix_runs)
        prefix = report.prefix_summary(cold, warm) | {"salt": salt, "cold": cold, "warm": warm}
        prefix_rows = [row for run in prefix_runs for row in _record_rows(run)]
    ratios = report.compute_ratios(genserve, baselines)
    targets = report.check_targets(genserve, baselines, prefix)
    results: dict[str, Any] = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars_of(config).items()},
        "server_info": info,
        "environment": _environment(config),
        "genserve": genserve,
        "baselines": baselines,
        "ratios": ratios,
        "prefix": prefix,
        "targets": targets,
        "requests": {run.name: _record_rows(run) for run in [*genserve_runs, *baseline_runs]}
        | ({"prefix": prefix_rows} if prefix_rows else {}),
    }
    print()
    print(report.format_table([*genserve, *baselines]))
    if ratios:
        print("\nratios (genserve / baseline):\n" + report.format_ratios(ratios))
    if prefix is not None:
        print(
            f"\nprefix scenario ({prefix['mean_input_length']:.0f}-token prompts): cold TTFT p50 "
            f"{prefix['cold_ttft_p50_ms']:.0f} ms, warm {prefix['warm_ttft_p50_ms']:.0f} ms "
            f"(warm/cold {prefix['warm_over_cold']:.2f}, "
            f"{prefix['warm_cached_tokens']} prompt tokens from the cache)"
        )
    if targets:
        print("\ntargets:\n" + report.format_targets(targets))
    notes = [f"{s['name']}: {n}" for s in [*genserve, *baselines] for n in s["notes"]]
    if baselines and info.get("model_dtype") != config.dtype:
        notes.append(
            f"server dtype {info.get('model_dtype')!r} differs from baseline dtype "
            f"{config.dtype!r}: the comparison is not like for like"
        )
    if notes:
        print("\nnotes:\n" + "\n".join(notes))
    json_path = config.out / "results.json"
    report.write_json(json_path, results)
    written = [json_path]
    if genserve and importlib.util.find_spec("matplotlib") is not None:  # GPU box: maybe not
        png_path = config.out / "bench.png"
        report.plot(png_path, genserve, baselines)
        written.append(png_path)
    print("\nwrote " + ", ".join(map(str, written)))
    return results


def vars_of(config: BenchConfig) -> dict[str, Any]:
    """``config`` as a dict (slots dataclasses have no ``__dict__``)."""
    from dataclasses import asdict

    return asdict(config)
