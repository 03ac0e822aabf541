"""Where a runtime message sends the user for the details: a page of the documentation (``docs/``).

Warnings and logs stay one or two lines and end with :func:`docs_pointer`; the page explains. There is no hosted site
yet, so the pointer is the page's path in the repository: this module is the one place to change when there is one.
``tests/test_docs_pointers.py`` checks that every page and anchor named in the library exists.
"""

from __future__ import annotations

from typing import Optional

#: What comes before a page's path (its folder in the repository; a site's address once there is one).
DOCS_ROOT = "docs/"


def docs_page(page: str, anchor: Optional[str] = None) -> str:
    """The address of ``page`` (a path under ``docs/`` without ``.md``, e.g. ``"guides/checkpoints"``) and of its
    heading ``anchor`` (GitHub/MyST slug: lowercase, spaces to ``-``, punctuation dropped), if given."""
    return f"{DOCS_ROOT}{page}.md" + (f"#{anchor}" if anchor else "")


def docs_pointer(page: str, anchor: Optional[str] = None) -> str:
    """``"see docs/<page>.md#<anchor>"``: the end of a message that leaves its explanation to that page."""
    return f"see {docs_page(page, anchor)}"
