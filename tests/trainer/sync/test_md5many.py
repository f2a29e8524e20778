"""trainer.sync.md5many: the multi-buffer MD5 against hashlib's, on this machine's CPU."""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import subprocess
import sys

import pytest
from sync_support import REPO

from trainer.sync import md5many

# MD5 pads to 64-byte blocks with at least 9 bytes: lengths around 55/56/64 change the tail
EDGES = [0, 1, 3, 55, 56, 57, 63, 64, 65, 119, 120, 121, 127, 128, 129, 4095, 4096, 70_000]


def _cpu_lanes() -> int:
    flags = set(re.findall(r"^flags\s*:(.*)$", open("/proc/cpuinfo").read(), re.M)[0].split())
    return 16 if "avx512f" in flags else 8 if "avx2" in flags else 0


def test_the_checkout_has_the_library_and_uses_every_lane_this_cpu_has():
    # `make setup` builds it; without it stage-in would quietly hash one object at a time
    assert md5many.LIBRARY.exists(), f"{md5many.LIBRARY} is missing: run `make setup`"
    assert md5many.lanes() == _cpu_lanes()
    assert md5many.unavailable() == ("" if _cpu_lanes() else "this CPU has neither AVX-512 nor AVX2")


@pytest.mark.parametrize("width", [16, 8])
@pytest.mark.parametrize("count", [0, 1, 2, 7, 8, 9, 15, 16, 17, 40])
def test_every_digest_is_hashlibs(width, count):
    if width > md5many.lanes():
        pytest.skip(f"this CPU has {md5many.lanes()} lanes")
    rnd = random.Random(count * width)
    buffers = [os.urandom(rnd.choice(EDGES + [rnd.randrange(300_000)])) for _ in range(count)]
    assert md5many.md5_many(buffers, width=width) == [hashlib.md5(b).digest() for b in buffers]


def test_lanes_refill_while_long_buffers_run():
    """One long buffer beside many short ones: each short one ends and its lane takes the next."""
    buffers = [os.urandom(2_000_000)] + [os.urandom(n) for n in range(0, 3000, 13)]
    assert md5many.md5_many(buffers) == [hashlib.md5(b).digest() for b in buffers]


def test_a_width_above_the_cpu_s_is_refused():
    with pytest.raises(ValueError, match=rf"width 32: this machine hashes at most {md5many.lanes()} buffers"):
        md5many.md5_many([b"a", b"b"], width=32)


def test_without_the_library_hashlib_does_the_work(tmp_path):
    """The package alone (no compiled library beside it): the same digests, and it says why."""
    shutil.copytree(
        REPO / "trainer" / "sync", tmp_path / "trainer" / "sync", ignore=shutil.ignore_patterns("*.so")
    )
    probe = (
        "import hashlib\n"
        "from trainer.sync import md5many\n"
        "b = [bytes([i]) * i for i in range(30)]\n"
        "assert md5many.md5_many(b) == [hashlib.md5(x).digest() for x in b]\n"
        "print(md5many.lanes(), md5many.unavailable())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("0 _md5many.so not loaded ("), out.stdout
