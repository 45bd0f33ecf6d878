"""The gateway's few error types, each carrying one `Status`.

Protocols map `Status` to their own wire code (HTTP status, gRPC code, ...) in one table at their
boundary; nothing inside the gateway knows about wire codes.
"""

from __future__ import annotations

import enum


class Status(enum.Enum):
    """Outcome classes shared by every protocol."""

    OK = "ok"
    INVALID_ARGUMENT = "invalid_argument"
    UNAUTHENTICATED = "unauthenticated"
    PERMISSION_DENIED = "permission_denied"
    NOT_FOUND = "not_found"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    UNAVAILABLE = "unavailable"
    CANCELLED = "cancelled"
    INTERNAL = "internal"


class GatewayError(Exception):
    """Base error: a `Status`, a human message, and an optional retry hint in seconds."""

    status: Status = Status.INTERNAL

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class InvalidRequest(GatewayError):
    status = Status.INVALID_ARGUMENT


class Unauthenticated(GatewayError):
    status = Status.UNAUTHENTICATED


class PermissionDenied(GatewayError):
    status = Status.PERMISSION_DENIED


class NotFound(GatewayError):
    status = Status.NOT_FOUND


class Throttled(GatewayError):
    status = Status.RESOURCE_EXHAUSTED


class DeadlineExceeded(GatewayError):
    status = Status.DEADLINE_EXCEEDED


class Unavailable(GatewayError):
    status = Status.UNAVAILABLE
