"""genserve-bench argument handling and the loopback rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from genserve.bench.cli import parse_args
from genserve.bench.grpc_load import check_loopback
from genserve.bench.launch import server_command
from genserve.bench.suite import resolve_concurrency


def test_defaults_and_server_args_after_double_dash() -> None:
    config = parse_args(
        ["--concurrency", "1,8,kv4x", "--out", "x", "--launch", "--", "--dtype", "bfloat16"]
    )
    assert config.concurrency == ("1", "8", "kv4x")
    assert config.out == Path("x")
    assert config.server_args == ("--dtype", "bfloat16")
    assert config.address == "127.0.0.1:50051"
    assert config.hf_batch_sizes == (1, 32)
    assert config.temperature == 0.0


def test_sampled_workload_parameters() -> None:
    from genserve.bench.grpc_load import generate_parameters
    from genserve.bench.hf_baseline import _sampling_kwargs
    from genserve.bench.prompts import Prompt

    assert parse_args(["--temperature", "0.8"]).temperature == 0.8
    greedy = Prompt(3, "x", 1, 16)
    sampled = Prompt(3, "x", 1, 16, temperature=0.8)
    params = generate_parameters(greedy)
    assert params.max_new_tokens == 16 and not params.do_sample and not params.HasField("seed")
    params = generate_parameters(sampled)
    assert params.do_sample and params.temperature == pytest.approx(0.8) and params.seed == 4
    assert _sampling_kwargs([greedy]) == {"do_sample": False}
    assert _sampling_kwargs([sampled])["temperature"] == 0.8
    with pytest.raises(ValueError, match="one temperature"):
        _sampling_kwargs([greedy, sampled])


@pytest.mark.parametrize(
    "argv",
    [
        ["--address", "10.0.0.2:50051"],
        ["--address", "example.com:80"],
        ["--concurrency", "0"],
        ["--concurrency", "kvx"],
        ["--hf-batch-sizes", "1,a"],
        ["--", "--dtype", "float32"],  # server args without --launch
        ["--temperature", "-0.5"],
    ],
)
def test_rejected_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)


@pytest.mark.parametrize(
    ("address", "host"),
    [("127.0.0.1:1", "127.0.0.1"), ("localhost:50051", "localhost"), ("[::1]:9", "::1")],
)
def test_loopback_addresses(address: str, host: str) -> None:
    assert check_loopback(address)[0] == host


def test_non_loopback_is_refused() -> None:
    with pytest.raises(ValueError, match="loopback"):
        check_loopback("192.168.1.1:50051")
    with pytest.raises(ValueError, match="host:port"):
        check_loopback("127.0.0.1")


def test_kv_concurrency_from_server_info() -> None:
    info = {"num_kv_blocks": 100, "block_size": 16}
    # (40 + 128) / 16 -> 11 blocks per request -> 9 requests fit -> 4x is 36.
    assert resolve_concurrency("kv4x", info, 40.0, 128) == 36
    assert resolve_concurrency("8", info, 40.0, 128) == 8
    with pytest.raises(RuntimeError):
        resolve_concurrency("kv4x", {"num_kv_blocks": 0, "block_size": 16}, 40.0, 128)


def test_launch_command_adds_only_missing_flags() -> None:
    command = server_command(["--port", "6000", "--dtype", "bfloat16"], "127.0.0.1", 6000)
    assert command[-6:] == [
        "--dtype",
        "bfloat16",
        "--hostname",
        "127.0.0.1",
        "--prometheus-port",
        "0",
    ]
    assert command.count("--port") == 1


def test_levels_above_the_servers_request_limit_are_refused_up_front() -> None:
    from genserve.bench.suite import _prompt_set

    config = parse_args(["--concurrency", "2,kv4x", "--num-prompts", "4"])
    info = {"num_kv_blocks": 64, "block_size": 16, "max_concurrent_requests": 16}
    # kv4x: 64 blocks / 11 blocks per (40 + 128)-token request = 5 requests, x4 = 20 > 16.
    with pytest.raises(RuntimeError, match="--max-concurrent-requests"):
        _prompt_set(config, lambda text: len(text.split()), info)
    info["max_concurrent_requests"] = 128
    _, levels = _prompt_set(config, lambda text: len(text.split()), info)
    assert levels == [2, 20]
