"""`hybrid-ray checkpoint inspect|export`: look into checkpoints and export the model offline.

    hybrid-ray checkpoint inspect PATH [--tag T] [--quick] [--json]
    hybrid-ray checkpoint export PATH OUT [--dtype fp32|bf16] [--tag T]

PATH is a save directory (every checkpoint in it, `latest` marked) or one checkpoint directory,
a local path or a URI (s3://...). Neither command needs a process group or the model's code.
Exit codes: 0 ok, 1 a corrupt or incomplete checkpoint (inspect) or a failed export, 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List

EXIT_CORRUPT, EXIT_INPUT = 1, 2


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register `checkpoint inspect` and `checkpoint export` under the top-level parser."""
    ckpt = sub.add_parser("checkpoint", help="inspect checkpoints, export a model from one")
    actions = ckpt.add_subparsers(dest="action", required=True, metavar="{inspect,export}")
    inspect = actions.add_parser("inspect", help="step, world size, stage, files and their checksums")
    inspect.add_argument("path", help="save directory or checkpoint directory (path or URI)")
    inspect.add_argument("--tag", help="only this checkpoint of a save directory")
    inspect.add_argument("--quick", action="store_true",
                         help="compare file sizes with the manifest; skip reading files for sha256")
    inspect.add_argument("--json", action="store_true", help="print a JSON list instead of text")
    inspect.set_defaults(func=inspect_command)
    export = actions.add_parser("export", help="consolidated model state_dict (.safetensors or .pt)")
    export.add_argument("path", help="save directory (its latest good checkpoint) or checkpoint directory")
    export.add_argument("out", help="output file: .safetensors or .pt (path or URI)")
    export.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="dtype of the parameters (buffers keep theirs); default fp32")
    export.add_argument("--tag", help="checkpoint of the save directory to export (default: latest)")
    export.set_defaults(func=export_command)


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return str(n)


def _describe(report, latest: str) -> List[str]:
    """Text lines for one checkpoint's report."""
    mark = "  [latest]" if report.tag == latest else ""
    if not report.committed:
        return [f"{report.tag}{mark}: NOT COMMITTED ({report.error})"]
    lines = [f"{report.tag}{mark}: {'ok' if report.ok else 'CORRUPT'}"
             + (f" ({report.error})" if report.error else "")]
    m = report.meta
    if m:
        numel = sum(_numel(p["shape"]) for p in m.get("params", []))
        lines.append(f"  step {m['counters'].get('global_steps')}, saved by {m['world_size']} rank(s) "
                     f"at ZeRO stage {m['zero_stage']}, precision {m.get('precision')}, "
                     f"{numel:,} trained parameters in {len(m.get('params', []))} tensors")
    total = sum(size for size, _ in report.files.values())
    lines.append(f"  {len(report.files)} files, {_size(total)}:")
    width = max((len(n) for n in report.files), default=0)
    lines += [f"    {name:<{width}}  {_size(size):>10}  {status}"
              for name, (size, status) in report.files.items()]
    return lines


def _as_json(report, latest: str) -> dict:
    m = report.meta
    return {"tag": report.tag, "latest": report.tag == latest, "committed": report.committed,
            "ok": report.ok, "error": report.error, "step": m.get("counters", {}).get("global_steps"),
            "world_size": m.get("world_size"), "zero_stage": m.get("zero_stage"),
            "precision": m.get("precision"),
            "files": {n: {"bytes": b, "status": s} for n, (b, s) in report.files.items()}}


def _numel(shape: List[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def inspect_command(args: argparse.Namespace) -> int:
    from hybrid_ray.engine.checkpoint import offline
    from hybrid_ray.engine.checkpoint import read as cread
    from hybrid_ray.engine.checkpoint.storage import CheckpointError

    try:
        fs, root, tags = offline.locate(args.path, args.tag)
        latest = cread.latest_tag(fs, root) or ""
        reports = [offline.inspect(fs, root, tag, verify=not args.quick) for tag in tags]
    except (CheckpointError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INPUT
    if args.json:
        print(json.dumps([_as_json(r, latest) for r in reports], indent=1))
    else:
        print(f"{root}: {len(reports)} checkpoint(s), latest -> {latest or '(none)'}")
        for report in reports:
            print("\n".join(_describe(report, latest)))
    # a save directory may hold an unfinished save; a named tag or a committed one must be whole
    bad = [r for r in reports if not r.ok and (r.committed or args.tag is not None or len(reports) == 1)]
    return EXIT_CORRUPT if bad else 0


def export_command(args: argparse.Namespace) -> int:
    import torch

    from hybrid_ray.engine.checkpoint import offline
    from hybrid_ray.engine.checkpoint.storage import CheckpointError

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    try:
        ckpt, state = offline.export(args.path, args.out, dtype, args.tag)
    except (CheckpointError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CORRUPT
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    print(f"exported {ckpt} -> {args.out}: {len(state)} tensors, {_size(nbytes)} ({args.dtype})")
    return 0
