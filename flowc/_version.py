"""The flowc version (single source: pyproject reads it from here)."""

__version__ = "0.1.0"
