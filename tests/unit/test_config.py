"""Launcher flags and environment variables behave as TGI's."""

from __future__ import annotations

import pytest

from genserve.config import Config, load_config
from genserve.limits import CPU_DEFAULT_KV_REQUESTS, LimitsError, derive_limits, token_limits


def test_defaults_without_flags_or_env() -> None:
    config = load_config([], environ={})
    assert config == Config()
    assert config.port == 50051 and config.max_concurrent_requests == 128


def test_env_vars_and_flags_take_tgi_names_and_flags_win() -> None:
    env = {"MAX_TOTAL_TOKENS": "2048", "MAX_INPUT_LENGTH": "1000", "JSON_OUTPUT": "true"}
    config = load_config(["--max-total-tokens", "3000"], environ=env)
    assert config.max_total_tokens == 3000  # the flag wins over the environment
    assert config.max_input_tokens == 1000  # TGI's older name is an alias
    assert config.json_output is True
    assert load_config(["--max-input-length", "7"], environ={}).max_input_tokens == 7
    assert load_config([], environ={"HUGGINGFACE_HUB_CACHE": "/c"}).huggingface_hub_cache
    assert load_config(["-p", "1234"], environ={}).port == 1234
    assert load_config(["--disable-cpu-kernels"], environ={}).disable_cpu_kernels
    assert load_config([], environ={"DISABLE_CPU_KERNELS": "true"}).disable_cpu_kernels
    assert not load_config([], environ={}).disable_cpu_kernels


def test_hostname_env_only_when_it_is_an_address() -> None:
    # Shells and container runtimes export HOSTNAME=<machine name>; binding to it would
    # silently stop the server from answering on localhost.
    assert load_config([], environ={"HOSTNAME": "build-box-7"}).hostname == "0.0.0.0"
    assert load_config([], environ={"HOSTNAME": "127.0.0.1"}).hostname == "127.0.0.1"
    assert load_config([], environ={"HOSTNAME": "::"}).hostname == "::"
    assert load_config(["--hostname", "localhost"], environ={}).hostname == "localhost"


def test_env_has_no_environment_variable() -> None:
    assert load_config([], environ={"ENV": "/etc/shrc"}).env is False
    assert load_config(["-e"], environ={}).env is True


def test_bad_values_fail_clearly() -> None:
    with pytest.raises(SystemExit):
        load_config(["--dtype", "int8"], environ={})
    with pytest.raises(SystemExit, match="MAX_TOTAL_TOKENS"):
        load_config([], environ={"MAX_TOTAL_TOKENS": "many"})
    with pytest.raises(SystemExit):
        load_config(["--max-concurrent-requests", "0"], environ={})
    with pytest.raises(SystemExit):
        load_config(["--speculate", "-1"], environ={})


def test_speculation_flags() -> None:
    assert (Config().speculate, Config().speculate_max_batch_size) == (0, 32)  # off, as TGI
    config = load_config(["--speculate", "3"], environ={"SPECULATE_MAX_BATCH_SIZE": "8"})
    assert (config.speculate, config.speculate_max_batch_size) == (3, 8)
    assert load_config([], environ={"SPECULATE": "2"}).speculate == 2


def test_token_limits_follow_tgi_defaults() -> None:
    assert token_limits(Config(), 8192) == (4095, 4096)
    assert token_limits(Config(), 2048) == (2047, 2048)
    assert token_limits(Config(max_input_tokens=100), 2048) == (100, 2048)
    with pytest.raises(LimitsError, match="max-input-tokens"):
        token_limits(Config(max_input_tokens=500, max_total_tokens=500), 2048)
    with pytest.raises(LimitsError, match="max_position_embeddings"):
        token_limits(Config(max_total_tokens=9000), 2048)


def test_kv_capacity_bounds_the_request_limits() -> None:
    limits = derive_limits(Config(max_batch_total_tokens=1000), 2048, 10**6, on_cuda=False)
    assert limits.num_kv_blocks == 63  # ceil(1000 / 16)
    assert limits.max_total_tokens == 1008 and limits.max_input_tokens == 1007
    with pytest.raises(LimitsError, match="max-batch-total-tokens"):
        derive_limits(
            Config(max_batch_total_tokens=1000, max_total_tokens=2048), 2048, 10**6, False
        )
    # From memory, but never more than every request at full length could use.
    limits = derive_limits(Config(max_concurrent_requests=2), 2048, 10**6, on_cuda=False)
    assert limits.max_batch_total_tokens == 2 * 2048


def test_chunk_size_and_disabled_chunking() -> None:
    limits = derive_limits(Config(), 2048, 10**6, on_cuda=False)
    assert limits.max_batch_prefill_tokens == 2047 + 50
    assert limits.chunked_prefill_size <= limits.max_batch_prefill_tokens
    with pytest.raises(LimitsError, match="max-batch-prefill-tokens"):
        derive_limits(
            Config(disable_chunked_prefill=True, max_batch_prefill_tokens=100), 2048, 10**6, False
        )


def test_chat_flags_and_env_vars() -> None:
    from pathlib import Path

    config = load_config(
        ["--chat-template", "t.jinja", "--tokenizer-config-path", "/m/tokenizer_config.json",
         "--served-model-name", "smol"],
        environ={},
    )  # fmt: skip
    assert config.chat_template == "t.jinja"
    assert config.tokenizer_config_path == Path("/m/tokenizer_config.json")
    assert config.served_model_name == "smol"
    env = {"CHAT_TEMPLATE": "{{ x }}", "SERVED_MODEL_NAME": "m", "TOKENIZER_CONFIG_PATH": "/c"}
    config = load_config(["--served-model-name", "flag"], environ=env)
    assert config.chat_template == "{{ x }}" and config.tokenizer_config_path == Path("/c")
    assert config.served_model_name == "flag"  # the flag wins
    assert load_config([], environ={}).served_model_name is None  # the model id, at start-up


def test_kv_cache_is_sized_from_the_limits_and_capped_by_memory() -> None:
    # Every request the scheduler may run, at full length: 2 x ceil(2048 / 16) blocks.
    limits = derive_limits(Config(max_concurrent_requests=2), 2048, 10**6, on_cuda=False)
    assert (limits.num_kv_blocks, limits.kv_sized_by) == (256, "limits")
    assert limits.kv_blocks_needed == 256
    # --max-batch-size bounds the running batch below --max-concurrent-requests: the rest
    # wait in the queue and hold no KV.
    limits = derive_limits(
        Config(max_concurrent_requests=128, max_batch_size=4), 2048, 10**6, on_cuda=False
    )
    assert (limits.num_kv_blocks, limits.kv_sized_by) == (4 * 128, "limits")
    # Draft tokens (--speculate) need their slots too.
    limits = derive_limits(
        Config(max_concurrent_requests=1, speculate=4), 2048, 10**6, on_cuda=False
    )
    assert limits.num_kv_blocks == -(-(2048 + 4) // 16)
    # The memory budget caps it, and says so.
    limits = derive_limits(Config(max_concurrent_requests=8), 2048, 300, on_cuda=False)
    assert (limits.num_kv_blocks, limits.kv_sized_by) == (300, "memory")
    assert limits.kv_blocks_needed == 8 * 128
    limits = derive_limits(Config(max_batch_total_tokens=160), 2048, 10**6, on_cuda=False)
    assert (limits.num_kv_blocks, limits.kv_sized_by) == (10, "--max-batch-total-tokens")


def test_cpu_default_kv_cache_holds_a_few_full_length_requests() -> None:
    # TGI's 128 concurrent requests x 4,096 tokens would be 16 GiB for a 1B model: on CPU the
    # default cache holds CPU_DEFAULT_KV_REQUESTS of them (the rest share it block by block).
    per_request = 4096 // 16
    limits = derive_limits(Config(), 4096, 10**6, on_cuda=False)
    assert CPU_DEFAULT_KV_REQUESTS == 8
    assert (limits.num_kv_blocks, limits.kv_sized_by) == (8 * per_request, "limits")
    assert (limits.kv_requests, limits.max_total_tokens) == (8, 4096)
    # Fewer concurrent requests than that: those.
    limits = derive_limits(Config(max_concurrent_requests=3), 4096, 10**6, on_cuda=False)
    assert (limits.num_kv_blocks, limits.kv_requests) == (3 * per_request, 3)
    # --max-batch-size is an explicit running batch: the cache holds all of it, as on CUDA.
    limits = derive_limits(Config(max_batch_size=32), 4096, 10**6, on_cuda=False)
    assert (limits.num_kv_blocks, limits.kv_requests) == (32 * per_request, 32)
    limits = derive_limits(Config(), 4096, 10**6, on_cuda=True)
    assert (limits.num_kv_blocks, limits.kv_requests) == (128 * per_request, 128)
    # The memory budget still caps the CPU default.
    limits = derive_limits(Config(), 4096, 1000, on_cuda=False)
    assert (limits.num_kv_blocks, limits.kv_sized_by) == (1000, "memory")


def test_cuda_switches_default_to_the_machine() -> None:
    """--overlap-scheduling and --engine-process are auto: on where the model serves on CUDA
    (the engine process on one GPU), off on CPU; what the user says stays."""
    from genserve.serving_defaults import decide

    def switches(argv: list[str], gpus: int, environ: dict[str, str] | None = None) -> tuple:
        config = decide(load_config(argv, environ or {}), gpus)
        return config.overlap_scheduling, config.engine_process

    assert load_config([], {}).engine_process is None  # undecided until the launcher decides
    assert switches([], 0) == (False, False)
    assert switches([], 1) == (True, True)
    assert switches([], 2) == (True, False)  # every GPU sharded: the engine process stays in
    assert switches(["--num-shard", "1"], 2) == (True, True)
    assert switches(["--no-engine-process"], 1) == (True, False)
    assert switches(["--no-overlap-scheduling"], 1) == (False, True)
    assert switches([], 1, {"ENGINE_PROCESS": "false"}) == (True, False)
    assert switches(["--engine-process", "--overlap-scheduling"], 0) == (True, True)
    assert switches(["--sharded", "false", "--num-shard", "2"], 2) == (True, False)
