"""The status vocabulary of the stream: gRPC codes, their Connect names, and the typed error.

Both protocols end a stream with a status: gRPC in the ``grpc-status`` / ``grpc-message`` trailers
(the message percent-encoded, per the gRPC HTTP/2 spec), Connect in an end-of-stream JSON envelope
with a snake_case code name. Keeping both encodings beside one enum means the client and the server
cannot drift apart on what "unavailable" is called.
"""

from __future__ import annotations

import enum
import json
from typing import Any
from urllib.parse import quote, unquote


class Code(enum.IntEnum):
    """gRPC status codes (grpc/doc/statuscodes.md)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16

    @property
    def connect_name(self) -> str:
        """The Connect protocol's name for this code (``cancelled`` is spelled ``canceled`` there)."""
        return "canceled" if self is Code.CANCELLED else self.name.lower()

    @classmethod
    def from_connect_name(cls, name: str) -> Code:
        if name == "canceled":
            return cls.CANCELLED
        try:
            return cls[name.upper()]
        except KeyError:
            return cls.UNKNOWN


class RpcError(Exception):
    """A stream that ended with a non-OK status; ``message`` is for a person to act on."""

    def __init__(self, code: Code, message: str = "") -> None:
        super().__init__(f"{code.name}: {message}" if message else code.name)
        self.code = code
        self.message = message


# Characters the gRPC spec lets through unescaped in grpc-message: printable ASCII except '%'.
_GRPC_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")


def encode_grpc_message(message: str) -> str:
    """Percent-encode a status message for the ``grpc-message`` trailer (UTF-8, then %XX)."""
    return quote(message, safe=_GRPC_MESSAGE_SAFE, encoding="utf-8")


def decode_grpc_message(value: str) -> str:
    """Percent-decode ``grpc-message``; malformed escapes are kept as text, never raised on."""
    return unquote(value, encoding="utf-8", errors="replace")


def http_status_to_code(status: int) -> Code:
    """The gRPC code for a non-200 HTTP response (grpc/doc/http-grpc-status-mapping.md)."""
    return {
        400: Code.INTERNAL,
        401: Code.UNAUTHENTICATED,
        403: Code.PERMISSION_DENIED,
        404: Code.UNIMPLEMENTED,
        429: Code.UNAVAILABLE,
        502: Code.UNAVAILABLE,
        503: Code.UNAVAILABLE,
        504: Code.UNAVAILABLE,
    }.get(status, Code.UNKNOWN)


def encode_connect_end_stream(code: Code, message: str = "") -> bytes:
    """The Connect end-of-stream JSON: ``{}`` on success, ``{"error": {...}}`` otherwise."""
    body: dict[str, Any] = {}
    if code is not Code.OK:
        body["error"] = {"code": code.connect_name, "message": message}
    return json.dumps(body, separators=(",", ":")).encode()


def decode_connect_end_stream(payload: bytes) -> RpcError | None:
    """Parse a Connect end-of-stream envelope: ``None`` for success, the error otherwise."""
    try:
        body = json.loads(payload or b"{}")
    except ValueError as exc:
        return RpcError(Code.INTERNAL, f"malformed Connect end-of-stream JSON: {exc}")
    if not isinstance(body, dict):
        return RpcError(Code.INTERNAL, "malformed Connect end-of-stream JSON: not an object")
    error = body.get("error")
    if not error:
        return None
    if not isinstance(error, dict):
        return RpcError(Code.INTERNAL, "malformed Connect end-of-stream JSON: 'error' is not an object")
    return RpcError(Code.from_connect_name(str(error.get("code", "unknown"))), str(error.get("message", "")))


# -- how a call says which protocol it speaks --------------------------------------------------------

#: gRPC's content types: plain, and with the codec named (what grpcio and connect-go send).
GRPC_CONTENT_TYPE = "application/grpc"
GRPC_PROTO_CONTENT_TYPE = "application/grpc+proto"
GRPC_CONTENT_TYPES = (GRPC_CONTENT_TYPE, GRPC_PROTO_CONTENT_TYPE)
#: The Connect streaming protocol's content type (protobuf codec).
CONNECT_CONTENT_TYPE = "application/connect+proto"

#: The protocols a call on an HTTP/2 stream speaks, by name (``transport.client.CallOptions.protocol`` and the like).
PROTOCOLS = ("grpc", "connect")


def protocol_of(content_type: str) -> str | None:
    """``grpc`` or ``connect`` for a request's content type (parameters ignored); ``None`` if neither."""
    base = content_type.split(";", 1)[0].strip().lower()
    if base in GRPC_CONTENT_TYPES:
        return "grpc"
    if base == CONNECT_CONTENT_TYPE:
        return "connect"
    return None


def request_headers(protocol: str) -> list[tuple[str, str]]:
    """The headers that say ``protocol`` in a request: its content type, and gRPC's ``te: trailers``
    (proxies drop trailers without it) or Connect's protocol version."""
    if protocol == "grpc":
        return [("content-type", GRPC_PROTO_CONTENT_TYPE), ("te", "trailers")]
    if protocol == "connect":
        return [("content-type", CONNECT_CONTENT_TYPE), ("connect-protocol-version", "1")]
    raise ValueError(f"protocol {protocol!r}: expected one of {', '.join(PROTOCOLS)}")


def grpc_status_headers(code: Code, message: str = "") -> list[tuple[bytes, bytes]]:
    """``grpc-status`` and (when there is one) the percent-encoded ``grpc-message``: the trailers that
    end a gRPC call, or the tail of a trailers-only response's headers."""
    fields = [(b"grpc-status", str(int(code)).encode())]
    if message:
        fields.append((b"grpc-message", encode_grpc_message(message).encode()))
    return fields
