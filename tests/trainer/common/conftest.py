"""Fixtures of the tests that run a multi-process TensorFlow cluster on this machine."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from include.sample_data import digits as digits_data


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The generated digits, 30 images per class, extracted."""
    root = tmp_path_factory.mktemp("digits")
    digits_data.main(["--out", str(root / "d.zip"), "--per-class", "30"])
    with zipfile.ZipFile(root / "d.zip") as archive:
        archive.extractall(root / "data")
    return root / "data"
