"""The deployment flags: parsing, aliases, environment variables, and the API key never
appearing in the config's repr."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import descriptor_pool

from genserve.config import DEFAULT_API_KEY_EXEMPT, load_config
from genserve.server.reflection import SymbolPool
from genserve.server.security import (
    SecurityConfigError,
    _bearer_token,
    server_credentials,
    server_options,
)
from genserve.v1 import generate_pb2 as pb


def test_api_key_from_env_is_not_in_repr() -> None:
    config = load_config([], environ={"API_KEY": "hunter2-secret"})
    assert config.api_key == "hunter2-secret"
    assert "hunter2-secret" not in repr(config)
    assert config.api_key_exempt == DEFAULT_API_KEY_EXEMPT


def test_exempt_list_and_empty() -> None:
    assert load_config(["--api-key-exempt", "a.B, c.D"]).api_key_exempt == ("a.B", "c.D")
    assert load_config([], environ={"API_KEY_EXEMPT": ","}).api_key_exempt == ()
    assert load_config(["--api-key-exempt", ""]).api_key_exempt == ()


def test_payload_limit_is_an_alias_with_env() -> None:
    assert load_config(["--payload-limit", "2000000"]).max_message_size == 2_000_000
    assert load_config([], environ={"PAYLOAD_LIMIT": "1234"}).max_message_size == 1234
    options = dict(server_options(load_config(["--max-message-size", "99"])))
    assert options["grpc.max_receive_message_length"] == 99
    assert options["grpc.keepalive_permit_without_calls"] == 0
    assert options["grpc.max_connection_idle_ms"] == 300_000
    assert "grpc.max_connection_age_ms" not in options


def test_propagators() -> None:
    assert load_config([]).otel_propagators == ("tracecontext", "baggage", "b3")
    assert load_config([], environ={"OTEL_PROPAGATORS": "b3multi"}).otel_propagators == ("b3multi",)
    with pytest.raises(SystemExit):
        load_config(["--otel-propagators", "jaeger"])


def test_tls_flag_combinations(tmp_path: Path) -> None:
    assert server_credentials(load_config([])) is None
    with pytest.raises(SecurityConfigError, match="go together"):
        server_credentials(load_config(["--tls-cert-file", "x.crt"]))
    with pytest.raises(SecurityConfigError, match="needs"):
        server_credentials(load_config(["--tls-client-ca-file", "ca.crt"]))
    with pytest.raises(SecurityConfigError, match="cannot read"):
        missing = str(tmp_path / "missing")
        server_credentials(load_config(["--tls-cert-file", missing, "--tls-key-file", missing]))


def test_bearer_token_parsing() -> None:
    assert _bearer_token((("authorization", "Bearer abc"),)) == b"abc"
    assert _bearer_token((("authorization", "bearer  abc "),)) == b"abc"
    assert _bearer_token((("authorization", "Basic abc"),)) is None
    assert _bearer_token((("x-other", "Bearer abc"),)) is None
    assert _bearer_token(None) is None


def test_symbol_pool_resolves_methods_and_enum_values() -> None:
    pool = SymbolPool(descriptor_pool.Default())
    name = pb.DESCRIPTOR.name
    assert pool.FindFileContainingSymbol("genserve.v1.TextGenerationService.Generate").name == name
    assert pool.FindFileContainingSymbol("genserve.v1.FinishReason.FINISH_REASON_LENGTH").name == (
        name
    )
    with pytest.raises(KeyError):
        pool.FindFileContainingSymbol("genserve.v1.TextGenerationService.Nope")
    with pytest.raises(KeyError):
        pool.FindFileContainingSymbol("nothing")
