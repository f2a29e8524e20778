"""The folder scan reads headers only: refusals and counts, decompression bombs, and files whose pixels
are broken, which the prepared copy names when it decodes them."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from trainer.common.contract import DataError
from trainer.image_classifier.data import check_image, scan_image_folder


@pytest.fixture
def two_classes(tmp_path) -> Path:
    root = tmp_path / "data"
    rng = np.random.default_rng(3)
    for name in ("cat", "dog"):
        (root / name).mkdir(parents=True)
        for i in range(5):
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(root / name / f"{i}.png")
    return root


def png_header_only(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims width x height pixels, with one row of data: what a decompression
    bomb looks like to a reader before it decodes."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )
    return path


def test_a_decompression_bomb_is_skipped_and_counted_without_decoding(two_classes):
    bomb = png_header_only(two_classes / "dog" / "huge.png", 30_000, 30_000)
    assert check_image(str(bomb)).startswith("decompression bomb: Image size (900000000 pixels) exceeds")
    folder = scan_image_folder(two_classes)
    assert len(folder.files) == 10
    assert [(path, why.split(":")[0]) for path, why in folder.skipped] == [
        ("dog/huge.png", "decompression bomb")
    ]


def test_the_scan_reads_headers_and_leaves_the_pixels_to_the_prepared_copy(two_classes, monkeypatch):
    png_header_only(two_classes / "cat" / "cut.png", 8, 8)  # a whole header, broken pixel data
    (two_classes / "cat" / "notes.png").write_text("not an image")
    Image.new("RGB", (4, 4)).save(two_classes / "dog" / "scan.tiff")
    loads = []
    monkeypatch.setattr(Image.Image, "load", lambda self: loads.append(self) or None)
    folder = scan_image_folder(two_classes)
    assert loads == []
    assert sorted(folder.skipped) == [
        ("cat/notes.png", "not an image"),
        ("dog/scan.tiff", "format TIFF is not decodable (expected one of PNG, JPEG, GIF, BMP, WEBP)"),
    ]
    assert len(folder.files) == 11 and folder.class_names == ["cat", "dog"]


def test_a_single_class_is_refused_naming_it(two_classes):
    for path in (two_classes / "dog").iterdir():
        path.write_text("no image")
    with pytest.raises(DataError, match=r"only one class \('cat'\) has readable images"):
        scan_image_folder(two_classes)
