"""A pytest plugin (``-p tests.helpers.marker_listing``): once collection ends, writes each collected test's id and
the names of its markers (its own, its class's and module's: what ``-m`` selects by) as JSON to the file named by
the ``MARKER_LISTING`` environment variable."""

from __future__ import annotations

import json
import os

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    marks = {item.nodeid: sorted({mark.name for mark in item.iter_markers()}) for item in session.items}
    with open(os.environ["MARKER_LISTING"], "w") as listing:
        json.dump(marks, listing)
