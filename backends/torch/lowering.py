"""Lowering the aiperf IR to a torch.nn.Module that runs the graph node by node.

Layout: the IR is NHWC with HWIO conv kernels and (in, out) dense kernels. Inside the module
activations are logically NCHW (what torch's ops expect) but, because the NHWC input is only
permuted, they live in memory as channels_last, which is also what oneDNN and cuDNN prefer; conv
weights are kept channels_last too. Conversions happen at the boundaries only:

* input  NHWC -> NCHW view (``permute(0, 3, 1, 2)``, no copy);
* output NCHW -> NHWC when the graph's output is an image;
* ``flatten`` permutes to NHWC order before flattening, so a dense kernel that follows keeps its
  canonical (H, W, C)-ordered rows;
* kernels HWIO <-> OIHW and (in, out) <-> (out, in) when weights cross the interface. These are
  pure transposes, so export returns exactly (bit for bit) what was imported.

Padding is explicit per side [top, bottom, left, right]. Symmetric padding is passed to the conv
or pool itself (so the fast oneDNN/cuDNN paths apply); asymmetric padding is an ``F.pad`` (zeros
for conv, -inf for max-pool) followed by the op with padding 0.

Batch norm is ``nn.BatchNorm2d``/``nn.BatchNorm1d`` with ``eps = epsilon`` and
``momentum = 1 - IR momentum`` (the IR's momentum is Keras-style, torch's is its complement). Like
the NumPy reference, training normalises with the biased batch variance and feeds the unbiased one
to the moving average. The one case torch refuses, a single value per channel in training, is
handled as the reference does (output beta, Bessel factor taken as 1).

Values are freed after their last reader, and ops whose input has no other reader and whose
producer did not save its output for backward (conv, batch norm, add) run in place, as a
hand-written torchvision-style ResNet does.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from aiperf_core.errors import GraphError
from aiperf_core.ir import Graph, Node
from aiperf_core.weights import Weights, validate_weights

TRAINABLE = ("kernel", "bias", "gamma", "beta")

# Producers whose output autograd does not keep (their backward needs only their input),
# so a sole reader may overwrite that output in place.
_INPLACE_SAFE_PRODUCERS = frozenset({"conv2d", "batch_norm", "add"})


class _SingleValueSafeBN:
    """Mixin: training with one value per channel, which torch refuses, done as the reference does."""

    def forward(self, x):  # type: ignore[override]
        if self.training and x.numel() == x.shape[1]:
            return _bn_single_value(self, x)
        return super().forward(x)


def _bn_single_value(bn, x):
    # mean = x and biased var = 0, so y = beta; the moving variance decays towards 0 (Bessel factor 1).
    dims = [0] + list(range(2, x.dim()))
    mean = x.mean(dim=dims, keepdim=True)
    centred = x - mean
    var = (centred * centred).mean(dim=dims, keepdim=True)
    shape = [1, -1] + [1] * (x.dim() - 2)
    y = centred * torch.rsqrt(var + bn.eps) * bn.weight.view(shape) + bn.bias.view(shape)
    with torch.no_grad():
        m = bn.momentum
        bn.running_mean.mul_(1 - m).add_(mean.reshape(-1).to(bn.running_mean.dtype), alpha=m)
        bn.running_var.mul_(1 - m).add_(var.reshape(-1).to(bn.running_var.dtype), alpha=m)
        bn.num_batches_tracked.add_(1)
    return y


class BatchNorm2d(_SingleValueSafeBN, nn.BatchNorm2d):
    pass


class BatchNorm1d(_SingleValueSafeBN, nn.BatchNorm1d):
    pass


# ---------------------------------------------------------------------------
# Per-op modules. Each takes and returns NCHW tensors (or (N, C) for flat values).
# ---------------------------------------------------------------------------


def _split_padding(padding) -> tuple[tuple[int, int] | None, tuple[int, int, int, int] | None]:
    """(symmetric padding for the op, or None) and (F.pad argument, or None)."""
    pt, pb, pl, pr = padding
    if pt == pb and pl == pr:
        return (pt, pl), None
    return None, (pl, pr, pt, pb)  # F.pad order: last dim first


class Conv(nn.Module):
    def __init__(self, in_channels: int, attrs: Mapping[str, Any]):
        super().__init__()
        kh, kw = attrs["kernel"]
        sym, self.pad = _split_padding(attrs["padding"])
        self.conv = nn.Conv2d(in_channels, attrs["filters"], (kh, kw), stride=tuple(attrs["strides"]),
                              padding=sym if sym is not None else 0, bias=attrs["use_bias"])

    def forward(self, x):
        if self.pad is not None:
            x = F.pad(x, self.pad)
        return self.conv(x)


class MaxPool(nn.Module):
    def __init__(self, attrs: Mapping[str, Any]):
        super().__init__()
        kh, kw = attrs["kernel"]
        self.kernel = (kh, kw)
        self.stride = tuple(attrs["strides"])
        sym, pad = _split_padding(attrs["padding"])
        # torch's own padding (implicitly -inf) only goes up to half the window.
        if sym is not None and 2 * sym[0] <= kh and 2 * sym[1] <= kw:
            self.padding, self.pad = sym, None
        else:
            pt, pb, pl, pr = attrs["padding"]
            self.padding, self.pad = (0, 0), (pl, pr, pt, pb)

    def forward(self, x):
        if self.pad is not None:
            x = F.pad(x, self.pad, value=-math.inf)
        return F.max_pool2d(x, self.kernel, self.stride, self.padding)


class Dense(nn.Module):
    def __init__(self, in_features: int, attrs: Mapping[str, Any]):
        super().__init__()
        self.linear = nn.Linear(in_features, attrs["units"], bias=attrs["use_bias"])

    def forward(self, x):
        return self.linear(x)


class Dropout(nn.Module):
    """Inverted dropout. Where the masks come from is set by LoweredModel.dropout_masks():

    * None (default): torch's global generator (F.dropout);
    * a torch.Generator: ``keep = rand(shape) >= rate`` drawn from it, on the value's device;
    * a numpy Generator: the NumPy reference's masks exactly (``keep = rng.random(NHWC shape) >= rate``,
      float64 draws in graph order), so that loss_and_grads matches the reference even with dropout.
    """

    def __init__(self, attrs: Mapping[str, Any]):
        super().__init__()
        self.rate = attrs["rate"]
        self.source = None

    def forward(self, x):
        if not self.training or self.rate == 0:
            return x
        scale = 1.0 / (1.0 - self.rate)
        if self.source is None:
            return F.dropout(x, self.rate, True)
        if isinstance(self.source, np.random.Generator):
            shape = (x.shape[0],) + tuple(x.shape[2:]) + (x.shape[1],) if x.dim() == 4 else tuple(x.shape)
            mask = np.where(self.source.random(shape) >= self.rate, scale, 0.0).astype(np.float32)
            m = torch.from_numpy(mask).to(x.device)
            if x.dim() == 4:
                m = m.permute(0, 3, 1, 2)
            return x * m.to(x.dtype)
        keep = torch.rand(x.shape, generator=self.source, device=x.device) >= self.rate
        return x * (keep.to(x.dtype) * scale)


def _relu(x, inplace):
    return torch.relu_(x) if inplace >= 0 else torch.relu(x)


def _add(*xs, inplace):
    """Sum of the inputs; `inplace` is the index of an input that may be overwritten, or -1."""
    if inplace >= 0:
        acc = xs[inplace]
        rest = xs[:inplace] + xs[inplace + 1:]
        if all(torch.result_type(acc, r) == acc.dtype for r in rest):
            for r in rest:
                acc = acc.add_(r)
            return acc
    y = xs[0] + xs[1]
    for r in xs[2:]:
        y = y.add_(r) if torch.result_type(y, r) == y.dtype else y + r
    return y


def _concat(*xs, inplace):
    if any(x.dtype != xs[0].dtype for x in xs):  # mixed precision can mix bf16 and fp32 branches
        xs = [x.float() for x in xs]
    return torch.cat(xs, dim=1)


def _global_avg_pool(x, inplace):
    return x.mean(dim=(2, 3))


def _flatten(x, inplace):
    if x.dim() == 4:  # NCHW -> NHWC order, so that dense kernels keep the canonical layout
        x = x.permute(0, 2, 3, 1)
    return x.reshape(x.shape[0], -1)


def _softmax(x, inplace):
    return torch.softmax(x.float(), dim=-1)


_FUNCTIONS: dict[str, Callable] = {
    "relu": _relu, "add": _add, "concat": _concat, "global_avg_pool": _global_avg_pool,
    "flatten": _flatten, "softmax": _softmax,
}


class LoweredModel(nn.Module):
    """An IR graph as a torch module.

    ``forward(x)`` takes an NHWC batch (or (N, C) for a flat input) and returns the graph's output
    in the IR's layout. ``forward(x, logits=True)`` returns the softmax's input instead when the
    output node is a softmax, so that the loss can use a stable log-softmax.
    """

    def __init__(self, graph: Graph, precision: str = "fp32"):
        super().__init__()
        self.graph = graph
        self.precision = precision
        self.layers = nn.ModuleDict()
        self.module_names: dict[str, str] = {}  # node id -> key in self.layers
        used: set[str] = set()
        for node in graph.nodes:
            module = self._make_module(graph, node)
            if module is None:
                continue
            key = "n_" + node.id.replace(".", "_")
            while key in used:
                key += "_"
            used.add(key)
            self.layers[key] = module
            self.module_names[node.id] = key
        self._build_plan()

    @staticmethod
    def _make_module(graph: Graph, node: Node):
        a = node.attrs
        in_shape = graph.shapes[node.inputs[0]] if node.inputs else None
        if node.op == "conv2d":
            return Conv(in_shape[-1], a)
        if node.op == "batch_norm":
            cls = BatchNorm2d if len(in_shape) == 3 else BatchNorm1d
            return cls(in_shape[-1], eps=a["epsilon"], momentum=1.0 - a["momentum"])
        if node.op == "dense":
            return Dense(in_shape[0], a)
        if node.op == "max_pool":
            return MaxPool(a)
        if node.op == "dropout":
            return Dropout(a)
        return None

    def _build_plan(self) -> None:
        g = self.graph
        index = {n.id: i for i, n in enumerate(g.nodes)}
        readers: dict[str, int] = {n.id: 0 for n in g.nodes}
        last_reader: dict[str, int] = {}
        for i, node in enumerate(g.nodes):
            for src in node.inputs:
                readers[src] += 1
                last_reader[src] = i
        plan = []
        for i, node in enumerate(g.nodes):
            if node.op == "input":
                continue
            inputs = tuple(index[s] for s in node.inputs)
            free = tuple(index[s] for s in node.inputs if last_reader[s] == i and s != g.output_id)
            # In place only on a value nobody else reads, made by an op that did not save it.
            inplace = -1
            if node.op in ("relu", "add"):
                for k, src in enumerate(node.inputs):
                    if readers[src] == 1 and g[src].op in _INPLACE_SAFE_PRODUCERS and src != g.output_id:
                        inplace = k
                        break
            if node.id in self.module_names:
                fn = self.layers[self.module_names[node.id]]
                call = fn
            else:
                call = _FUNCTIONS[node.op]
            plan.append((i, node.op, call, inputs, free, inplace, node.id in self.module_names))
        self._plan = plan
        self._input_index = index[g.input_id]
        self._output_index = index[g.output_id]
        out_node = g[g.output_id]
        self._logits_index = index[out_node.inputs[0]] if out_node.op == "softmax" else None
        self._image_input = len(g.input_shape) == 3
        self._image_output = len(g.output_shape) == 3
        self._n = len(g.nodes)

    def dropout_masks(self, source):
        """Context manager: draw dropout masks from `source` (see Dropout) inside the block."""
        from contextlib import contextmanager

        @contextmanager
        def scope():
            modules = [m for m in self.modules() if isinstance(m, Dropout)]
            saved = [m.source for m in modules]
            for m in modules:
                m.source = source
            try:
                yield
            finally:
                for m, old in zip(modules, saved):
                    m.source = old

        return scope()

    def rebuild_plan(self) -> None:
        """Re-read the modules after some were replaced (e.g. by synchronised batch norm)."""
        self._build_plan()

    @property
    def has_logits(self) -> bool:
        return self._logits_index is not None

    def forward(self, x, logits: bool = False):
        stop = self._logits_index if logits and self._logits_index is not None else self._output_index
        values: list[Any] = [None] * self._n
        values[self._input_index] = x.permute(0, 3, 1, 2) if self._image_input else x
        for i, op, call, inputs, free, inplace, is_module in self._plan:
            if is_module:
                y = call(values[inputs[0]])
            else:
                y = call(*[values[j] for j in inputs], inplace=inplace)
            values[i] = y
            if i == stop:
                break
            for j in free:
                values[j] = None
        out = values[stop]
        if out.dim() == 4:
            out = out.permute(0, 2, 3, 1)
        return out

    # -- weights ------------------------------------------------------------
    def load_canonical(self, weights: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        validate_weights(self.graph, weights)
        with torch.no_grad():
            for node_id, params in weights.items():
                module = self.layers[self.module_names[node_id]]
                for pname, array in params.items():
                    target, value = _torch_param(module, pname, np.asarray(array, dtype=np.float32))
                    target.copy_(torch.from_numpy(value))

    def export_canonical(self, trainable_only: bool = False) -> Weights:
        out: Weights = {}
        for node_id, shapes in self.graph.all_param_shapes().items():
            module = self.layers[self.module_names[node_id]]
            out[node_id] = {}
            for pname in shapes:
                if trainable_only and pname not in TRAINABLE:
                    continue
                tensor, _ = _torch_param(module, pname, None)
                out[node_id][pname] = to_canonical(module, pname, tensor.detach())
        return out

    def canonical_grads(self) -> Weights:
        out: Weights = {}
        for node_id, shapes in self.graph.all_param_shapes().items():
            module = self.layers[self.module_names[node_id]]
            out[node_id] = {}
            for pname in shapes:
                if pname not in TRAINABLE:
                    continue
                tensor, _ = _torch_param(module, pname, None)
                grad = tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
                out[node_id][pname] = to_canonical(module, pname, grad)
        return out


def _torch_param(module: nn.Module, pname: str, canonical: np.ndarray | None):
    """The torch tensor that holds canonical parameter `pname`, and `canonical` in torch layout."""
    if isinstance(module, Conv):
        if pname == "kernel":  # HWIO -> OIHW
            return module.conv.weight, (None if canonical is None else np.ascontiguousarray(canonical.transpose(3, 2, 0, 1)))
        if pname == "bias":
            return module.conv.bias, canonical
    elif isinstance(module, Dense):
        if pname == "kernel":  # (in, out) -> (out, in)
            return module.linear.weight, (None if canonical is None else np.ascontiguousarray(canonical.T))
        if pname == "bias":
            return module.linear.bias, canonical
    elif isinstance(module, nn.modules.batchnorm._BatchNorm):
        attr = {"gamma": "weight", "beta": "bias", "moving_mean": "running_mean", "moving_variance": "running_var"}[pname]
        return getattr(module, attr), canonical
    raise GraphError(f"no parameter '{pname}' in a lowered {type(module).__name__}")


def to_canonical(module: nn.Module, pname: str, tensor) -> np.ndarray:
    array = tensor.detach().to("cpu", torch.float32).numpy()
    if pname == "kernel":
        array = array.transpose(2, 3, 1, 0) if isinstance(module, Conv) else array.T  # OIHW -> HWIO, (out,in) -> (in,out)
    return np.ascontiguousarray(array, dtype=np.float32)


def lower_graph(graph: Graph, weights: Mapping[str, Mapping[str, np.ndarray]], precision: str,
                device: str = "cpu") -> LoweredModel:
    model = LoweredModel(graph, precision)
    model.load_canonical(weights)
    model.to(device)
    model.to(memory_format=torch.channels_last)
    return model
