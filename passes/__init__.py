"""flowc.passes: analyses that annotate a FlowGraph and decisions that produce a Plan.

Imports ``flowc.ir`` (and the exception tree) only.
"""
