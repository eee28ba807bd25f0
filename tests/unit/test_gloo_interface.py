"""gloo binds to the interface a rank reaches rank 0's node through, not to its hostname's address."""

import socket

import psutil

from outlast.train.torch.backend import interface_toward


def _an_interface_with_a_non_loopback_address():
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return name, a.address
    return None, None


def test_loopback_rendezvous_binds_to_loopback():
    assert interface_toward("127.0.0.1") == "lo"


def test_a_rendezvous_on_this_hosts_address_binds_to_the_interface_holding_it():
    name, address = _an_interface_with_a_non_loopback_address()
    assert name is not None, "this host has no non-loopback IPv4 address to test with"
    assert interface_toward(address) == name


def test_no_address_or_an_unroutable_one_leaves_gloo_to_choose():
    assert interface_toward(None) is None
    assert interface_toward("not an address") is None
