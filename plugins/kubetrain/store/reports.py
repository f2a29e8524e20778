"""Run reports: ``<run>/report/`` (report.html, report.md, the plots), each with its Content-Type."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kubetrain.s3_layout import RunLocation, s3_uri

if TYPE_CHECKING:
    from kubetrain.run_store import RunStore

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".md": "text/markdown; charset=utf-8",
    ".png": "image/png",
}


class ReportRepository:
    """The report files of runs; a browser shows them, so each keeps its Content-Type.

    :param store: the S3 gateway.
    """

    def __init__(self, store: RunStore) -> None:
        self.store = store

    def write(self, run: RunLocation, files: dict[str, bytes]) -> str:
        """Write the report files into ``<run>/report/``; return the URI of ``report.html``.

        :param files: file name to bytes.
        """

        def typed(name: str) -> tuple[str, bytes, str]:
            content_type = CONTENT_TYPES.get(name[name.rfind(".") :], "application/octet-stream")
            return run.key("report", name), files[name], content_type

        # the files in parallel, then report.html: the page appears once what it links to is there
        self.store.write_files(run.bucket, [typed(name) for name in files if name != "report.html"])
        if "report.html" in files:
            self.store.write_files(run.bucket, [typed("report.html")])
        return s3_uri(run.bucket, run.key("report", "report.html"))
