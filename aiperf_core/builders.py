"""Model builders: ResNet-50 in the Keras layout, a small ResNet of the same family, and a GPT.

Keras layout: the stride of a downsampling bottleneck sits on its first 1x1 conv
(and on the projection shortcut), not on the 3x3 conv as in torchvision's v1.5.
Convs have no bias; each is followed by batch norm.

The GPT is decoder-only and pre-LN, as GPT-2 and nanoGPT: token embedding plus learned positions,
then per block x + proj(attention(LN(x))) and x + fc2(gelu(fc1(LN(x)))), a final layer norm and an LM
head without bias, ending in a softmax over the vocabulary per token.
"""

from __future__ import annotations

from typing import Callable

from aiperf_core.errors import AiperfError
from aiperf_core.ir import Graph, Node

RESNET50_STAGES = ((3, (64, 64, 256)), (4, (128, 128, 512)), (6, (256, 256, 1024)), (3, (512, 512, 2048)))
SMALL_STAGES = ((1, (8, 8, 32)), (1, (16, 16, 64)), (1, (32, 32, 128)))


class _Builder:
    def __init__(self):
        self.nodes: list[Node] = []

    def add(self, node_id: str, op: str, inputs=(), **attrs) -> str:
        self.nodes.append(Node(node_id, op, tuple(inputs), attrs))
        return node_id

    def conv_bn(self, name: str, x: str, filters: int, kernel: int, stride: int, pad: int, relu: bool) -> str:
        x = self.add(
            f"{name}_conv", "conv2d", [x], filters=filters, kernel=[kernel, kernel],
            strides=[stride, stride], padding=[pad] * 4, use_bias=False,
        )
        x = self.add(f"{name}_bn", "batch_norm", [x], epsilon=1.001e-5, momentum=0.99)
        if relu:
            x = self.add(f"{name}_relu", "relu", [x])
        return x

    def bottleneck(self, name: str, x: str, filters: tuple[int, int, int], stride: int, project: bool) -> str:
        f1, f2, f3 = filters
        shortcut = x
        if project:
            shortcut = self.conv_bn(f"{name}_0", x, f3, 1, stride, 0, relu=False)
        y = self.conv_bn(f"{name}_1", x, f1, 1, stride, 0, relu=True)
        y = self.conv_bn(f"{name}_2", y, f2, 3, 1, 1, relu=True)
        y = self.conv_bn(f"{name}_3", y, f3, 1, 1, 0, relu=False)
        y = self.add(f"{name}_add", "add", [shortcut, y])
        return self.add(f"{name}_out", "relu", [y])

    def stages(self, x: str, stages, first_stride: int) -> str:
        for s, (blocks, filters) in enumerate(stages):
            for b in range(blocks):
                stride = (first_stride if s == 0 else 2) if b == 0 else 1
                x = self.bottleneck(f"conv{s + 2}_block{b + 1}", x, filters, stride, project=(b == 0))
        return x

    def head(self, x: str, classes: int) -> str:
        x = self.add("avg_pool", "global_avg_pool", [x])
        x = self.add("predictions", "dense", [x], units=classes, use_bias=True)
        return self.add("probs", "softmax", [x])


def _check(input_shape, classes: int, minimum: int, model: str) -> tuple[int, int, int]:
    shape = tuple(int(d) for d in input_shape)
    if len(shape) != 3:
        raise AiperfError(f"{model}: input shape must be HxWxC, got {list(shape)}")
    h, w, c = shape
    if h < minimum or w < minimum or c < 1:
        raise AiperfError(f"{model}: input must be at least {minimum}x{minimum}x1, got {h}x{w}x{c}")
    if classes < 1:
        raise AiperfError(f"{model}: classes must be >= 1, got {classes}")
    return shape


def resnet50(input_shape=(224, 224, 3), classes: int = 1000) -> Graph:
    shape = _check(input_shape, classes, 32, "resnet50")
    b = _Builder()
    x = b.add("input", "input", shape=list(shape))
    x = b.conv_bn("conv1", x, 64, 7, 2, 3, relu=True)
    x = b.add("pool1", "max_pool", [x], kernel=[3, 3], strides=[2, 2], padding=[1, 1, 1, 1])
    x = b.stages(x, RESNET50_STAGES, first_stride=1)
    b.head(x, classes)
    return Graph(b.nodes, name="resnet50")


def resnet_small(input_shape=(32, 32, 3), classes: int = 10) -> Graph:
    """Three one-block bottleneck stages behind a 3x3 stem: ResNet-50's family at toy size."""
    shape = _check(input_shape, classes, 8, "resnet_small")
    b = _Builder()
    x = b.add("input", "input", shape=list(shape))
    x = b.conv_bn("conv1", x, 16, 3, 1, 1, relu=True)
    x = b.add("pool1", "max_pool", [x], kernel=[3, 3], strides=[2, 2], padding=[1, 1, 1, 1])
    x = b.stages(x, SMALL_STAGES, first_stride=1)
    b.head(x, classes)
    return Graph(b.nodes, name="resnet_small")


def resnet_one_block(input_shape=(16, 16, 3), classes: int = 3) -> Graph:
    """A 3x3 stem and one downsampling bottleneck with a projection shortcut: every op of resnet_small
    (3x3 and strided 1x1 convs, batch norm, relu, max pool, add, global average pool, dense, softmax)
    at 5 convs instead of 13, for checks that are per op rather than per block but pay per node to
    trace and compile (data-parallel steps, per shard shape and per rank)."""
    shape = _check(input_shape, classes, 8, "resnet_one_block")
    b = _Builder()
    x = b.add("input", "input", shape=list(shape))
    x = b.conv_bn("conv1", x, 8, 3, 1, 1, relu=True)
    x = b.add("pool1", "max_pool", [x], kernel=[3, 3], strides=[2, 2], padding=[1, 1, 1, 1])
    x = b.bottleneck("conv2_block1", x, (4, 4, 16), stride=2, project=True)
    b.head(x, classes)
    return Graph(b.nodes, name="resnet_one_block")


GPT_DEFAULTS = {"layers": 2, "hidden": 128, "heads": 4, "seq_len": 128, "vocab": 256, "ffn": None}


def gpt(layers: int = 2, hidden: int = 128, heads: int = 4, seq_len: int = 128, vocab: int = 256,
        ffn: int | None = None) -> Graph:
    """A decoder-only GPT of `layers` pre-LN blocks; ffn (the MLP width) defaults to 4 * hidden."""
    ffn = 4 * hidden if ffn is None else ffn
    for name, value, minimum in (("layers", layers, 1), ("hidden", hidden, 1), ("heads", heads, 1),
                                 ("seq_len", seq_len, 1), ("vocab", vocab, 2), ("ffn", ffn, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise AiperfError(f"gpt: {name} must be an integer >= {minimum}, got {value!r}")
    if hidden % heads:
        raise AiperfError(f"gpt: heads ({heads}) must divide hidden ({hidden})")
    b = _Builder()
    b.add("tokens", "token_input", seq_len=seq_len, vocab=vocab)
    b.add("embed", "embedding", ["tokens"], vocab=vocab, units=hidden)
    x = b.add("positions", "position_embedding", ["embed"])
    for i in range(layers):
        x = gpt_block(b, f"h{i}", x, hidden, heads, ffn)
    x = b.add("ln_f", "layer_norm", [x], epsilon=1e-5)
    x = b.add("lm_head", "dense", [x], units=vocab, use_bias=False)
    b.add("probs", "softmax", [x])
    return Graph(b.nodes, name="gpt")


def gpt_block(b: _Builder, name: str, x: str, hidden: int, heads: int, ffn: int) -> str:
    h = b.add(f"{name}_ln1", "layer_norm", [x], epsilon=1e-5)
    q, k, v = (b.add(f"{name}_{w}", "dense", [h], units=hidden, use_bias=True) for w in ("q", "k", "v"))
    a = b.add(f"{name}_attn", "attention", [q, k, v], heads=heads, head_dim=hidden // heads, causal=True)
    a = b.add(f"{name}_proj", "dense", [a], units=hidden, use_bias=True)
    x = b.add(f"{name}_res1", "add", [x, a])
    h = b.add(f"{name}_ln2", "layer_norm", [x], epsilon=1e-5)
    h = b.add(f"{name}_fc1", "dense", [h], units=ffn, use_bias=True)
    h = b.add(f"{name}_gelu", "gelu", [h])
    h = b.add(f"{name}_fc2", "dense", [h], units=hidden, use_bias=True)
    return b.add(f"{name}_res2", "add", [x, h])


LLAMA_DEFAULTS = {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": None, "seq_len": 128, "vocab": 256,
                  "ffn": None, "rope_base": 10000.0}
LLAMA_FFN_MULTIPLE = 64


def llama_ffn(hidden: int) -> int:
    """Llama's MLP width for `hidden`: 2/3 of 4 * hidden (the gated MLP's three matrices then hold what
    GPT's two hold at 4 * hidden), rounded up to a multiple of 64 (Llama rounds to 256; 64 keeps small
    models near 8/3 hidden)."""
    return -(-8 * hidden // 3 // LLAMA_FFN_MULTIPLE) * LLAMA_FFN_MULTIPLE


def llama(layers: int = 2, hidden: int = 128, heads: int = 4, kv_heads: int | None = None, seq_len: int = 128,
          vocab: int = 256, ffn: int | None = None, rope_base: float = 10000.0) -> Graph:
    """A decoder-only transformer of Llama's family: pre-norm blocks of RMS norm, grouped-query attention
    with rotary positions on the queries and keys, and a SwiGLU MLP, with no biases anywhere and no
    position table. kv_heads defaults to heads (multi-head attention); ffn to llama_ffn(hidden)."""
    kv_heads = heads if kv_heads is None else kv_heads
    ffn = llama_ffn(hidden) if ffn is None and isinstance(hidden, int) and not isinstance(hidden, bool) else ffn
    for name, value, minimum in (("layers", layers, 1), ("hidden", hidden, 1), ("heads", heads, 1),
                                 ("kv_heads", kv_heads, 1), ("seq_len", seq_len, 1), ("vocab", vocab, 2),
                                 ("ffn", ffn, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise AiperfError(f"llama: {name} must be an integer >= {minimum}, got {value!r}")
    if hidden % heads:
        raise AiperfError(f"llama: heads ({heads}) must divide hidden ({hidden})")
    if heads % kv_heads:
        raise AiperfError(f"llama: kv_heads ({kv_heads}) must divide heads ({heads})")
    if (hidden // heads) % 2:
        raise AiperfError(f"llama: the head width hidden / heads ({hidden // heads}) must be even for rotary")
    b = _Builder()
    b.add("tokens", "token_input", seq_len=seq_len, vocab=vocab)
    x = b.add("embed", "embedding", ["tokens"], vocab=vocab, units=hidden)
    for i in range(layers):
        x = llama_block(b, f"h{i}", x, hidden, heads, kv_heads, ffn, rope_base)
    x = b.add("norm_f", "rms_norm", [x], epsilon=1e-5)
    x = b.add("lm_head", "dense", [x], units=vocab, use_bias=False)
    b.add("probs", "softmax", [x])
    return Graph(b.nodes, name="llama")


def llama_block(b: _Builder, name: str, x: str, hidden: int, heads: int, kv_heads: int, ffn: int,
                rope_base: float) -> str:
    head_dim = hidden // heads
    h = b.add(f"{name}_norm1", "rms_norm", [x], epsilon=1e-5)
    q = b.add(f"{name}_q", "dense", [h], units=hidden, use_bias=False)
    k = b.add(f"{name}_k", "dense", [h], units=kv_heads * head_dim, use_bias=False)
    v = b.add(f"{name}_v", "dense", [h], units=kv_heads * head_dim, use_bias=False)
    q = b.add(f"{name}_q_rope", "rotary", [q], head_dim=head_dim, base=float(rope_base))
    k = b.add(f"{name}_k_rope", "rotary", [k], head_dim=head_dim, base=float(rope_base))
    attrs = {"heads": heads, "head_dim": head_dim, "causal": True}
    if kv_heads != heads:
        attrs["kv_heads"] = kv_heads
    a = b.add(f"{name}_attn", "attention", [q, k, v], **attrs)
    a = b.add(f"{name}_proj", "dense", [a], units=hidden, use_bias=False)
    x = b.add(f"{name}_res1", "add", [x, a])
    h = b.add(f"{name}_norm2", "rms_norm", [x], epsilon=1e-5)
    gate = b.add(f"{name}_gate", "dense", [h], units=ffn, use_bias=False)
    up = b.add(f"{name}_up", "dense", [h], units=ffn, use_bias=False)
    gate = b.add(f"{name}_silu", "silu", [gate])
    h = b.add(f"{name}_glu", "mul", [gate, up])
    h = b.add(f"{name}_down", "dense", [h], units=hidden, use_bias=False)
    return b.add(f"{name}_res2", "add", [x, h])


BUILDERS: dict[str, Callable[..., Graph]] = {"resnet50": resnet50, "resnet_small": resnet_small, "gpt": gpt,
                                             "llama": llama}
TRANSFORMER_BUILDERS = ("gpt", "llama")


def build(name: str, input_shape=None, classes: int | None = None, **sizes) -> Graph:
    """A builder's graph. input_shape and classes are the image builders'; `sizes` the transformers'
    (GPT_DEFAULTS' and LLAMA_DEFAULTS' keys)."""
    try:
        builder = BUILDERS[name]
    except KeyError:
        raise AiperfError(f"unknown model '{name}' (builders: {', '.join(sorted(BUILDERS))})") from None
    sizes = {k: v for k, v in sizes.items() if v is not None}
    if name in TRANSFORMER_BUILDERS:
        if input_shape is not None or classes is not None:
            raise AiperfError(f"{name}: --input and --classes are for image models; a {name} takes --seq-len and "
                              f"--vocab")
        if name == "gpt" and "kv_heads" in sizes:
            raise AiperfError("gpt: --kv-heads applies to the llama builder only (GPT-2's attention has a key and "
                              "value per head)")
        return builder(**sizes)
    if sizes:
        raise AiperfError(f"{name}: --{next(iter(sizes)).replace('_', '-')} applies to the gpt and llama builders "
                          f"only")
    kwargs = {}
    if input_shape is not None:
        kwargs["input_shape"] = input_shape
    if classes is not None:
        kwargs["classes"] = classes
    return builder(**kwargs)
