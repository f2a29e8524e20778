"""Operator docstrings as the Markdown the Airflow UI shows as a task's documentation.

Airflow shows a task's ``doc_md`` behind the "Task Docs" button of its task page; operators
leave it empty unless a DAG sets it. kubetrain's operators document themselves in Sphinx
docstrings (``:param x:``, ``:class:`~a.B```, ````literal````); :func:`class_doc_md` turns one
into Markdown, so that a task whose DAG gives no ``doc_md`` shows its operator's docstring.
"""

from __future__ import annotations

import inspect
import re
from functools import cache

_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj|py:\w+):`(~?)([^`]+)`")
_LITERAL = re.compile(r"``(.+?)``", re.S)
_FIELD = re.compile(r"^:(param|raises|return|returns)\s*([^:]*):\s*(.*)$")


def _role(match: re.Match) -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def _inline(text: str) -> str:
    return _LITERAL.sub(r"`\1`", _ROLE.sub(_role, text))


@cache
def class_doc_md(cls: type) -> str | None:
    """The class's docstring as Markdown: its text, then its ``:param:`` fields as a list of arguments.

    :param cls: an operator (or any documented) class.
    """
    doc = inspect.getdoc(cls)
    if not doc:
        return None
    lines = doc.splitlines()
    body: list[str] = []
    fields: list[list[str]] = []  # [kind, name, text]
    for line in lines:
        match = _FIELD.match(line)
        if match:
            fields.append([match.group(1), match.group(2).strip(), match.group(3).strip()])
        elif fields and line.startswith((" ", "\t")) and line.strip():
            fields[-1][2] += " " + line.strip()
        elif fields and not line.strip():
            continue
        else:
            body.append(line[:-1] if line.endswith("::") else line)  # a Sphinx literal block's "::" is a ":"
    while body and not body[-1].strip():
        body.pop()
    title, rest = body[0], body[1:]
    out = [f"### {cls.__name__}", "", _inline("\n".join([title, *rest]))]
    arguments = [f for f in fields if f[0] == "param"]
    if arguments:
        out += ["", "**Arguments**", ""]
        out += [f"- `{name}`: {_inline(text)}" for _, name, text in arguments]
    raises = [f for f in fields if f[0] == "raises"]
    if raises:
        out += ["", "**Raises**", ""]
        out += [f"- `{name}`: {_inline(text)}" for _, name, text in raises]
    return "\n".join(out).strip() + "\n"
