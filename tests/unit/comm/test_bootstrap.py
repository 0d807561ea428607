"""The rendezvous address of a configured interface (comm/bootstrap.py), read with psutil."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import psutil
import pytest

from pipespec_mpi.comm.bootstrap import InterfaceError, _iface_address
from pipespec_mpi.errors import UserError


def addr(family, address):
    return SimpleNamespace(family=family, address=address, netmask=None, broadcast=None, ptp=None)


def test_loopback_address():
    assert _iface_address("lo") == "127.0.0.1"


def test_first_ipv4_address_of_the_interface(monkeypatch):
    table = {
        "ib0": [addr(psutil.AF_LINK, "80:00:00:48"), addr(socket.AF_INET6, "fe80::1"),
                addr(socket.AF_INET, "10.1.2.3"), addr(socket.AF_INET, "10.9.9.9")],
        "eth0": [addr(socket.AF_INET, "192.168.0.4")],
    }  # fmt: skip
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: table)
    assert _iface_address("ib0") == "10.1.2.3"
    assert _iface_address("eth0") == "192.168.0.4"


def test_unknown_interface_or_no_ipv4_is_a_user_error(monkeypatch):
    table = {"eth0": [addr(socket.AF_INET, "192.168.0.4")], "ib0": [addr(socket.AF_INET6, "fe80::1")]}
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: table)
    with pytest.raises(InterfaceError, match=r"transport.iface=eth9: no such network interface.*eth0, ib0"):
        _iface_address("eth9")
    with pytest.raises(InterfaceError, match="ib0: the interface has no IPv4 address") as err:
        _iface_address("ib0")
    assert isinstance(err.value, UserError)


def test_the_rendezvous_interface_is_the_one_on_every_hosts_network():
    from pipespec_mpi.comm.bootstrap import pick_interface

    mask = "255.255.255.0"
    mine = {"lo": [("127.0.0.1", "255.0.0.0")], "eth0": [("192.168.5.2", mask)], "ib0": [("10.9.0.1", mask)]}
    other = {"lo": [("127.0.0.1", "255.0.0.0")], "eth0": [("192.168.7.2", mask)], "ib0": [("10.9.0.2", mask)]}
    third = {"ib0": [("10.9.0.3", mask)], "eth0": [("192.168.5.3", mask)]}
    assert pick_interface(mine, [other]) == "ib0"  # eth0 is on another subnet than other's
    assert pick_interface(mine, [other, third]) == "ib0"
    assert pick_interface(mine, [third]) == "eth0"  # both shared: the first by name
    assert pick_interface(mine, [{"lo": [("127.0.0.1", "255.0.0.0")]}]) is None  # loopback never
    assert pick_interface({"lo": [("127.0.0.1", "255.0.0.0")]}, [other]) is None
