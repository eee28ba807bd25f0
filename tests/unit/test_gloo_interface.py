"""gloo binds to the address a rank reaches rank 0's node (or the live store) by, not to its hostname's address."""

import socket

import psutil
import pytest

from outlast.train.gloo_bind import device_toward, interface_toward, local_address_toward, store_host


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


def test_a_route_to_loopback_leaves_from_loopback_and_no_host_has_no_route():
    assert local_address_toward("127.0.0.1") == "127.0.0.1"
    assert local_address_toward(None) is None and local_address_toward("not an address") is None


@pytest.mark.torch
def test_the_store_host_is_found_under_its_prefixes_and_a_store_without_one_has_none():
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert store_host(dist.PrefixStore("a", dist.PrefixStore("b", store))) == "127.0.0.1"
    assert store_host(store) == "127.0.0.1"
    assert store_host(dist.HashStore()) is None


@pytest.mark.torch
def test_a_live_group_takes_the_interface_the_user_named_over_the_route(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert device_toward("127.0.0.1") is None  # gloo reads the variable itself
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert device_toward("127.0.0.1") is not None
    assert device_toward(None) is None
