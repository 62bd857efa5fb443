"""The listening socket of ``serve``, made before anything heavy is imported or loaded, so a port in
use or a host this machine does not have is said in a fraction of a second."""

from __future__ import annotations

import errno
import socket

from specpilot.errors import EnvironmentMissing, InputError


def url_host(host: str) -> str:
    """``host`` as a URL writes it (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host


def bind(host: str, port: int, backlog: int) -> socket.socket:
    """The listening socket on ``host``:``port`` (exit 3 for a port in use or forbidden, the
    machine's state; exit 2 for a host that does not resolve or is not this machine's)."""
    if not host.strip():   # the socket layer takes '' for every interface: say it, as 0.0.0.0
        raise InputError(f"--host {host!r}: give an address (127.0.0.1 for this machine alone, 0.0.0.0 or :: for "
                         "every interface)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        where = f"cannot listen on {url_host(host)}:{port} ({e.strerror or e})"
        if e.errno in (errno.EADDRINUSE, errno.EACCES):
            raise EnvironmentMissing(f"{where}; choose another --port") from None
        raise InputError(f"{where}; choose another --host") from None
    sock.set_inheritable(True)
    return sock
