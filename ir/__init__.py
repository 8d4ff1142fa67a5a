"""flowc.ir: the data every layer shares — the dataflow graph of a flow, the
specs of models, clusters and workloads, and the plan.

Imports nothing of flowc but the exception tree (``flowc.errors``).
"""

from flowc.ir.graph import Edge, FlowGraph, Node, RoleInfo, ValueRef
from flowc.ir.serialize import from_json, to_json

__all__ = ["Edge", "FlowGraph", "Node", "RoleInfo", "ValueRef", "from_json", "to_json"]
