"""aiperf backends: every registered backend, available or not, with why not."""

from __future__ import annotations

import json

HELP = "list the registered backends with their framework versions and devices, or why they are unavailable"


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="config file (default: $AIPERF_CONFIG, else ./aiperf.toml if present)")


def run(args) -> int:
    from aiperf_core.config_file import load_config
    from aiperf_core.registry import DEFAULT_BACKEND, list_backends, resolve_backend_name

    infos = list_backends()
    selected = resolve_backend_name(config=load_config(args.config))
    if args.json:
        print(json.dumps({"selected": selected, "default": DEFAULT_BACKEND,
                          "backends": [i.to_dict() for i in infos]}))
        return 0
    if not infos:
        print("no backends are installed (entry-point group 'aiperf.backends')")
        return 0
    width = max(len(i.name) for i in infos)
    for i in infos:
        mark = "*" if i.name == selected else " "
        if i.available:
            print(f"{mark} {i.name:<{width}}  available    {i.version}  devices: {', '.join(i.devices)}"
                  f"  precisions: {', '.join(i.precisions)}")
        else:
            print(f"{mark} {i.name:<{width}}  unavailable: {i.reason}")
    if selected not in {i.name for i in infos}:
        print(f"selected: '{selected}', which is not installed")
    else:
        print(f"(* selected: '{selected}' from $AIPERF_BACKEND, the config file or the default)")
    return 0
