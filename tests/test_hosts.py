"""Host-list parsing, hostfiles, slot assignment and local-host detection."""

import socket

import psutil
import pytest

from roundel.rendezvous.identity import Identity
from roundel.runner.hosts import assign_slots, is_local_host, parse_hostfile, parse_hosts


def table(hosts, np):
    return [
        (s.rank, s.hostname, s.local_rank, s.local_size, s.cross_rank, s.cross_size, s.size)
        for s in assign_slots(hosts, np)
    ]


def test_two_even_hosts():
    assert table([("a", 2), ("b", 2)], 4) == [
        (0, "a", 0, 2, 0, 2, 4),
        (1, "a", 1, 2, 0, 2, 4),
        (2, "b", 0, 2, 1, 2, 4),
        (3, "b", 1, 2, 1, 2, 4),
    ]


def test_uneven_hosts():
    assert table([("a", 3), ("b", 1)], 4) == [
        (0, "a", 0, 3, 0, 2, 4),
        (1, "a", 1, 3, 0, 1, 4),
        (2, "a", 2, 3, 0, 1, 4),
        (3, "b", 0, 1, 1, 2, 4),
    ]


def test_fewer_ranks_than_slots():
    assert table([("a", 2), ("b", 2)], 3) == [
        (0, "a", 0, 2, 0, 2, 3),
        (1, "a", 1, 2, 0, 1, 3),
        (2, "b", 0, 1, 1, 2, 3),
    ]
    # A host that gets no rank does not count in cross sizes.
    assert table([("a", 2), ("b", 2), ("c", 2)], 3) == table([("a", 2), ("b", 2)], 3)
    assert table([("a", 4), ("b", 4)], 2) == [(0, "a", 0, 2, 0, 1, 2), (1, "a", 1, 2, 0, 1, 2)]


def test_three_hosts():
    assert table([("a", 2), ("b", 1), ("c", 2)], 5) == [
        (0, "a", 0, 2, 0, 3, 5),
        (1, "a", 1, 2, 0, 2, 5),
        (2, "b", 0, 1, 1, 3, 5),
        (3, "c", 0, 2, 2, 3, 5),
        (4, "c", 1, 2, 1, 2, 5),
    ]


def test_slots_convert_to_valid_identities():
    for slot in assign_slots([("a", 3), ("b", 2), ("c", 1)], 6):
        ident = slot.to_identity()
        assert isinstance(ident, Identity)
        ident.validate()
        assert ident.hostname == slot.hostname and ident.rank == slot.rank


def test_too_many_ranks():
    with pytest.raises(ValueError, match=r"requested -np 5 but the hosts offer only 4 slots \(a:2,b:2\)"):
        assign_slots([("a", 2), ("b", 2)], 5)
    with pytest.raises(ValueError, match="at least 1"):
        assign_slots([("a", 2)], 0)


def test_parse_hosts():
    assert parse_hosts("a:2,b:2") == [("a", 2), ("b", 2)]
    assert parse_hosts("a, b:3") == [("a", 1), ("b", 3)]
    assert parse_hosts("10.0.0.1:4") == [("10.0.0.1", 4)]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("a:x", "slots of host 'a' must be a whole number, not 'x'"),
        ("a:2,a:1", "host 'a' is listed twice"),
        ("a:0", "host 'a' must offer at least 1 slot, not 0"),
        ("a:-1", "at least 1 slot"),
        ("a:2,,b", "'' is not a host name"),
        (":2", "'' is not a host name"),
    ],
)
def test_parse_hosts_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_hosts(spec)


def test_parse_hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# cluster\n\nnode1 slots=4\nnode2   slots=2  # spare\n  node3\n")
    assert parse_hostfile(str(path)) == [("node1", 4), ("node2", 2), ("node3", 1)]


@pytest.mark.parametrize(
    "text, message",
    [
        ("a slots=2\nb slots=x\n", r"line 2: slots of host 'b' must be a whole number"),
        ("a slots=2\na slots=1\n", "host 'a' is listed twice"),
        ("a cpus=2\n", r"line 1: expected 'host slots=N'"),
        ("a slots=0\n", "at least 1 slot"),
        ("# nothing\n\n", "no hosts given"),
    ],
)
def test_parse_hostfile_errors(tmp_path, text, message):
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        parse_hostfile(str(path))


def test_is_local_host():
    assert is_local_host("localhost")
    assert is_local_host("127.0.0.1")
    assert is_local_host("127.0.1.1")
    assert is_local_host("::1")
    assert is_local_host(socket.gethostname())
    assert not is_local_host("203.0.113.7")  # TEST-NET-3, never assigned
    assert not is_local_host("no-such-host.invalid")


def test_interface_addresses_are_local():
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family == socket.AF_INET:
                assert is_local_host(entry.address)
