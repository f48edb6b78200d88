"""Two decoder-only transformers in plain torch, written independently of aiperf's IR, their ONNX export by
either of torch.onnx's exporters, and FlopCounterMode's count of their forward pass in the IR's categories.

- GPT: GPT-2's layout. Learned positions, pre-LN blocks of layer norm, causal self-attention (one fused
  q/k/v projection split in three, or three projections) and an MLP with the tanh GELU; every projection
  has a bias; a final layer norm and an lm_head without bias (not tied to the embedding).
- Llama: RMS norm (written out: x * rsqrt(mean(x^2) + eps) * weight), q/k/v without bias, rotary
  positions in the half-split form on the queries and keys (cos and sin tables made at construction),
  grouped-query attention (each key-value head repeated for its group), a SwiGLU MLP; no biases; a final
  RMS norm and an lm_head.

Each writes its attention out by hand (scores, scale, causal mask, softmax, product: the GPT's mask is a
`where` of a boolean lower triangle, the Llama's an added -inf upper triangle) or, with `sdpa`, through
F.scaled_dot_product_attention(is_causal=True). Weights are drawn from a seeded generator at scales where
every block moves the logits (an embedding of unit scale, projections of 1/sqrt(fan-in)), so that a wrong
mask, norm or rotation shows in the output. The forward takes token ids (N, S) and returns logits
(N, S, vocab).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

EXPORTERS = ("torchscript", "dynamo")


def init_weights(module: nn.Module, seed: int) -> None:
    """Deterministic weights from `seed` at the module docstring's scales, by layer type, each parameter once
    (a tied lm_head keeps its embedding's): embeddings N(0, 1); nn.Linear and Hugging Face's Conv1D (whose
    weight is (in, out)) N(0, 1/fan-in) and biases of standard deviation 0.1; other 1-D weights (norm gains)
    U(0.5, 1.5)."""
    generator = torch.Generator().manual_seed(seed)
    done: set[int] = set()
    with torch.no_grad():
        for layer in module.modules():
            for name, param in layer.named_parameters(recurse=False):
                if id(param) in done:
                    continue
                done.add(id(param))
                if isinstance(layer, nn.Embedding):
                    values = torch.randn(param.shape, generator=generator)
                elif name == "weight" and param.dim() == 2:
                    fan_in = param.shape[0] if type(layer).__name__ == "Conv1D" else param.shape[1]
                    values = torch.randn(param.shape, generator=generator) / math.sqrt(fan_in)
                elif name == "weight":
                    values = 0.5 + torch.rand(param.shape, generator=generator)
                else:
                    values = 0.1 * torch.randn(param.shape, generator=generator)
                param.copy_(values)


def _causal_where(scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, scores, torch.tensor(float("-inf"), dtype=scores.dtype))


class GPTBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, seq_len: int, sdpa: bool, fused_qkv: bool):
        super().__init__()
        self.heads, self.head_dim, self.sdpa, self.fused_qkv = heads, hidden // heads, sdpa, fused_qkv
        self.ln_1 = nn.LayerNorm(hidden, eps=1e-5)
        if fused_qkv:
            self.c_attn = nn.Linear(hidden, 3 * hidden)
        else:
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, hidden) for _ in range(3))
        self.c_proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden, eps=1e-5)
        self.fc = nn.Linear(hidden, ffn)
        self.proj = nn.Linear(ffn, hidden)
        self.register_buffer("keep", torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool)), persistent=False)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        n, s, _ = x.shape
        return x.view(n, s, self.heads, self.head_dim).transpose(1, 2)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        n, s, d = x.shape
        if self.fused_qkv:
            q, k, v = self.c_attn(x).split(d, dim=2)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = self._heads(q), self._heads(k), self._heads(v)
        if self.sdpa:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            scores = _causal_where(scores, self.keep[:s, :s])
            out = torch.softmax(scores, dim=-1) @ v
        return self.c_proj(out.transpose(1, 2).contiguous().view(n, s, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2's layout (module docstring); ffn is the MLP width."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, seq_len: int, vocab: int, sdpa: bool = True,
                 fused_qkv: bool = True, seed: int = 0):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(GPTBlock(hidden, heads, ffn, seq_len, sdpa, fused_qkv) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden, eps=1e-5)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        init_weights(self, seed)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int, seq_len: int, rope_base: float, sdpa: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.sdpa = heads, kv_heads, hidden // heads, sdpa
        self.input_norm = RMSNorm(hidden)
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.post_norm = RMSNorm(hidden)
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)
        # The angles in float64, as the IR's rotary defines them; cos and sin of (S, head_dim), halves repeated.
        inv_freq = rope_base ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)
        theta = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv_freq
        theta = torch.cat((theta, theta), dim=-1)
        self.register_buffer("cos", theta.cos().float(), persistent=False)
        self.register_buffer("sin", theta.sin().float(), persistent=False)
        self.register_buffer("mask", torch.full((seq_len, seq_len), float("-inf")).triu(1), persistent=False)

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        n, s, _ = x.shape
        return x.view(n, s, heads, self.head_dim).transpose(1, 2)

    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        n, kv, s, d = x.shape
        group = self.heads // kv
        return x[:, :, None].expand(n, kv, group, s, d).reshape(n, kv * group, s, d)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        n, s, d = x.shape
        q = self._heads(self.q_proj(x), self.heads)
        k = self._heads(self.k_proj(x), self.kv_heads)
        v = self._heads(self.v_proj(x), self.kv_heads)
        cos, sin = self.cos[:s], self.sin[:s]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        if self.sdpa:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim) + self.mask[:s, :s]
            out = torch.softmax(scores, dim=-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(n, s, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.input_norm(x))
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    """Llama's layout (module docstring); kv_heads divides heads, ffn is the SwiGLU MLP's width."""

    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, seq_len: int, vocab: int,
                 rope_base: float = 10000.0, sdpa: bool = True, seed: int = 0):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(LlamaBlock(hidden, heads, kv_heads, ffn, seq_len, rope_base, sdpa)
                                    for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        init_weights(self, seed)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def export(module: nn.Module, path: Path, exporter: str, opset: int, tokens: torch.Tensor) -> Path:
    """Write `module` (in eval mode) as ONNX to `path` with torch.onnx's TorchScript exporter
    (dynamo=False) or its dynamo exporter (dynamo=True), for the static shape of `tokens` (N, S)."""
    if exporter not in EXPORTERS:
        raise ValueError(f"exporter must be one of {EXPORTERS}, got {exporter!r}")
    module.eval()
    with torch.no_grad(), warnings.catch_warnings():
        # The trace is specialised to the static shape of `tokens`, as it is meant to be, and the legacy
        # TorchScript exporter is used on purpose.
        for category in (torch.jit.TracerWarning, DeprecationWarning, FutureWarning):
            warnings.simplefilter("ignore", category)
        if exporter == "torchscript":
            torch.onnx.export(module, (tokens,), str(path), dynamo=False, opset_version=opset,
                              input_names=["input_ids"], output_names=["logits"])
        else:
            program = torch.onnx.export(module, (tokens,), dynamo=True, opset_version=opset,
                                        input_names=["input_ids"], output_names=["logits"], verbose=False)
            program.save(str(path))
    return path


def forward_flops(module: nn.Module, tokens: torch.Tensor) -> dict[str, int]:
    """FlopCounterMode's forward FLOPs per sequence in the IR's categories (the torch backend's native
    counter's mapping): 'dense' the matrix products of projections (mm, addmm), 'attention' the two
    score products (bmm, or a fused attention kernel); 2 FLOPs per multiply-accumulate."""
    from torch.utils.flop_counter import FlopCounterMode

    from aiperf_backends.torch.counter import attention_rules, category_of

    module.eval()
    counter = FlopCounterMode(display=False, custom_mapping=attention_rules())
    with torch.no_grad(), counter:
        module(tokens)
    out = {"dense": 0, "attention": 0}
    for op, flops in counter.get_flop_counts().get("Global", {}).items():
        category = category_of(op)
        if category not in out:
            raise AssertionError(f"FlopCounterMode counted {op} ({category}), which neither model runs")
        out[category] += int(flops)
    batch = tokens.shape[0]
    assert all(v % batch == 0 for v in out.values())
    return {k: v // batch for k, v in out.items()}
