"""The language-model workload: a small decoder-only GPT grown by the transformer morphs
(aiperf_core.morph.transformer) on byte-level text (enwik8, or the embedded corpus), validation
bits per byte as quality.

An epoch is `epoch_tokens` training tokens, whatever the sequence length or the corpus: the next
windows of `seq_len` bytes (and the byte after each) of the trial's seeded stream over the whole
training split, new text every epoch (aiperf_core.data.text_stream). Validation reads the first
`val_tokens` bytes of the validation split as consecutive windows, the same for every trial of every
run on that corpus, so that bits per byte compare across trials and runs.

The error is bits per byte over 8, the fraction of a byte's 8 bits the model still needs:
1 for a model that knows nothing (uniform over 256 values), 0 for a perfect one. So -ln(error) is
0 for the uniform model and grows with quality, as -ln(error) does for the CNN's error rate.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from aiperf_core.errors import AiperfError
from aiperf_core.ir import Graph
from aiperf_core.policy import Policy
from aiperf_core.search.hpo import Dimension, Proposal
from aiperf_core.workloads.base import Workload

BITS_PER_BYTE = 8  # a byte-level vocabulary of 256
# The seeds of policy item initial_architecture: a builder (SEED_MODELS, aiperf_core.builders) at these
# sizes. gpt2_small, GPT-2 small's shape (12 blocks of width 768, 12 heads of 64; 85 M parameters at a
# byte vocabulary), is the official one: sized for an accelerator node (docs/search.md, "The official LM
# track"). gpt_small (2 blocks of 128, 0.4 M) is the embedded corpus's default, sized for one CPU;
# gpt_tiny is for smoke tests. The llama_* seeds are Llama's family (RMS norm, rotary positions,
# grouped-query attention, SwiGLU) at the same sizes: llama_gpt2_size has GPT-2 small's depth, width and
# heads, over 4 key-value heads, with Llama's MLP width (8/3 of 768 = 2048); why it is not the official
# seed: docs/search.md, "Which family is official".
SEEDS = {"gpt2_small": {"layers": 12, "hidden": 768, "heads": 12},
         "gpt_small": {"layers": 2, "hidden": 128, "heads": 4},
         "gpt_tiny": {"layers": 1, "hidden": 32, "heads": 2},
         "llama_gpt2_size": {"layers": 12, "hidden": 768, "heads": 12, "kv_heads": 4},
         "llama_small": {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2},
         "llama_tiny": {"layers": 1, "hidden": 32, "heads": 2, "kv_heads": 1}}
SEED_MODELS = {name: "llama" if name.startswith("llama") else "gpt" for name in SEEDS}
OFFICIAL_SEED = "gpt2_small"


def seed_graph(name: str, seq_len: int, vocab: int) -> Graph:
    """The graph of seed `name` (SEEDS) over sequences of `seq_len` tokens below `vocab`."""
    from aiperf_core.builders import build

    return build(SEED_MODELS[name], **SEEDS[name], seq_len=seq_len, vocab=vocab)


class Seed:
    def build(self, policy: Policy, corpus) -> Graph:
        return seed_graph(policy["initial_architecture"], policy["seq_len"], corpus.vocab)


class Morphs:
    def generate_candidates(self, graph: Graph, weights, n: int, seed: int, policy: Policy, memory=None) -> list:
        """Children within the policy's caps (TransformerCaps) and the device's memory (`memory`, a
        morph.MemoryCheck, or None): a parent at a cap grows otherwise."""
        from aiperf_core.morph import transformer

        caps = transformer.TransformerCaps(max_layers=policy["max_layers"], max_width=policy["max_width"],
                                                 max_heads=policy["max_heads"], max_experts=policy["max_experts"],
                                                 memory=memory)
        return transformer.generate_candidates(graph, weights, n, seed, caps, ops=tuple(policy["nas_morphs"]))

    def replay(self, graph: Graph, weights, record: Mapping):
        from aiperf_core.morph import transformer

        return transformer.replay(graph, weights, record)

    def tune_morph(self, record: dict, proposal: Proposal) -> dict:
        return record


class HpoSpace:
    def dimensions(self, policy: Policy) -> list[Dimension]:
        low, high = policy["hpo_batch_size_bounds"]
        scale_low, scale_high = policy["hpo_lr_scale_bounds"]
        return [Dimension("batch_size", policy["batch_size"], low, high),
                Dimension("lr_scale", 1.0, float(scale_low), float(scale_high), integer=False)]

    def learning_rate(self, policy: Policy, proposal: Proposal) -> float:
        """learning_rate x sqrt(batch / reference_batch_size) x the tuner's factor: AdamW's rate
        scales with the square root of the batch (Malladi et al., "On the SDEs and Scaling Rules
        for Adaptive Gradient Algorithms", 2022), not linearly as SGD's (the CNN's rule)."""
        ratio = proposal.batch_size / policy["reference_batch_size"]
        return policy["learning_rate"] * math.sqrt(ratio) * float(proposal.point["lr_scale"])


class Data:
    samples = "sequences"  # what an epoch's train_images count: windows of seq_len tokens

    def open(self, spec: Mapping[str, Any], policy: Policy):
        from aiperf_core.data import text_corpus

        name = spec.get("name")
        if name == text_corpus.EMBEDDED:
            return text_corpus.embedded_corpus()
        if name == "enwik8":
            if not spec.get("path"):
                raise AiperfError("dataset.path: enwik8 needs the folder `aiperf data prepare enwik8.zip OUT` wrote")
            return text_corpus.open_prepared(spec["path"])
        raise AiperfError(f"dataset.name: {name!r} is not text (the lm workload reads enwik8 or embedded)")

    def trial_data(self, corpus, policy: Policy, seed: int):
        """The trial's TokenStream: its epochs' windows are drawn from the trial seed as it trains."""
        from aiperf_core.data.text_stream import TokenStream

        return TokenStream(corpus, policy["seq_len"], policy["epoch_tokens"], policy["val_tokens"])

    def digest(self, corpus, spec: Mapping[str, Any]) -> str:
        """The digest of the corpus this node read: its manifest's, or the embedded corpus's own."""
        return corpus.digest


def bits_per_byte(val_loss: float) -> float:
    """Mean cross-entropy per byte token in nats, in bits."""
    return val_loss / math.log(2)


class Validity:
    quality = "bits per byte"
    unit = "bits per byte"
    limit_item = "max_bits_per_byte"  # the policy item limit() reads

    def display(self, error: float) -> float:
        return error * BITS_PER_BYTE

    def limit(self, rules: Mapping[str, Any]) -> float:
        return rules["max_bits_per_byte"] / BITS_PER_BYTE

    def error(self, val_accuracy: float | None, val_loss: float | None, val_samples: int) -> float | None:
        if val_loss is None or not math.isfinite(val_loss) or val_loss < 0:
            return None
        # Below 1/8 of a bit nothing is measured on a finite validation set either; as the CNN's
        # half an image wrong, the floor keeps -ln(error) finite. Above 8 bits a model is worse
        # than knowing nothing: it is taken as knowing nothing, so no regulated score is negative.
        return min(max(bits_per_byte(val_loss), 1.0 / BITS_PER_BYTE), BITS_PER_BYTE) / BITS_PER_BYTE

    def best(self, error: float | None, accuracy: float | None) -> str:
        if error is None:
            return "no validation loss yet"
        tokens = "" if accuracy is None else f", next-byte accuracy {accuracy:.2%}"
        return f"best validation {error * BITS_PER_BYTE:.3f} bits per byte (error {error:.2%}{tokens})"

    def brief(self, error: float | None, accuracy: float | None) -> str:
        return f"best bits/byte {'-' if error is None else f'{error * BITS_PER_BYTE:.3f}'}"

    def reasons(self, rules: Mapping[str, Any], best_error: float | None) -> list[str]:
        if best_error is None:
            return ["no validation loss was recorded by the end of the run"]
        limit = rules["max_bits_per_byte"]
        if best_error * BITS_PER_BYTE > limit:
            return [f"best validation {best_error * BITS_PER_BYTE:.3f} bits per byte is above the maximum {limit:g}"]
        return []


LM = Workload("lm", Seed(), Morphs(), HpoSpace(), Data(), Validity())
