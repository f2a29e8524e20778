"""The builder whose store holds the images that the session's ``stack_images`` built."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubetrain.imagebuild.buildah import BuildahBuilder

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def image_builder() -> BuildahBuilder:
    return BuildahBuilder(REPO / ".tools" / "buildah", storage_driver="auto")
