"""Write an image-classification dataset: a zip of class folders of PNG handwritten digits.

The images are scikit-learn's bundled 8x8 digits (1,797 of them, ten classes), upscaled.
The zip holds one top-level folder, ``digits/``, with a folder per class, which is the
layout the image classifier expects after extraction. ``--corrupt N`` adds N files that
are not readable images (truncated PNGs, random bytes, text, empty files) spread over the
class folders, to exercise the classifier's skipping. Same arguments, same bytes: entry
timestamps are fixed and the order is sorted.

Usage: python -m include.sample_data.digits --out digits.zip [--size 32] [--corrupt 4] [--shifts 8]
"""

from __future__ import annotations

import argparse
import io
import random
import sys
import zipfile
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits

FIXED_TIME = (1980, 1, 1, 0, 0, 0)  # the earliest time a zip entry can carry
TOP = "digits"
CORRUPT_KINDS = ("truncated", "garbage", "text", "empty")


# Whole-pixel shifts of the 8x8 digits, the first the original: --shifts K writes each digit at the first K.
SHIFTS = ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1), (1, 1), (-1, -1), (1, -1), (-1, 1))


def digit_pngs(
    size: int, classes: list[int], per_class: int | None, shifts: int = 1
) -> list[tuple[str, bytes]]:
    """(archive name, PNG bytes) for every selected digit image, in a stable order.

    With ``shifts`` above 1, each digit is also written moved by one pixel of its 8x8 grid in the next
    ``shifts - 1`` directions of :data:`SHIFTS` (``<label>_<index>_s<k>.png``): a larger dataset of the
    same digits, for what must be measured at more than 1,797 images.
    """
    digits = load_digits()
    counts: dict[int, int] = {}
    entries = []
    for index, (pixels, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        label = int(label)
        if label not in classes or (per_class is not None and counts.get(label, 0) >= per_class):
            continue
        counts[label] = counts.get(label, 0) + 1
        # Values are 0..16 ink intensities; stretch to the 8-bit range before upscaling.
        gray = np.clip(np.rint(pixels * (255.0 / 16.0)), 0, 255).astype(np.uint8)
        for k, (dx, dy) in enumerate(SHIFTS[:shifts]):
            moved = np.roll(gray, (dy, dx), axis=(0, 1)) if k else gray
            image = Image.fromarray(moved, mode="L").resize((size, size), Image.Resampling.BICUBIC)
            buf = io.BytesIO()
            image.save(buf, format="PNG", optimize=False)
            name = f"{label}_{index:04d}" + (f"_s{k}" if k else "")
            entries.append((f"{TOP}/{label}/{name}.png", buf.getvalue()))
    return entries


def corrupt_files(count: int, classes: list[int], sample_png: bytes, seed: int) -> list[tuple[str, bytes]]:
    """``count`` files in the class folders that no image decoder can read."""
    rng = random.Random(seed)
    files = []
    for i in range(count):
        kind = CORRUPT_KINDS[i % len(CORRUPT_KINDS)]
        label = classes[i % len(classes)]
        folder = f"{TOP}/{label}"
        if kind == "truncated":
            files.append((f"{folder}/broken_{i:03d}.png", sample_png[: len(sample_png) // 2]))
        elif kind == "garbage":
            files.append((f"{folder}/garbage_{i:03d}.png", bytes(rng.getrandbits(8) for _ in range(256))))
        elif kind == "text":
            files.append((f"{folder}/notes_{i:03d}.txt", b"scanned at the post office, batch 7\n"))
        else:
            files.append((f"{folder}/empty_{i:03d}.jpg", b""))
    return files


def write_zip(out: Path, entries: list[tuple[str, bytes]]) -> None:
    """Write entries sorted by name with fixed timestamps and permissions."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    with zipfile.ZipFile(tmp, "w") as archive:
        for name, data in sorted(entries):
            info = zipfile.ZipInfo(name, date_time=FIXED_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            archive.writestr(info, data)
    tmp.replace(out)


def parse_classes(text: str) -> list[int]:
    """``"0,1,7"`` -> [0, 1, 7], refusing anything but distinct digits."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated digits 0-9, got {text!r}") from None
    if not values or any(v < 0 or v > 9 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct comma-separated digits 0-9, got {text!r}")
    return sorted(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m include.sample_data.digits",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", required=True, type=Path, help="zip file to write")
    parser.add_argument("--size", type=int, default=32, help="image side in pixels (default: 32)")
    parser.add_argument("--corrupt", type=int, default=0, help="unreadable files to add (default: 0)")
    parser.add_argument(
        "--classes",
        type=parse_classes,
        default=list(range(10)),
        help="digits to include, comma-separated (default: all ten)",
    )
    parser.add_argument("--per-class", type=int, default=None, help="at most this many images per class")
    parser.add_argument("--seed", type=int, default=0, help="seed of the corrupt files' bytes (default: 0)")
    parser.add_argument(
        "--shifts",
        type=int,
        default=1,
        help=f"write each digit at this many positions, 1 to {len(SHIFTS)}: itself, then moved a pixel "
        "(default: 1)",
    )
    args = parser.parse_args(argv)
    if not 8 <= args.size <= 1024:
        parser.error(f"--size must be from 8 to 1024 pixels, got {args.size}")
    if args.corrupt < 0:
        parser.error(f"--corrupt must be >= 0, got {args.corrupt}")
    if args.per_class is not None and args.per_class < 1:
        parser.error(f"--per-class must be >= 1, got {args.per_class}")
    if not 1 <= args.shifts <= len(SHIFTS):
        parser.error(f"--shifts must be from 1 to {len(SHIFTS)}, got {args.shifts}")
    if args.out.suffix != ".zip":
        parser.error(f"--out must name a .zip file, got {str(args.out)!r}")

    images = digit_pngs(args.size, args.classes, args.per_class, args.shifts)
    broken = corrupt_files(args.corrupt, args.classes, images[0][1], args.seed)
    write_zip(args.out, images + broken)
    print(
        f"wrote {args.out}: {len(images)} images in {len(args.classes)} classes, {len(broken)} unreadable files"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
