"""flowc.runtime: lowers a Plan to a Program and executes it on Ray workers.

Imports ``flowc.ir`` (and the exception tree) only — never ``flowc.passes``.
"""
