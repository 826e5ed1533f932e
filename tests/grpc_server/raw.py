"""An HTTP/2 client on a plain socket, frames written by hand, for what no real client
sends. It keeps the windows the server grants (RFC 9113 §6.9), so a test can count
what the server lets it send, and it answers the server's SETTINGS as a peer must.

Header blocks are hpack's (the library grpc's Python peers use), not the server's
own encoder; frames are read with the server's ``cut_frames`` at our frame size."""

from __future__ import annotations

import os
import socket
import struct
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from types import TracebackType

import hpack

from polymq.protocols.grpc_server.frames import (
    CONNECTION_PREFACE,
    DEFAULT_MAX_FRAME_SIZE,
    DEFAULT_WINDOW,
    MAX_WINDOW,
    Flag,
    Frame,
    FrameType,
    Setting,
    cut_frames,
    frame,
    settings,
    window_update,
)
from tests.grpc_server.harness import WAIT_S

__all__ = ["RawH2", "grpc_message"]


def grpc_message(payload: bytes, *, compressed: bool = False) -> bytes:
    return struct.pack(">BI", int(compressed), len(payload)) + payload


class RawH2:
    """One connection to 127.0.0.1:``port``."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self._buffer = bytearray()
        self._ready: deque[Frame] = deque()
        self._block: tuple[bool, bytearray] | None = None  # (ends its stream, awaiting more)
        self.closed = False
        self.acking = False  # whether the server's SETTINGS are answered (once we sent ours)
        # what the server grants us
        self.send_window = DEFAULT_WINDOW
        self.initial_window = DEFAULT_WINDOW
        self.stream_windows: dict[int, int] = {}
        self.server_settings: dict[int, int] = {}
        # what the server said, by stream
        self.headers: defaultdict[int, list[list[tuple[bytes, bytes]]]] = defaultdict(list)
        self.data: defaultdict[int, bytearray] = defaultdict(bytearray)
        self.ended: set[int] = set()
        self.resets: dict[int, int] = {}
        self.goaway: tuple[int, int] | None = None  # last stream, error code

    def __enter__(self) -> RawH2:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.sock.close()

    # -- out ---------------------------------------------------------------------------

    def send(self, *chunks: bytes) -> None:
        self.sock.sendall(b"".join(chunks))

    def handshake(
        self, *, stream_window: int = MAX_WINDOW, connection_window: int = MAX_WINDOW
    ) -> None:
        """The preface and our SETTINGS, granting the server these windows for its
        answers (by default, windows that never hold them back); back once the
        server's SETTINGS and first window updates are in."""
        self.acking = True
        grown = connection_window - DEFAULT_WINDOW
        self.send(
            CONNECTION_PREFACE,
            settings(((Setting.INITIAL_WINDOW_SIZE, stream_window),)),
            window_update(0, grown) if grown else b"",
        )
        self.sync()

    def sync(self) -> list[Frame]:
        """A PING, and every frame until its ACK: all the server wrote before it read
        the PING."""
        token = os.urandom(8)
        self.send(frame(FrameType.PING, 0, 0, token))
        return self.read_until(
            lambda kind, flags, _, payload: (
                kind == FrameType.PING and bool(flags & Flag.ACK) and payload == token
            )
        )

    def header_block(self, path: str, extra: Iterable[tuple[str, str]] = ()) -> bytes:
        return self.encoder.encode(
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", "127.0.0.1"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                *extra,
            ]
        )

    def open(self, stream: int, path: str, *, end_stream: bool = False) -> None:
        flags = Flag.END_HEADERS | (Flag.END_STREAM if end_stream else 0)
        self.stream_windows[stream] = self.initial_window
        self.send(frame(FrameType.HEADERS, flags, stream, self.header_block(path)))

    def send_data(self, stream: int, payload: bytes, *, end_stream: bool = False) -> None:
        """DATA frames of the default size at most, counted against the windows (which
        they may overrun: the server's to refuse)."""
        self.send_window -= len(payload)
        self.stream_windows[stream] = self.stream_windows.get(stream, 0) - len(payload)
        size = DEFAULT_MAX_FRAME_SIZE
        parts = [payload[at : at + size] for at in range(0, len(payload), size)] or [b""]
        last = Flag.END_STREAM if end_stream else 0
        self.send(
            *(frame(FrameType.DATA, 0, stream, part) for part in parts[:-1]),
            frame(FrameType.DATA, last, stream, parts[-1]),
        )

    def room(self, stream: int) -> int:
        return min(self.send_window, self.stream_windows.get(stream, 0))

    def fill(self, stream: int, message: bytes, cap: int) -> int:
        """Copies of ``message`` (at most a frame long) on ``stream``, cut to what the
        windows allow, until they are shut: a PING answered with no window opening
        shows the server gives no more. Stops at ``cap`` bytes; how many were sent."""
        assert len(message) <= DEFAULT_MAX_FRAME_SIZE
        sent = 0
        while sent < cap:
            size = min(self.room(stream), len(message), cap - sent)
            if size <= 0:
                self.sync()
                if self.room(stream) <= 0:
                    break
                continue
            at = sent % len(message)
            self.send_data(stream, (message * 2)[at : at + size])
            sent += size
        return sent

    def call(self, stream: int, path: str, request: bytes) -> tuple[int, bytes]:
        """A unary call: its grpc-status and its answer's bytes (prefix included)."""
        self.open(stream, path)
        self.send_data(stream, grpc_message(request), end_stream=True)
        self.finish(stream)
        return self.status(stream), bytes(self.data[stream])

    # -- in ----------------------------------------------------------------------------

    def over(self, stream: int) -> bool:
        return stream in self.ended or stream in self.resets

    def status(self, stream: int) -> int:
        for block in self.headers[stream]:
            for name, value in block:
                if name == b"grpc-status":
                    return int(value)
        raise AssertionError(f"no grpc-status on stream {stream}: {self.headers[stream]}")

    def read_frame(self) -> Frame | None:
        """The next frame, or None once the server closed (or reset) the connection."""
        while not self._ready:
            if self.closed:
                return None
            try:
                chunk = self.sock.recv(1 << 16)
            except ConnectionResetError:
                chunk = b""
            except TimeoutError as e:
                raise AssertionError("the server wrote nothing in time") from e
            if not chunk:
                self.closed = True
                continue
            self._buffer += chunk
            cut, used = cut_frames(self._buffer, DEFAULT_MAX_FRAME_SIZE)
            del self._buffer[:used]
            self._ready.extend(cut)
        got = self._ready.popleft()
        self._note(*got)
        return got

    def read_until(self, done: Callable[[int, int, int, bytes], bool]) -> list[Frame]:
        seen: list[Frame] = []
        while (got := self.read_frame()) is not None:
            seen.append(got)
            if done(*got):
                return seen
        raise AssertionError(f"the server closed the connection first; it sent {seen}")

    def wait(self, condition: Callable[[], bool]) -> None:
        """Read frames until ``condition`` holds (at once if it does)."""
        while not condition():
            if self.read_frame() is None:
                raise AssertionError("the server closed the connection first")

    def received(self, stream: int, size: int) -> None:
        """Read until the server sent ``size`` bytes of DATA on ``stream``."""
        self.wait(lambda: len(self.data[stream]) >= size)

    def finish(self, *streams: int) -> None:
        """Read until the server ended (or reset) each of ``streams``."""
        self.wait(lambda: all(self.over(stream) for stream in streams))

    def read_to_close(self) -> list[Frame]:
        """Every frame until the server closes the connection."""
        seen: list[Frame] = []
        while (got := self.read_frame()) is not None:
            seen.append(got)
        return seen

    def read_goaway(self) -> tuple[int, int]:
        """The server's GOAWAY (last stream, error code); the connection then closes."""
        self.read_until(lambda kind, *_: kind == FrameType.GOAWAY)
        assert self.goaway is not None
        self.read_to_close()
        return self.goaway

    def _note(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind == FrameType.SETTINGS and not flags & Flag.ACK:
            for at in range(0, len(payload), 6):
                key, value = struct.unpack_from(">HI", payload, at)
                self.server_settings[key] = value
                if key == Setting.INITIAL_WINDOW_SIZE:
                    for open_stream in self.stream_windows:
                        self.stream_windows[open_stream] += value - self.initial_window
                    self.initial_window = value
            if self.acking:
                self.send(frame(FrameType.SETTINGS, Flag.ACK, 0))
        elif kind == FrameType.WINDOW_UPDATE:
            increment = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
            if stream == 0:
                self.send_window += increment
            else:
                self.stream_windows[stream] = self.stream_windows.get(stream, 0) + increment
        elif kind in (FrameType.HEADERS, FrameType.CONTINUATION):
            if kind == FrameType.HEADERS:
                self._block = (bool(flags & Flag.END_STREAM), bytearray())
            assert self._block is not None, "a CONTINUATION out of place"
            self._block[1].extend(payload)
            if flags & Flag.END_HEADERS:
                ends, block = self._block
                self._block = None
                self.headers[stream].append(list(self.decoder.decode(bytes(block), raw=True)))
                if ends:
                    self.ended.add(stream)
        elif kind == FrameType.DATA:
            self.data[stream] += payload
            if flags & Flag.END_STREAM:
                self.ended.add(stream)
        elif kind == FrameType.RST_STREAM:
            self.resets[stream] = struct.unpack(">I", payload)[0]
        elif kind == FrameType.GOAWAY:
            last, code = struct.unpack_from(">II", payload)
            self.goaway = (last, code)
