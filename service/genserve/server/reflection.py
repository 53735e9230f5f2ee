"""gRPC server reflection answering both ``grpc.reflection.v1`` and ``v1alpha``.

grpcio-reflection ships only the v1alpha service, and its servicer resolves symbols with
``DescriptorPool.FindFileContainingSymbol``, which in the upb protobuf runtime knows services,
messages, enums and fields but not methods: ``grpcurl describe
genserve.v1.TextGenerationService.Generate`` (and ghz, which looks methods up by full name)
got "Symbol not found".  Two fixes live here:

* :class:`SymbolPool` wraps the descriptor pool and resolves ``<service>.<method>`` (and enum
  values, ``<enum parent>.<VALUE>``) to the file of their parent when the pool does not.
* ``grpc.reflection.v1.ServerReflection`` is served by the same servicer: v1 and v1alpha are
  the same messages under another package name (identical field numbers, so identical wire
  bytes).  A v1 file descriptor, the v1alpha one renamed, is added to the pool so reflection
  can describe itself under both names.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool  # type: ignore[import-untyped]
from google.protobuf.descriptor import FileDescriptor  # type: ignore[import-untyped]
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer

V1ALPHA_SERVICE = "grpc.reflection.v1alpha.ServerReflection"
V1_SERVICE = "grpc.reflection.v1.ServerReflection"
REFLECTION_SERVICES: tuple[str, ...] = (V1_SERVICE, V1ALPHA_SERVICE)
_V1_FILE = "grpc/reflection/v1/reflection.proto"


class SymbolPool:
    """A descriptor pool whose ``FindFileContainingSymbol`` also resolves methods and enum
    values; every other lookup is the wrapped pool's."""

    def __init__(self, pool: descriptor_pool.DescriptorPool) -> None:
        self._pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def FindFileContainingSymbol(self, symbol: str) -> FileDescriptor:
        try:
            return self._pool.FindFileContainingSymbol(symbol)
        except KeyError:
            parent, _, leaf = symbol.rpartition(".")
            if not parent or not leaf:
                raise
        try:
            service = self._pool.FindServiceByName(parent)
        except KeyError:
            service = None
        if service is not None and leaf in service.methods_by_name:
            return service.file
        try:
            enum_value = self._pool.FindEnumTypeByName(parent)
        except KeyError:
            enum_value = None
        if enum_value is not None and leaf in enum_value.values_by_name:
            return enum_value.file
        raise KeyError(f"Couldn't find symbol {symbol}")


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """Add grpc/reflection/v1/reflection.proto (v1alpha's file under the v1 package)."""
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name = _V1_FILE
    proto.package = "grpc.reflection.v1"
    prefix = ".grpc.reflection.v1alpha."
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(prefix):
                field.type_name = ".grpc.reflection.v1." + field.type_name[len(prefix) :]
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(prefix, ".grpc.reflection.v1.")
            method.output_type = method.output_type.replace(prefix, ".grpc.reflection.v1.")
    proto.options.Clear()
    pool.Add(proto)


def enable_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Serve reflection (v1 and v1alpha) listing ``service_names`` plus both reflection
    services, resolving symbols from the default descriptor pool."""
    pool = descriptor_pool.Default()
    _add_v1_descriptor(pool)
    names = tuple(dict.fromkeys((*service_names, *REFLECTION_SERVICES)))
    servicer = ReflectionServicer(names, pool=SymbolPool(pool))
    for service in REFLECTION_SERVICES:
        handler = grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
            response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {"ServerReflectionInfo": handler}),)
        )
