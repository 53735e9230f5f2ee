"""The Python client's keyword arguments for the issue #15 sampling fields, against a real
genserve: each reaches the server (the answer changes as the field says)."""

from __future__ import annotations

import pytest

from genserve.client import Client, InvalidArgumentError
from genserve.v1 import generate_pb2 as pb
from tests.utils.live_server import LiveServer

EOS = 2


def test_keywords_reach_the_server(server: LiveServer) -> None:
    with Client(server.address, timeout=60) as client:
        forced = client.generate(
            "Hello",
            max_new_tokens=4,
            logit_bias={EOS: 100.0},
            ignore_eos=True,
            skip_special_tokens=False,
            details=True,
        )
        assert forced.generated_text == "<|im_end|>" * 4
        assert forced.details.finish_reason == pb.FINISH_REASON_LENGTH
        held = client.generate(
            "Hello", max_new_tokens=6, logit_bias={EOS: 100.0}, min_new_tokens=2, details=True
        )
        assert [t.id for t in held.details.tokens][-1] == EOS
        assert held.details.generated_tokens == 3
        plain = client.generate("Hello", max_new_tokens=6, details=True)
        stop_id = plain.details.tokens[2].id
        stopped = client.generate(
            "Hello",
            max_new_tokens=6,
            stop_token_ids=[stop_id],
            details=True,
            include_stop_str_in_output=True,
        )
        assert stopped.details.stop_token_id == stop_id
        sampled = [
            client.generate("Hello", max_new_tokens=6, seed=3, min_p=0.1, do_sample=True)
            for _ in range(2)
        ]
        assert sampled[0].generated_text == sampled[1].generated_text
        with pytest.raises(InvalidArgumentError, match="min_p"):
            client.generate("Hello", min_p=3.0)
        with pytest.raises(InvalidArgumentError, match="vocabulary"):
            list(client.generate_stream("Hello", logit_bias={10**7: 1.0}))
