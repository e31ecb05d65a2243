"""Which network interface gloo and NCCL open their sockets on.

Left alone, gloo binds the address its host name resolves to, and NCCL picks interfaces by its
own rules (InfiniBand first, then any that is not loopback or docker) — possibly one the job
does not otherwise use. Before the first gloo/NCCL group of a rank (two-rank links, the DDP
process group), `pin_socket_interfaces` sets ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``
to the interface that carries the host name's address, unless the user set them: both then
listen where MPI's own traffic goes, and only there. A host name that resolves to loopback
(Debian's /etc/hosts) pins nothing: NCCL across nodes must not be sent to ``lo``, and gloo
binds that address by itself.

>>> address_interface("127.0.0.1", {"lo": ["127.0.0.1"], "eth0": ["192.0.2.2"]})
'lo'
>>> address_interface("127.0.1.1", {"lo": ["127.0.0.1"], "eth0": ["192.0.2.2"]})  # Debian's /etc/hosts
'lo'
>>> address_interface("198.51.100.7", {"lo": ["127.0.0.1"]}) is None
True
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import socket

log = logging.getLogger("rlinf_hpc.comm")

VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def address_interface(address: str, interfaces: dict[str, list[str]]) -> str | None:
    """The interface among ``interfaces`` (name -> addresses) that holds ``address``; a
    loopback address (all of 127.0.0.0/8) belongs to the loopback interface."""
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return None
    for name, addresses in interfaces.items():
        for text in addresses:
            try:
                candidate = ipaddress.ip_address(text.split("%")[0])
            except ValueError:  # a MAC address
                continue
            if candidate == wanted or (wanted.is_loopback and candidate.is_loopback):
                return name
    return None


def _interfaces() -> dict[str, list[str]]:
    import psutil

    return {name: [a.address for a in addrs] for name, addrs in psutil.net_if_addrs().items()}


def pin_socket_interfaces() -> dict[str, str]:
    """Set the variables the user left unset to the host name's interface; returns what this
    call set (nothing when the host name does not resolve to an address of this node's)."""
    missing = [name for name in VARIABLES if not os.environ.get(name)]
    interface = host_interface() if missing else None
    if interface is None:
        return {}
    for name in missing:
        os.environ[name] = interface
    return dict.fromkeys(missing, interface)


@functools.cache
def host_interface() -> str | None:
    """The non-loopback interface holding the host name's address, or None (looked up once per
    process: every new gloo/NCCL group asks, and a name lookup may wait on DNS)."""
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        log.info("host name %s does not resolve: gloo/NCCL choose their own interfaces", host)
        return None
    if ipaddress.ip_address(address).is_loopback:
        return None
    interface = address_interface(address, _interfaces())
    if interface is None:
        log.info("no interface of this node holds %s (%s): gloo/NCCL choose their own", address, host)
    return interface
