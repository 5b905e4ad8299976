"""Two edits the joint-graph passes share (`frozen_weights.widen_per_use`, `recompute.recompute_in_backward`): which
nodes are computed from constants alone, and copying a set of nodes to another place in the graph."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def computed_from(sources: set[torch.fx.Node]) -> Callable[[torch.fx.Node], bool]:
    """A test (memoized) of whether a node is one of `sources` or a call computed from them alone (a widening of a
    slice of a constant, with `sources` the constant placeholders)."""
    known: dict[torch.fx.Node, bool] = {}

    def test(node: torch.fx.Node) -> bool:
        if node not in known:
            known[node] = node in sources or node.op == "call_function" and all(
                test(a) for a in node.all_input_nodes)
        return known[node]

    return test


def copy_before(graph: torch.fx.Graph, nodes: Iterable[torch.fx.Node], before: torch.fx.Node,
                order: dict[torch.fx.Node, int]) -> dict[torch.fx.Node, torch.fx.Node]:
    """Copies of `nodes` (calls), in graph order (`order`: node -> position), right before `before`; a copy reads
    the copies of the others, and everything else as its original does. Returns original -> copy."""
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    with graph.inserting_before(before):
        for node in sorted(nodes, key=order.get):
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: copies.get(a, a))
            copies[node] = graph.call_function(node.target, args, kwargs)
            copies[node].meta = dict(node.meta)
    return copies
