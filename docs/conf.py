"""Sphinx configuration of the lightning-onebit documentation (built with warnings as errors by the test suite:
``python -m sphinx -W -b html docs docs/_build/html``)."""

from __future__ import annotations

import lightning_onebit

project = "lightning-onebit"
author = "the lightning-onebit authors"
copyright = "2026, the lightning-onebit authors"
release = lightning_onebit.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
root_doc = "index"

# Markdown: GitHub-style heading anchors (links such as guides/checkpoints.md#keep), fenced directives, tables.
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence", "deflist"]

# The API reference comes from the Google-style docstrings.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_class_signature = "separated"
autodoc_default_options = {"members": True, "show-inheritance": False}

html_theme = "furo"
html_title = f"lightning-onebit {release}"
html_static_path: list[str] = []
