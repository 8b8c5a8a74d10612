"""Native exactness tests of the expert split, run from the patched build."""

from __future__ import annotations

import subprocess

import pytest

pytestmark = pytest.mark.native


def test_moe_split_is_bitwise(patched_build) -> None:
    """mmid(A, ids) == mmid(A, ids_host) + mmid(A_slots, ids_slot), bitwise, with and without
    expert biases: f32/f16/q8_0/q4_0/q4_K, plain and repacked, 1..31 tokens, 1/4/16 threads."""
    r = subprocess.run([str(patched_build.binary("test-moe-split"))], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[-1].startswith("test-moe-split: ") and lines[-1].endswith(" passed, 0 failed")
    assert int(lines[-1].split()[1]) >= 5 * 4 * 3 * 31  # every plain type x residency x threads x batch size
    for t in ("f32", "f16", "q8_0", "q4_0", "q4_K"):
        assert any(line.split()[:2] == [t, "CPU"] and line.endswith("bitwise equal") for line in lines), t
    # repacked weights, where this CPU has a repacked layout (x86 with AVX2 has one for Q4_0)
    repacked = [line for line in lines if "CPU_REPACK" in line]
    assert repacked and all(line.endswith(("bitwise equal", "skipped")) for line in repacked)
