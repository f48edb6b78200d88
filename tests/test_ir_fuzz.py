"""Property-based: the loader raises nothing but GraphError on random and malformed graphs."""

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiperf_core.builders import resnet_small
from aiperf_core.errors import GraphError
from aiperf_core.ir import OPS, SCHEMA_VERSION, Graph

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 40), st.floats(allow_nan=True), st.text(max_size=6))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                                  st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)
ATTR_KEYS = ["shape", "filters", "kernel", "strides", "padding", "use_bias", "units", "rate", "epsilon", "momentum"]
small_ints = st.integers(-2, 9)


@st.composite
def random_node(draw, ids):
    nid = draw(st.sampled_from(ids + ["", "bad id", "x" * 200]))
    op = draw(st.one_of(st.sampled_from(sorted(OPS)), st.text(max_size=5), json_values))
    inputs = draw(st.lists(st.sampled_from(ids + ["ghost"]), max_size=3))
    attrs = draw(st.dictionaries(st.sampled_from(ATTR_KEYS),
                                 st.one_of(small_ints, st.lists(small_ints, max_size=5), json_values), max_size=4))
    node = {"id": nid, "op": op, "inputs": inputs, "attrs": attrs}
    if draw(st.booleans()):
        node[draw(st.sampled_from(["inputs", "attrs", "id", "extra"]))] = draw(json_values)
    return node


def load(data):
    try:
        Graph.from_dict(data)
    except GraphError as exc:
        assert "\n" not in str(exc)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(random_node([f"n{i}" for i in range(6)]), max_size=8))
def test_random_graphs_raise_only_graph_error(nodes):
    load({"schema_version": SCHEMA_VERSION, "nodes": nodes})


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_random_json_documents(value):
    load(value)
    load({"schema_version": SCHEMA_VERSION, "nodes": value})
    try:
        Graph.from_json(json.dumps(value))
    except GraphError:
        pass


BASE = resnet_small().to_dict()


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_mutated_real_graph(data):
    doc = copy.deepcopy(BASE)
    nodes = doc["nodes"]
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(nodes) - 1))
        field = data.draw(st.sampled_from(["op", "inputs", "attrs", "drop", "swap", "id"]))
        if field == "drop":
            nodes.pop(i)
            if not nodes:
                break
        elif field == "swap":
            j = data.draw(st.integers(0, len(nodes) - 1))
            nodes[i]["inputs"], nodes[j]["inputs"] = nodes[j]["inputs"], nodes[i]["inputs"]
        elif field == "attrs" and nodes[i]["attrs"]:
            key = data.draw(st.sampled_from(sorted(nodes[i]["attrs"])))
            nodes[i]["attrs"][key] = data.draw(st.one_of(small_ints, st.lists(small_ints, max_size=5), json_values))
        elif field == "inputs":
            nodes[i]["inputs"] = data.draw(st.lists(st.sampled_from([n["id"] for n in nodes] + ["ghost"]), max_size=3))
        elif field == "op":
            nodes[i]["op"] = data.draw(st.sampled_from(sorted(OPS) + ["lstm"]))
        else:
            nodes[i]["id"] = data.draw(st.sampled_from([n["id"] for n in nodes] + ["new"]))
    load(doc)
