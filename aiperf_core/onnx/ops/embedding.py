"""Embeddings: a Gather of a constant table by the token ids (a Gather of constants alone is folded)."""

from __future__ import annotations

from aiperf_core.ir import OPS, Node
from aiperf_core.onnx.layouts import Act
from aiperf_core.onnx.ops.registry import converter
from aiperf_core.onnx.protos import node_attrs


@converter("Gather")
def gather(imp, node) -> None:
    """Gather(table, token ids) is an embedding; the table's height is the token input's vocabulary."""
    tokens = imp.act(node, 1, ("tokens",))
    table = imp.const(node, 0)
    axis = node_attrs(node).get("axis", 0)
    if axis != 0:
        imp.fail(node, f"only a lookup of table rows (axis 0) is supported, got axis {axis}")
    if table.ndim != 2:
        imp.fail(node, f"the embedding table must be 2-D, got shape {list(table.shape)}")
    vocab, units = (int(d) for d in table.shape)
    token_node = imp.nodes[0]
    if not imp.vocab_known:
        attrs = {**token_node.attrs, "vocab": vocab}
        imp.nodes[0] = Node(token_node.id, token_node.op, (), OPS["token_input"].parse(token_node.id, attrs))
        imp.vocab_known = True
    elif token_node.attrs["vocab"] != vocab:
        imp.fail(node, f"table of {vocab} rows, but an earlier embedding's has {token_node.attrs['vocab']}")
    nid = imp.emit(node, "embedding", [tokens.node], {"vocab": vocab, "units": units}, {"table": table})
    imp.set(node, Act(nid, "seq"))
