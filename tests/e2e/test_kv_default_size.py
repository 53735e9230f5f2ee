"""The default KV cache on CPU (issue #28): with no limit flags, a server takes room for
``CPU_DEFAULT_KV_REQUESTS`` requests at --max-total-tokens (not the memory budget's 30% of
free RAM), and ``Info`` and the ``kv_cache_sized`` log line say what was taken and why."""

from __future__ import annotations

import json
from pathlib import Path

import grpc

from genserve.limits import CPU_DEFAULT_KV_REQUESTS
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.utils.live_server import start_server


def test_default_kv_cache_holds_a_few_full_length_requests(tiny_llama: Path) -> None:
    max_pos = json.loads((tiny_llama / "config.json").read_text())["max_position_embeddings"]
    max_total = min(max_pos, 4096)  # TGI's default
    with (
        start_server(tiny_llama, "--json-output") as server,
        grpc.insecure_channel(server.address) as channel,
    ):
        info = pb_grpc.TextGenerationServiceStub(channel).Info(pb.InfoRequest(), timeout=30)
        lines = [json.loads(x) for x in server.logs().splitlines() if x.startswith("{")]
    assert info.max_total_tokens == max_total
    blocks = CPU_DEFAULT_KV_REQUESTS * -(-max_total // info.block_size)
    assert info.num_kv_blocks == blocks
    assert info.max_batch_total_tokens == blocks * info.block_size
    assert info.kv_cache_sized_by == "limits"
    (sized,) = [x for x in lines if x.get("event") == "kv_cache_sized"]
    assert sized["num_blocks"] == blocks and sized["sized_by"] == "limits"
    assert sized["full_length_requests"] == CPU_DEFAULT_KV_REQUESTS
    assert sized["bytes"] == info.kv_cache_bytes == sized["needed_bytes"]
    assert sized["bytes"] < sized["memory_budget_bytes"]
    allocated = [x for x in lines if x.get("event") == "kv_cache_allocated"]
    assert allocated and all(x["num_blocks"] == blocks for x in allocated)
