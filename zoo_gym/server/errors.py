"""Domain errors raised by the handlers; the servicer alone maps them to gRPC status codes."""

from __future__ import annotations

import grpc


class GymError(Exception):
    """Base class: `code` is the gRPC status the servicer answers with; the message says what to fix."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(GymError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class Unauthenticated(GymError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(GymError):
    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPrecondition(GymError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class AlreadyExists(GymError):
    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(GymError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NotFound(GymError):
    code = grpc.StatusCode.NOT_FOUND


class DeadlineExceeded(GymError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(GymError):
    code = grpc.StatusCode.UNAVAILABLE
