"""`make demo` builds only what the demo runs; `make test` and `make stack-up` still build the whole mirror.

The Makefile is asked what it would run (``make -n -B``: every target out of date, nothing run) for
the targets that build no sub-make, and for its variables (a rule that prints one), so the tests
read the Makefile's own answer rather than its text.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from include.devstack import mirror

REPO = Path(__file__).resolve().parents[1]
FULL_BUILD = "-m include.devstack.mirror build\n"  # the full mirror's build: no --only
DEMO_BUILD = "-m include.devstack.mirror build --only busybox,alpine,python"


def dry_run(*args: str) -> str:
    out = subprocess.run(
        ["make", "-n", "-B", "--no-print-directory", *args], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def variable(name: str) -> str:
    out = subprocess.run(
        ["make", "--no-print-directory", "--eval", f"print-var: ; @echo '$({name})'", "print-var"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_demos_stack_gets_the_demo_mirror_and_the_tensorflow_base_beside_it():
    ready = variable("DEMO_READY")
    assert f"STACK_MIRROR={variable('MIRROR_DEMO')}" in ready
    assert "-j" in ready and "stack-images" in ready and variable("TENSORFLOW_BASE") in ready
    plan = dry_run(f"STACK_MIRROR={variable('MIRROR_DEMO')}", "stack-up", variable("TENSORFLOW_BASE"))
    assert DEMO_BUILD in plan
    assert FULL_BUILD not in plan, (
        "the demos' stack builds the whole mirror (buildah and tensorflow stand-ins)"
    )
    assert "-m include.devstack.mirror base" in plan


@pytest.mark.parametrize("target", ["stack-up", "test-airflow", "bench"])
def test_the_test_suite_and_stack_up_still_build_the_whole_mirror(target):
    assert FULL_BUILD in dry_run(target)


def test_make_test_readies_the_whole_mirror():
    assert variable("MIRROR") in variable("TEST_READY").split()


def test_the_demo_set_and_the_listing_it_writes():
    assert set(mirror.DEMO) < set(mirror.STANDINS)
    assert {mirror.IMAGES[name] for name in mirror.IMAGES} == set(mirror.STANDINS)


@pytest.mark.parametrize(
    ("only", "message"),
    [
        ("busybox,nginx", r"--only 'busybox,nginx': expected stand-ins among busybox, alpine, python"),
        ("", r"--only '': expected stand-ins among"),
    ],
)
def test_an_unknown_stand_in_is_refused_by_name(only, message, capsys):
    with pytest.raises(SystemExit):
        mirror.main(["build", "--only", only])
    assert message in capsys.readouterr().err


def test_build_refuses_an_unknown_stand_in_before_building_anything():
    with pytest.raises(ValueError, match=r"stand-ins nginx: expected some of busybox, alpine"):
        mirror.build(only=("nginx",))
