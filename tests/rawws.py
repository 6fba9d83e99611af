"""A deliberately naive WebSocket client built by hand, for sending what trio-websocket won't: part of
a message and then nothing."""

from __future__ import annotations

import trio

import schema


async def ws_connect(port: int) -> tuple[trio.SocketStream, bytes]:
    """Open the agent port's WebSocket route; the socket, and what came after the 101 answer."""
    sock = await trio.open_tcp_stream("127.0.0.1", port)
    await sock.send_all(
        f"GET {schema.WEBSOCKET_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = await sock.receive_some(4096)
        if not chunk:
            raise AssertionError(f"connection closed during the WebSocket handshake: {head!r}")
        head += chunk
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock, head.split(b"\r\n\r\n", 1)[1]


def binary_frame_head(length: int) -> bytes:
    """A client's binary frame header (FIN, masked with key 0, so the payload goes as it is), its
    length in the fewest bytes, as RFC 6455 requires."""
    if length < 126:
        size = bytes([0x80 | length])
    elif length < 1 << 16:
        size = bytes([0x80 | 126]) + length.to_bytes(2, "big")
    else:
        size = bytes([0x80 | 127]) + length.to_bytes(8, "big")
    return b"\x82" + size + b"\0\0\0\0"


async def read_until_closed(sock: trio.SocketStream, received: bytes = b"") -> bytes:
    """Everything the server sends until it closes the connection."""
    while True:
        try:
            chunk = await sock.receive_some(65536)
        except trio.BrokenResourceError:
            return received
        if not chunk:
            return received
        received += chunk


def ws_frames(data: bytes) -> list[str]:
    """A server's WebSocket frames (unmasked) in words: ``close CODE REASON`` or ``binary PAYLOAD``."""
    out: list[str] = []
    pos = 0
    while pos + 2 <= len(data):
        opcode, length = data[pos] & 0x0F, data[pos + 1] & 0x7F
        pos += 2
        if length >= 126:
            size = 2 if length == 126 else 8
            length = int.from_bytes(data[pos : pos + size], "big")
            pos += size
        payload = data[pos : pos + length]
        pos += length
        if opcode == 0x8:
            out.append(f"close {int.from_bytes(payload[:2], 'big')} {payload[2:].decode('latin-1')}")
        else:
            out.append(f"binary {payload.decode('latin-1')}")
    return out
