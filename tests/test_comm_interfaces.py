"""`comm.interfaces`: gloo/NCCL sockets pinned to the host name's interface, never over the
user's choice, never to loopback."""

from __future__ import annotations

import os
import socket

import pytest

from rlinf_hpc.comm import interfaces

ADDRESSES = {"lo": ["127.0.0.1", "::1"], "eth0": ["192.0.2.2", "fe80::1%eth0", "02:fc:00:00:00:01"]}


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch):
    for name in interfaces.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(interfaces, "_interfaces", lambda: ADDRESSES)
    interfaces.host_interface.cache_clear()  # looked up once per process

    def resolve_to(address: str | None) -> None:
        def gethostbyname(host: str) -> str:
            if address is None:
                raise socket.gaierror("unknown host")
            return address

        monkeypatch.setattr(interfaces.socket, "gethostbyname", gethostbyname)

    yield resolve_to
    interfaces.host_interface.cache_clear()  # the faked node's answer must not outlive the test


def test_both_variables_follow_the_host_names_interface(node, monkeypatch: pytest.MonkeyPatch) -> None:
    node("192.0.2.2")
    assert interfaces.pin_socket_interfaces() == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "eth0"


def test_the_users_choice_is_kept(node, monkeypatch: pytest.MonkeyPatch) -> None:
    node("192.0.2.2")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    assert interfaces.pin_socket_interfaces() == {"GLOO_SOCKET_IFNAME": "eth0"}
    assert os.environ["NCCL_SOCKET_IFNAME"] == "ib0"


@pytest.mark.parametrize("address", ["127.0.1.1", "198.51.100.7", None])
def test_loopback_foreign_or_unresolvable_names_pin_nothing(node, address: str | None) -> None:
    node(address)
    assert interfaces.pin_socket_interfaces() == {}
    assert not any(os.environ.get(name) for name in interfaces.VARIABLES)
