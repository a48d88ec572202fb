"""Issue 29, files: symbolic links leaving the folder (3), unreadable sub-folders (6), file
names and documents holding newlines and escape sequences (10).

This file holds the cases that need no model, database or server; the others are in
``tests/integration/test_security_files.py``."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

SECRET = "The vault code is 4417-Quasar."


@pytest.fixture
def tree(tmp_path):
    """docs/ with a file, a link to a file outside, a link to a folder outside, a link inside
    and a broken link; outside/ with the secret."""
    outside = tmp_path / "outside"
    (outside / "folder").mkdir(parents=True)
    (outside / "secret.md").write_text(f"# Secret\n\n{SECRET}\n")
    (outside / "folder" / "more.md").write_text(f"# More\n\n{SECRET}\n")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# A\n\nThe Dunmore bridge opened in 1911.\n")
    (docs / "leak.md").symlink_to(outside / "secret.md")
    (docs / "leakdir").symlink_to(outside / "folder", target_is_directory=True)
    (docs / "same.md").symlink_to(docs / "a.md")
    (docs / "broken.md").symlink_to(tmp_path / "nowhere.md")
    return docs


# ============================================================================ 3: links, no database
def test_links_leaving_the_folder_are_not_followed_by_ask_docs(tree):
    """Issue 29.3: ``ask --docs``'s loader skips links leaving the folder, one warning each."""
    from tokrag_integrations.retrieval import load_documents

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        docs = load_documents(tree)
    assert [Path(d.source).name for d in docs] == ["a.md", "same.md"]  # a link inside is kept
    messages = [str(w.message) for w in caught]
    for name in ("leak.md", "leakdir"):
        assert any(m.startswith(f"{tree / name}: a symbolic link to ") and "not followed" in m for m in messages)
    assert any("broken.md: a broken symbolic link" in m for m in messages)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        docs = load_documents(tree, follow_links=True)
    assert sorted(Path(d.source).name for d in docs) == ["a.md", "leak.md", "more.md", "same.md"]
    assert sum("following a symbolic link" in str(w.message) for w in caught) == 2
