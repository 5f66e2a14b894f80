"""The rendezvous port of turnout.launch: free when chosen, and outside the
range the kernel hands to outgoing connections, so that no connection the
starting ranks make can take it before rank 0 listens."""
import socket

from turnout import launch


def test_the_port_binds_and_lies_below_the_outgoing_range():
    lo, _ = launch._outgoing_port_range()
    for _ in range(20):
        port = launch.free_port()
        assert launch._binds(port)
        assert launch._LOWEST_PORT <= port < lo


def test_a_port_in_use_is_passed_over(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("", 0))
        held.listen()
        busy = held.getsockname()[1]
        monkeypatch.setattr(launch, "_outgoing_port_range", lambda: (busy + 100, 60999))
        monkeypatch.setattr(launch.random, "sample", lambda population, k: [busy, busy + 1][:k])
        assert not launch._binds(busy)
        assert launch.free_port(tries=2) == busy + 1


def test_the_range_is_read_from_the_kernel_or_defaults(tmp_path):
    path = tmp_path / "ip_local_port_range"
    path.write_text("20000\t30000\n")
    assert launch._outgoing_port_range(str(path)) == (20000, 30000)
    path.write_text("garbage\n")
    assert launch._outgoing_port_range(str(path)) == (32768, 60999)
    assert launch._outgoing_port_range(str(tmp_path / "missing")) == (32768, 60999)


def test_no_room_below_the_range_falls_back_to_a_kernel_port(monkeypatch):
    monkeypatch.setattr(launch, "_outgoing_port_range", lambda: (launch._LOWEST_PORT + 10, 60999))
    port = launch.free_port()
    assert 0 < port < 65536 and launch._binds(port)
