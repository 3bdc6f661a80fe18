"""A fault-injecting TCP proxy on loopback: it stands in for the network between a service and
Redis, because these machines have no kernel netem (``tc qdisc ... netem`` is unknown here) and
no Toxiproxy server.

Every byte goes through a userspace relay, so the proxy can delay data (a slow or congested
link), drop connections (an abrupt reset of every open connection, then refusing new ones
for a while: a link that is down), and black-hole them (nothing passes, no RST, no FIN: only
the ends' own time-outs notice). Used by the fault run (``benchmarks/faults/bench_faults.py``); not
for production.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time

_CHUNK = 256 * 1024


class FaultProxy:
    """Listens on ``127.0.0.1:port`` and relays each connection to ``upstream_port``.

    Args:
        upstream_port: the real server's loopback port.
        port: the port to listen on (0: a free one; read it from ``port`` after ``start``).

    Faults, applied while the proxy runs:
        ``delay_s``: each chunk of data, either way, waits this long before it is passed on.
        ``drop(seconds)``: reset every open connection now and refuse new ones for ``seconds``.
        ``blackhole(seconds)``: forward nothing, on open or new connections, for ``seconds``,
        closing and resetting none; then pass on what was sent meanwhile (TCP would resend it).
        ``mute(port)``: forward nothing, for good, on the one open connection whose upstream
        side has local port ``port`` (what the server sees as its peer: a replica's link in
        ``CLIENT LIST``), closing and resetting nothing; other connections are untouched.
    """

    def __init__(self, upstream_port: int, port: int = 0):
        self.upstream_port = upstream_port
        self.delay_s = 0.0
        self._refuse_until = 0.0
        self._hole_until = 0.0
        self._listener = socket.create_server(("127.0.0.1", port), backlog=128)
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._clients: set[socket.socket] = set()  # client sides of forwarding connections
        self._closed = threading.Event()
        self.dropped = 0  # connections reset by ``drop``
        self.black_holed = 0  # connections open when ``blackhole`` began (new ones not counted)
        self.given_up = 0  # of those, how many their client closed (its time-out was met)
        self._silenced: set[socket.socket] = set()
        self._upstreams: dict[int, socket.socket] = {}  # upstream local port -> that socket
        self._muted: set[socket.socket] = set()

    def start(self) -> FaultProxy:
        threading.Thread(target=self._accept, daemon=True, name=f"proxy-{self.port}").start()
        return self

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        self._reset_all()

    def drop(self, seconds: float) -> None:
        """Reset every open connection (RST, as a dead link's peer sees it eventually) and
        refuse new connections for ``seconds``."""
        self._refuse_until = time.monotonic() + seconds
        self.dropped += self._reset_all()

    def blackhole(self, seconds: float) -> None:
        """Packets vanish, both ways, for ``seconds``, as on a link that went silent: nothing
        is forwarded on any connection, open or new (new ones are accepted: the kernel answers
        the SYN), and none is closed or reset, so a client waiting for an answer meets its own
        socket time-out. Nothing sent is lost, as TCP retransmits it: once the black hole is
        over, what either end sent meanwhile is passed on (a client that gave up and closed
        its end then has its connection closed here, as its FIN arrives)."""
        with self._lock:
            self._hole_until = time.monotonic() + seconds
            self.black_holed += len(self._clients)
            self._silenced = set(self._clients)

    def mute(self, port: int) -> bool:
        """A link that dies silently: the connection whose upstream side has local port
        ``port`` passes nothing more, either way, and is never closed here (only the ends'
        own time-outs notice). Returns whether that connection was open."""
        with self._lock:
            upstream = self._upstreams.get(port)
            if upstream is not None:
                self._muted.add(upstream)
            return upstream is not None

    def _hold(self) -> bool:
        """Wait out a black hole; False when the proxy closed meanwhile."""
        while (left := self._hole_until - time.monotonic()) > 0:
            if self._closed.wait(min(left, 0.2)):
                return False
        return True

    def _reset_all(self) -> int:
        with self._lock:
            sockets, self._open = list(self._open), set()
        for sock in sockets:
            _reset(sock)
        return len(sockets) // 2

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if time.monotonic() < self._refuse_until:
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=2)
            except OSError:  # the server is down: the client sees a reset, as it would
                _reset(client)
                continue
            upstream.settimeout(None)
            self._upstreams[upstream.getsockname()[1]] = upstream
            # Small writes go out at once, as they do between the real ends (Redis and its
            # clients set TCP_NODELAY): Nagle's algorithm here would add ~40 ms round trips.
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._open |= {client, upstream}
                self._clients.add(client)
            threading.Thread(target=self._relay, args=(client, upstream), daemon=True).start()

    def _relay(self, a: socket.socket, b: socket.socket) -> None:
        """Pass data both ways until either side closes or is reset; nothing, not even an
        end, while a black hole lasts."""
        peer = {a: b, b: a}
        try:
            while True:
                if not self._hold():
                    return
                readable, _, _ = select.select([a, b], [], [], 0.2)
                if self._closed.is_set() or not self._hold():
                    return
                if b in self._muted:  # dead silently: wait, unread, until the proxy closes
                    self._closed.wait()
                    return
                for sock in readable:
                    data = sock.recv(_CHUNK)
                    if not data:
                        if sock is a and a in self._silenced:
                            self.given_up += 1
                        return
                    if self.delay_s:
                        time.sleep(self.delay_s)
                    peer[sock].sendall(data)
        except (OSError, ValueError):  # reset by ``drop``, or by either end
            return
        finally:
            with self._lock:
                self._open -= {a, b}
                self._clients.discard(a)
                self._silenced.discard(a)
                self._muted.discard(b)
                self._upstreams = {p: s for p, s in self._upstreams.items() if s is not b}
            for sock in (a, b):
                with contextlib.suppress(OSError):
                    sock.close()


def _reset(sock: socket.socket) -> None:
    """Close with an RST rather than a FIN (SO_LINGER with a zero time-out)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
