"""Small network helpers shared by the launcher, the planner's profiler and the tests."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (it may be taken again before it is used)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def split_address(address: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); ``ValueError`` naming the text otherwise."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{address!r} is not HOST:PORT (e.g. 127.0.0.1:7070)")
    host = host.strip("[]") or default_host
    return host, int(port)


def is_loopback(host: str) -> bool:
    import ipaddress

    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def outward_address(toward: str) -> str:
    """This host's address on the interface that routes to ``toward`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((toward, 9))
            return sock.getsockname()[0]
    except OSError:
        return socket.getfqdn()
