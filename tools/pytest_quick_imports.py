"""A pytest plugin loaded first (`-p tools.pytest_quick_imports`, make test): imports nothing that the
tests use, and skips one import that only costs time.

jsonschema, which nbval imports through nbformat, checks the "iri" formats with rfc3987_syntax when
that package is installed (jupyter-events installs it); importing it builds a grammar with lark,
about 2-3 CPU-seconds in every pytest process (the controller and each xdist worker). Notebook
validation never meets those formats. Marking the module missing makes jsonschema skip them, as it
does wherever the package is absent (`with suppress(ImportError)` in jsonschema/_format.py)."""

import sys

sys.modules.setdefault("rfc3987_syntax", None)  # type: ignore[assignment]
