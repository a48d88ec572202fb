"""``relative_source``: what ``tokrag serve --sources-relative-to`` shows a client of a
stored path (issue 43, case 21)."""

from __future__ import annotations

import pytest

from tokrag_integrations.postgres.store import relative_source


@pytest.mark.parametrize(
    ("source", "root", "shown"),
    [
        ("/srv/docs/leave.md", "/srv/docs", "leave.md"),
        ("/srv/docs/hr/leave.md", "/srv/docs", "hr/leave.md"),
        ("/srv/docs/hr/leave.md", "/srv/docs/", "hr/leave.md"),
        ("/srv/docs-old/leave.md", "/srv/docs", "leave.md"),  # a prefix, not a parent folder
        ("/etc/passwd", "/srv/docs", "passwd"),  # outside: the file name alone
        ("/srv/docs/../etc/passwd", "/srv/docs", "passwd"),  # never a path out of the folder
    ],
)
def test_a_source_is_shown_relative_to_the_folder_or_by_its_name(source, root, shown):
    assert relative_source(source, root) == shown
