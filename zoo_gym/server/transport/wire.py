"""A request that does not parse is INVALID_ARGUMENT, never INTERNAL.

grpcio answers a request its deserializer cannot parse (random bytes, a string field holding invalid
UTF-8, a length prefix that lies) with INTERNAL "Exception deserializing request!" before any handler
runs, and logs a traceback for each. `MalformedRequests`, the outermost server interceptor, gives every
method a deserializer that returns a marker instead of raising, and refuses the marker with
INVALID_ARGUMENT naming the message type: a unary request before the handler runs, a message of a request
stream when the handler reaches it (so a SubmitDelta stream refuses its bad chunk like any other).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc

from zoo_gym.server.errors import InvalidArgument


class _Malformed:
    """Stands for a request message that did not parse."""

    def __init__(self, message: str) -> None:
        self.message = message


def _tolerant(parse: Callable[[bytes], object], type_name: str) -> Callable[[bytes], object]:
    def deserialize(data: bytes) -> object:
        try:
            return parse(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError and friends: the peer's bytes are not the message
            reason = str(exc) or type(exc).__name__
            return _Malformed(f"the request is not a valid {type_name} message ({reason[:200]}); "
                              "send it serialized from the service's .proto (gRPC reflection lists it)")
    return deserialize


def _checked(requests: Iterator[object], context: grpc.ServicerContext) -> Iterator[object]:
    for request in requests:
        if isinstance(request, _Malformed):
            # The code is set on the RPC as well, for handlers that are not ours and would let the error
            # escape (grpcio would call that UNKNOWN); ours map InvalidArgument to the same status.
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details(request.message)
            raise InvalidArgument(request.message)
        yield request


class MalformedRequests(grpc.ServerInterceptor):
    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        message_type = getattr(handler.request_deserializer, "__self__", None)  # a message class's FromString
        type_name = getattr(getattr(message_type, "DESCRIPTOR", None), "full_name", handler_call_details.method)
        kw = dict(request_deserializer=_tolerant(handler.request_deserializer, type_name),
                  response_serializer=handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_unary(handler.unary_unary), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_unary(handler.unary_stream), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_streaming(handler.stream_unary), **kw)
        return grpc.stream_stream_rpc_method_handler(_streaming(handler.stream_stream), **kw)


def _unary(behavior: Callable) -> Callable:
    def wrapped(request, context):
        if isinstance(request, _Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return behavior(request, context)  # a response, or a server stream's iterator

    return wrapped


def _streaming(behavior: Callable) -> Callable:
    def wrapped(requests, context):
        return behavior(_checked(requests, context), context)

    return wrapped
