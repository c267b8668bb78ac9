"""HTTP/1.1 responses read byte for byte off a raw socket, for tests of the servers' own HTTP transport."""

from __future__ import annotations

import socket


def read_response(conn: socket.socket, buffer: bytearray) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """One response (status line, headers, body) off ``conn``; leftovers stay in ``buffer``."""
    while b"\r\n\r\n" not in buffer:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed mid-response: {bytes(buffer)!r}")
        buffer += chunk
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    headers = dict(line.split(b": ", 1) for line in lines)
    buffer[:] = rest
    if status.split()[1] == b"100":
        return status, headers, b""
    if headers.get(b"transfer-encoding") == b"chunked":
        body = b""
        while True:
            while b"\r\n" not in buffer:
                buffer += conn.recv(65536)
            size_line, _, rest = bytes(buffer).partition(b"\r\n")
            size = int(size_line, 16)
            while len(rest) < size + 2:
                rest += conn.recv(65536)
            body, buffer[:] = body + rest[:size], rest[size + 2:]
            if size == 0:
                return status, headers, body
    length = int(headers.get(b"content-length", b"0"))
    while len(buffer) < length:
        buffer += conn.recv(65536)
    body, buffer[:] = bytes(buffer[:length]), buffer[length:]
    return status, headers, body
