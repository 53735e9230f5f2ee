"""The grpc.aio server: genserve's service, grpc.health.v1, reflection, graceful drain."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from genserve.server.reflection import enable_reflection
from genserve.server.servicer import TextGenerationServicer
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["TextGenerationService"].full_name
# grpc.health.v1 answers for the whole server ("") and for the service by name.
HEALTH_SERVICE_NAMES: tuple[str, ...] = ("", SERVICE_NAME)

# Big prompts and many top_n alternatives make large messages; gRPC's 4 MiB default is tight.
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_DEFAULT_OPTIONS = (
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
)


class GrpcApp:
    """Owns the grpc.aio server.  Health starts NOT_SERVING; :meth:`set_serving` flips it."""

    def __init__(
        self,
        servicer: TextGenerationServicer,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        options: Sequence[tuple[str, int]] | None = None,
    ) -> None:
        self.servicer = servicer
        self.health = HealthServicer()
        self._server = grpc.aio.server(
            interceptors=list(interceptors),
            options=[
                *(options if options is not None else _DEFAULT_OPTIONS),
                ("grpc.so_reuseport", 0),
            ],
        )
        pb_grpc.add_TextGenerationServiceServicer_to_server(servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        enable_reflection(
            self._server,
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name),
        )

    async def start(
        self, hostname: str, port: int, credentials: grpc.ServerCredentials | None = None
    ) -> int:
        """Listen and serve (TLS with ``credentials``); returns the bound port."""
        host = f"[{hostname}]" if ":" in hostname and not hostname.startswith("[") else hostname
        try:
            address = f"{host}:{port}"
            if credentials is None:
                bound = self._server.add_insecure_port(address)
            else:
                bound = self._server.add_secure_port(address, credentials)
        except RuntimeError:  # grpcio raises "Failed to bind to address" on a taken port
            bound = 0
        if bound == 0:
            raise OSError(
                f"cannot listen on {hostname}:{port} (address in use or not local): "
                "choose another --port"
            )
        await self._server.start()
        await self.set_serving(False)
        return int(bound)

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in HEALTH_SERVICE_NAMES:
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        await self._server.stop(grace_s)

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()
