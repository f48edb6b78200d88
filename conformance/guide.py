"""The generated parts of the vendor guide (plugins/aiperf-numpy/README.md), rendered from the code
so that they cannot drift: the kit's levels, the IR's ops (aiperf_core.ir.OPS, introspected through
each op's attribute parser and the kit's op cases), every check id, and the default tolerances.

Each part sits in the guide between `<!-- BEGIN GENERATED name -->` and `<!-- END GENERATED name -->`.
    python -m aiperf_conformance.guide --check plugins/aiperf-numpy/README.md   # exit 1 when stale
    python -m aiperf_conformance.guide --write plugins/aiperf-numpy/README.md   # regenerate in place
tests/test_conformance_guide.py fails when the guide differs from what this renders.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

from aiperf_core.backend import PRECISIONS
from aiperf_core.errors import AiperfError, GraphError
from aiperf_core.ir import OPS
from aiperf_conformance.kit import LEVELS, PER_PRECISION_LEVELS, catalogue

GUIDE = Path("plugins/aiperf-numpy/README.md")
_BLOCK = re.compile(r"(<!-- BEGIN GENERATED (\w+)[^>]*-->\n)(.*?)(<!-- END GENERATED \2 -->)", re.S)
# The input ops are no case's op under test: every case starts with one of them.
_INPUT_EXAMPLES = {"input": {"shape": [8, 8, 3]}, "token_input": {"seq_len": 6, "vocab": 11}}


def _first_line(doc: str | None) -> str:
    text = " ".join((doc or "").strip().split("\n\n")[0].split())
    return text.replace("|", "\\|")


def render_levels() -> str:
    rows = ["| level | precisions | what it checks |", "| --- | --- | --- |"]
    for level in LEVELS:
        module = importlib.import_module(f"aiperf_conformance.levels.{level}")
        precisions = "every declared" if level in PER_PRECISION_LEVELS else "fp32"
        rows.append(f"| `{level}` | {precisions} | {_first_line(module.__doc__)} |")
    return "\n".join(rows)


def _op_examples() -> dict[str, list[tuple[dict, list, str]]]:
    """op -> [(attrs, input shapes, kit case)] from the kit's op cases."""
    from aiperf_conformance.cases import OP_CASES

    found: dict[str, list[tuple[dict, list, str]]] = {}
    for case in OP_CASES:
        graph = case.graph()
        node = graph["op"]
        found.setdefault(node.op, []).append((dict(node.attrs), [graph.shapes[i] for i in node.inputs], case.name))
    return found


def _token_cases() -> str:
    from aiperf_conformance.cases import OP_CASES

    return ", ".join(f"`{case.name}`" for case in OP_CASES if case.graph().takes_tokens)


def _shown(value) -> str:
    value = list(value) if isinstance(value, tuple) else value
    return str(value).replace(" ", "").replace("True", "true").replace("False", "false")


def _attributes(spec, examples: list[dict]) -> list[str]:
    """Each attribute as `name` (required) or `name`=default; a default that differs between
    examples is named after the attribute it always equals (max_pool's strides = its kernel)."""
    out = []
    for key in spec.parse("op", examples[0]):
        defaults = []
        for attrs in examples:
            try:
                defaults.append(spec.parse("op", {k: v for k, v in attrs.items() if k != key})[key])
            except GraphError:
                break
        if len(defaults) < len(examples):
            out.append(f"`{key}`")
        elif all(d == defaults[0] for d in defaults):
            out.append(f"`{key}`={_shown(defaults[0])}")
        else:
            same = [k for k in examples[0] if k != key and all(tuple(a.get(k) or ()) == tuple(d) for a, d in
                                                               zip(examples, defaults))]
            out.append(f"`{key}`=`{same[0]}`" if same else f"`{key}`=(depends on the others)")
    return out


def _parameters(spec, attrs: dict, shapes: list) -> list[str]:
    if spec.params is None:
        return []
    parsed = spec.parse("op", attrs)
    flags = [k for k, v in parsed.items() if isinstance(v, bool)]
    base = set(spec.params(dict(parsed, **{k: False for k in flags}), shapes))
    names = list(spec.params(parsed, shapes))
    for flag in flags:
        names += [n for n in spec.params(dict(parsed, **{flag: True}), shapes) if n not in names]
    return [f"`{n}`" if n in base else f"`{n}` (if `{next(f for f in flags if n in spec.params(dict(parsed, **{f: True}), shapes))}`)"
            for n in names]


def render_ops() -> str:
    examples = _op_examples()
    rows = ["| op | inputs | attributes (`name`=default; no default: required) | parameters | kit cases |",
            "| --- | --- | --- | --- | --- |"]
    for name, spec in OPS.items():
        if name in _INPUT_EXAMPLES:
            found = [(_INPUT_EXAMPLES[name], [], "")]
            cases = "every case" if name == "input" else _token_cases()
        elif name in examples:
            found = examples[name]
            cases = ", ".join(f"`{case}`" for _, _, case in found)
        else:
            raise AiperfError(f"IR op '{name}' has no case in aiperf_conformance.cases.OP_CASES: add one")
        if spec.max_inputs is None:
            inputs = f"{spec.min_inputs} or more"
        else:
            inputs = str(spec.min_inputs) if spec.min_inputs == spec.max_inputs else f"{spec.min_inputs}-{spec.max_inputs}"
        attrs, shapes, _ = found[0]
        rows.append(f"| `{name}` | {inputs} | {', '.join(_attributes(spec, [a for a, _, _ in found])) or '-'} | "
                    f"{', '.join(_parameters(spec, attrs, shapes)) or '-'} | {cases} |")
    return "\n".join(rows)


def render_checks() -> str:
    from aiperf_conformance.levels.parallel import applies_to

    rows = ["| check id (at fp32) | at precisions | native counter | applies to | workload "
            "| needs (beyond the CNN ops) |", "| --- | --- | --- | --- | --- | --- |"]
    # A check that a level runs per precision may still be fp32 only (train/gpt_moe_expert_load's exact counts).
    per_precision = {(c.level, c.name) for c in catalogue(LEVELS, ("bf16",)) if c.precision == "bf16"}
    for check in catalogue(LEVELS, ("fp32",)):
        precisions = "every declared" if (check.level, check.name) in per_precision else "fp32"
        applies = applies_to(check.name) if check.level == "parallel" else "every backend"
        needs = ", ".join(f"`{op}`" for op in sorted(check.ops)) or "-"
        rows.append(f"| `{check.id}` | {precisions} | {'needed' if check.needs_counter else '-'} | {applies} | "
                    f"{check.workload} | {needs} |")
    return "\n".join(rows)


def render_tolerances() -> str:
    from aiperf_conformance.expectations import TOLERANCE_KEYS, load_defaults

    table, _ = load_defaults()
    rows = ["| key | " + " | ".join(PRECISIONS) + " |", "| --- |" + " --- |" * len(PRECISIONS)]
    for key in TOLERANCE_KEYS:
        cells = [f"{table[p][key].value:g}" if key in table[p] else "-" for p in PRECISIONS]
        rows.append(f"| `{key}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


SECTIONS = {"levels": render_levels, "ops": render_ops, "checks": render_checks, "tolerances": render_tolerances}


def regenerate(text: str) -> tuple[str, list[str]]:
    """(the text with every generated block rendered anew, the names of the blocks that changed)."""
    changed: list[str] = []
    seen: set[str] = set()

    def replace(match: re.Match) -> str:
        begin, name, body, end = match.group(1), match.group(2), match.group(3), match.group(4)
        if name not in SECTIONS:
            raise AiperfError(f"unknown generated section '{name}' (sections: {', '.join(SECTIONS)})")
        seen.add(name)
        fresh = SECTIONS[name]() + "\n"
        if fresh != body:
            changed.append(name)
        return begin + fresh + end

    out = _BLOCK.sub(replace, text)
    missing = [name for name in SECTIONS if name not in seen]
    if missing:
        raise AiperfError(f"the guide has no generated section '{missing[0]}'")
    return out, changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aiperf_conformance.guide", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 and name the stale sections if any")
    mode.add_argument("--write", action="store_true", help="rewrite the generated sections in place")
    parser.add_argument("guide", nargs="?", default=str(GUIDE), help=f"the guide (default: {GUIDE})")
    args = parser.parse_args(argv)
    path = Path(args.guide)
    try:
        fresh, changed = regenerate(path.read_text())
    except (OSError, AiperfError) as exc:
        print(f"guide: error: {exc}", file=sys.stderr)
        return 2
    if args.write:
        if changed:
            from aiperf_core.atomic import write_text_atomic

            write_text_atomic(path, fresh)
        print(f"{path}: regenerated {', '.join(changed) or 'nothing (up to date)'}")
        return 0
    if changed:
        print(f"{path}: stale generated sections: {', '.join(changed)} "
              f"(python -m aiperf_conformance.guide --write {path})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
