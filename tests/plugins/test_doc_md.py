"""Operators show their docstrings as the task's documentation in the UI (doc_md), as Markdown."""

from __future__ import annotations

import re

import pytest
from airflow.sdk import DAG, BaseOperator

import kubetrain
from kubetrain.doc_md import class_doc_md

OPERATORS = [name for name in kubetrain.__all__ if name.endswith("Operator")]


class Documented:
    """Do one thing, as :class:`~kubetrain.pod_spec.TrainingPodConfig` says, with ``x=1``.

    A literal block follows::

        python train.py

    :param name: the name, see :func:`kubetrain.s3_layout.check_name`;
        it continues here. (templated)
    :param size: the size.
    :raises ValueError: when it is bad.
    """


def test_sphinx_docstring_becomes_markdown():
    assert class_doc_md(Documented) == (
        "### Documented\n\n"
        "Do one thing, as `TrainingPodConfig` says, with `x=1`.\n\n"
        "A literal block follows:\n\n"
        "    python train.py\n\n"
        "**Arguments**\n\n"
        "- `name`: the name, see `kubetrain.s3_layout.check_name`; it continues here. (templated)\n"
        "- `size`: the size.\n\n"
        "**Raises**\n\n"
        "- `ValueError`: when it is bad.\n"
    )


@pytest.mark.parametrize("name", OPERATORS)
def test_every_public_operator_documents_its_tasks(name):
    cls = getattr(kubetrain, name)
    assert issubclass(cls, BaseOperator)
    doc = class_doc_md(cls)
    assert doc.startswith(f"### {name}\n\n") and "**Arguments**" in doc
    assert not re.search(r":(param|class|func|meth|mod)[ :`]", doc), doc
    assert "``" not in doc


def test_a_training_task_shows_its_operators_doc_unless_the_dag_gives_one():
    from kubetrain.operators.report import ReportOperator
    from kubetrain.operators.training import TrainingPodOperator

    with DAG("doc_md_check", schedule=None):
        train = TrainingPodOperator(task_id="train", image="i@sha256:" + "a" * 64, cmds=["python"])
        report = ReportOperator(task_id="report")
        own = ReportOperator(task_id="own", doc_md="Our own words.")
    assert train.doc_md == class_doc_md(TrainingPodOperator) and "logging_interval" in train.doc_md
    assert report.doc_md.startswith("### ReportOperator")
    assert own.doc_md == "Our own words."
