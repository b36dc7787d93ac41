"""The CPU container image for users (``images/Containerfile.cpu``): built with podman from a
base made here, and the demo run in it ends bit-identical. Minutes of building: marked long
(``XMIG_LONG_TESTS=1``); ``sudo bash scripts/build-image.sh`` does the same by hand."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from container_harness import bounded
from helpers import REPO

BUILD_TIMEOUT_S = 1800.0

pytestmark = [
    pytest.mark.long,
    pytest.mark.skipif(os.geteuid() != 0, reason="podman and debootstrap as root"),
    pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed"),
    pytest.mark.skipif(shutil.which("debootstrap") is None, reason="debootstrap is not installed"),
]


def test_the_cpu_image_builds_and_its_demo_ends_bit_identical(measure):
    tag = "localhost/xmig-test:cpu"
    done = bounded(["bash", str(REPO / "scripts" / "build-image.sh"), tag], BUILD_TIMEOUT_S)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert "bit-identical:  yes" in output, output[-3000:]
    for line in output.splitlines():
        if line.startswith("build-image: built") or line.startswith("build-image: demo in"):
            measure(line)
    subprocess.run(["podman", "rmi", "-f", tag], capture_output=True, timeout=120, check=False)
