"""Where inference servers may listen: loopback unless the user opts out, naming the risk.

The endpoints a backend opens (SGLang's HTTP server, vLLM's engine sockets and KV-transfer side channels) include
weight updates whose payloads are pickled tensors: whoever reaches such a port can replace the policy's weights or
run code in the engine. The adapter always talks to its own engine on the same host, so loopback is enough; a
non-loopback address is for trusted networks only and must be asked for with `rollout.allow_remote_access`.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) resolves to a loopback address only; unresolvable names are not."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def require_loopback(host: str, setting: str, allow_remote_access: bool) -> None:
    """Refuse a non-loopback `host` (the value of `setting`) unless remote access was allowed explicitly."""
    if allow_remote_access or is_loopback(host):
        return
    raise ValueError(
        f"{setting}={host!r} is not a loopback address: the inference server's weight-update endpoints take "
        "pickled tensors, so anyone who reaches that address could replace the weights or run code in the engine. "
        "Keep 127.0.0.1, or set rollout.allow_remote_access=true on a trusted network only."
    )


def url_host(url: str) -> str:
    return urlsplit(url).hostname or ""
