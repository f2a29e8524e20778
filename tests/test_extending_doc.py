"""docs/extending.md says what the repository holds: its DAG, its Dockerfile and its list of public names."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import kubetrain

REPO = Path(__file__).resolve().parents[1]
GUIDE = (REPO / "docs" / "extending.md").read_text()
DAG_FILE = REPO / "dags" / "example_keras_model.py"


def code_blocks(text: str, language: str = "") -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def test_the_guides_dag_is_the_dag_file():
    source = DAG_FILE.read_text()
    code = source[source.index("from __future__ import annotations") :]
    assert code_blocks(GUIDE, "python")[0] == code
    assert len(code.strip().splitlines()) <= 40, "the guide promises a DAG of about 30 lines"


def test_the_guides_dockerfile_is_the_example_image():
    dockerfile = (REPO / "docs" / "examples" / "keras_model" / "Dockerfile").read_text()
    instructions = [line for line in dockerfile.splitlines() if line and not line.startswith("#")]
    for line in instructions:
        assert f"    {line}\n" in GUIDE, line


def test_the_public_names_are_the_packages():
    table = GUIDE[GUIDE.index("## 6. Public API") : GUIDE.index("## 7.")]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    listed = {}
    for row in rows:
        names_cell, modules_cell = row.split("|")[1:3]
        modules = [m.strip() for m in modules_cell.split(",")]
        for name in re.findall(r"`(\w+)`", names_cell):
            listed[name] = modules
    assert sorted(listed) == sorted(kubetrain.__all__)
    for name, modules in listed.items():
        assert any(hasattr(importlib.import_module(m), name) for m in modules), (name, modules)
        assert getattr(kubetrain, name) is not None


def test_the_guides_commands_name_the_interpreters_make_setup_makes():
    # the dev-stack blocks (```bash) run as written (tests/e2e/test_extending_guide.py); here only what
    # a reader without the dev stack can check: no bare `python` or `airflow`, which a fresh shell lacks
    blocks = code_blocks(GUIDE, "bash")
    assert blocks, "docs/extending.md marks its dev-stack commands as ```bash blocks"
    for line in "".join(blocks).splitlines():
        for word in {"python", "python3", "airflow", "pytest"} & set(line.split()):
            raise AssertionError(
                f"{line!r}: name the environment's {word} (.venv/bin/ or trainer/.venv/bin/)"
            )
    for interpreter in re.findall(r"(?:^|\s)((?:trainer/)?\.venv/bin/\w+)", "".join(blocks)):
        assert (REPO / interpreter).exists(), f"{interpreter} is missing: `make setup` makes it"
    assert (REPO / "tests" / "e2e" / "test_extending_guide.py").exists()
    assert "test_extending_guide.py" in GUIDE


def test_the_shipped_dags_import_only_the_public_api():
    """A DAG of the repository is an example users copy: it imports kubetrain's public names, from ``kubetrain``,
    at module level and in its task bodies alike."""
    import ast

    for path in sorted((REPO / "dags").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kubetrain"):
                assert node.module == "kubetrain", f"{path.name} imports from {node.module}"
                names = {alias.name for alias in node.names}
                assert names <= set(kubetrain.__all__), (
                    f"{path.name}: {sorted(names - set(kubetrain.__all__))}"
                )
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("kubetrain") for a in node.names), path.name
