"""The options of one ``genserve-bench`` invocation, parsed by bench/cli.py and read by
bench/suite.py and the parts it runs (so the parts never import the command line)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Every option of one benchmark invocation (see ``--help``)."""

    address: str
    concurrency: tuple[str, ...]
    num_prompts: int
    prompt_len_mean: float
    prompt_len_std: float | None
    max_new_tokens: int
    temperature: float
    seed: int
    out: Path
    max_duration_s: float
    request_timeout_s: float
    warmup_requests: int
    stagger: bool
    scenario: str
    prefix_requests: int
    prefix_tokens: int
    prefix_max_new_tokens: int
    hf_baseline: bool
    model_id: str | None
    dtype: str
    hf_batch_sizes: tuple[int, ...]
    hf_min_prompts: int
    hf_generate_batch: bool
    hf_modes: tuple[str, ...]
    hf_device: str
    threads: int
    progress: bool
    launch: bool
    launch_timeout_s: float
    server_args: tuple[str, ...]
    client_processes: int = 1  # load levels split over this many processes (load_processes)
