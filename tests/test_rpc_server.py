"""`moeplug rpc-server`: the patched build's ggml-rpc-server on a loopback port, asked for its device by
llama-server of the same build, stopped by a signal; the addresses and ports it refuses, in one line."""

from __future__ import annotations

from moeplug.machine.rpc import exposure


def test_exposure_warns_beyond_loopback_and_private_networks() -> None:
    for quiet in ("127.0.0.1", "::1", "10.1.2.3", "192.168.0.7", "172.16.0.1"):
        assert exposure(quiet) is None, quiet
    assert "8.8.8.8" in (exposure("8.8.8.8") or "")
    # every address of the machine holds its public ones (Python's ipaddress counts 0.0.0.0 as private)
    for wildcard in ("0.0.0.0", "::"):
        assert "every address of this machine" in (exposure(wildcard) or ""), wildcard
