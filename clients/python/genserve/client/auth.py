"""Credentials for a genserve behind ``--api-key`` and ``--tls-*``: the bearer metadata and
TLS / mutual-TLS channel credentials from PEM files."""

from __future__ import annotations

from os import PathLike

import grpc


def api_key_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """``authorization: Bearer <api_key>`` call metadata (nothing for None)."""
    return () if api_key is None else (("authorization", f"Bearer {api_key}"),)


def _read(path: str | PathLike[str] | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as file:
        return file.read()


def tls_credentials(
    root_certificates: str | PathLike[str] | None = None,
    cert_file: str | PathLike[str] | None = None,
    key_file: str | PathLike[str] | None = None,
) -> grpc.ChannelCredentials:
    """TLS channel credentials.  ``root_certificates``: PEM CA bundle to verify the server
    (None: the system roots); ``cert_file`` and ``key_file``: this client's certificate for a
    server that requires one (``--tls-client-ca-file``)."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("cert_file and key_file go together")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(root_certificates),
        private_key=_read(key_file),
        certificate_chain=_read(cert_file),
    )
