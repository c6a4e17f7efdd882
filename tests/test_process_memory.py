"""A measuring child's peak memory is its own, however large the process that started it."""
from __future__ import annotations

import subprocess
import sys

from specroll.benchmarks.process_memory import peak_resident_bytes, reset_peak, resident_bytes

MIB = 1024 ** 2
CHILD = """
from specroll.benchmarks.process_memory import peak_resident_bytes, reset_peak, resident_bytes
reset_peak()
before = resident_bytes()
block = bytearray(64 * 1024 ** 2)
block[::4096] = b"\\x01" * len(block[::4096])
print(peak_resident_bytes() - before)
"""


def test_a_child_started_by_a_large_process_reports_its_own_peak():
    held = bytearray(512 * MIB)
    held[::4096] = b"\x01" * len(held[::4096])  # the pages are resident in this process
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    assert 60 * MIB <= int(out.stdout) <= 80 * MIB
    del held


def test_the_peak_starts_again_from_what_is_held_at_a_reset():
    block = bytearray(128 * MIB)
    block[::4096] = b"\x01" * len(block[::4096])
    del block
    reset_peak()
    assert peak_resident_bytes() - resident_bytes() < 16 * MIB
