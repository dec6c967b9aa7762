"""The flops profile as text: totals, the top modules at each depth, and a per-module table."""
from __future__ import annotations

from typing import List, Optional

from .counter import ModuleStats, Profile

_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def si(value: float, unit: str = "", digits: int = 2) -> str:
    """12345678 -> '12.35 M' (+ unit); decimal prefixes, as flops and parameters are quoted."""
    for scale, prefix in _PREFIXES:
        if abs(value) >= scale:
            return f"{value / scale:.{digits}f} {prefix}{unit}"
    return f"{value:.{digits}f} {unit}".rstrip() if isinstance(value, float) else f"{value} {unit}".rstrip()


def seconds(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.2f} ms" if value < 10 else f"{value:.2f} s"


def share(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def format_report(profile: Profile, module_depth: int = -1, top_modules: int = 1,
                  detailed: bool = True) -> str:
    """The whole report; module_depth -1 shows every level."""
    depth = _max_depth(profile) if module_depth < 0 else module_depth
    lines = _summary(profile)
    lines += _top(profile, depth, top_modules)
    if detailed:
        lines += _table(profile, depth)
    return "\n".join(lines) + "\n"


def _summary(p: Profile) -> List[str]:
    rows = [("model", p.model or "-"),
            ("samples per pass", "-" if p.samples is None else str(p.samples)),
            ("params", si(p.params)),
            ("flops", si(p.flops, "FLOPs")),
            ("MACs", si(p.macs, "MACs"))]
    if p.flops != p.forward_flops:
        rows.append(("forward / backward flops", f"{si(p.forward_flops, 'FLOPs')} / "
                                                 f"{si(p.backward_flops, 'FLOPs')}"))
    inside = p.modules[""].flops if "" in p.modules else p.flops
    if p.flops != inside:
        rows.append(("flops outside the model", si(p.flops - inside, "FLOPs") + " (e.g. the loss)"))
    for label, secs, flops in (("forward", p.forward_s, p.forward_flops),
                               ("backward", p.backward_s, p.backward_flops)):
        if secs:
            rows.append((f"{label} latency", f"{seconds(secs)} ({si(flops / secs, 'FLOPS')})"))
    width = max(len(k) for k, _ in rows)
    bar = "-" * 24
    lines = [f"{bar} flops profile: {p.title} {bar}"]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    lines += [f"note: {n}" for n in p.notes]
    return lines


def _max_depth(p: Profile) -> int:
    return max((m.depth for m in p.modules.values()), default=0)


def _top(p: Profile, depth: int, n: int) -> List[str]:
    lines = ["", f"top {n} module(s) by flops at each depth:"]
    for d in range(1, depth + 1):
        at = sorted((m for m in p.modules.values() if m.depth == d), key=lambda m: -m.flops)[:n]
        if not at:
            break
        lines.append(f"  depth {d}: " + ", ".join(
            f"{m.name} {si(m.flops, 'FLOPs')} ({share(m.flops, p.flops)})" for m in at))
    return lines


def _table(p: Profile, depth: int) -> List[str]:
    split = p.flops != p.forward_flops
    head = ["module", "params", "flops", "share"] + (["fwd flops"] if split else []) + \
           ["fwd latency", "calls"]
    rows = [head]
    for m in p.modules.values():
        if m.depth <= depth:
            rows.append(_row(m, p, split))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    out = ["", "per module (flops and latency include children; share of all flops):"]
    for r in rows:
        out.append("  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]))
    return out


def _row(m: ModuleStats, p: Profile, split: bool) -> List[str]:
    label = "  " * m.depth + (m.name.rsplit(".", 1)[-1] if m.name else p.model or "(model)")
    row = [label, si(m.params), si(m.flops), share(m.flops, p.flops)]
    if split:
        row.append(si(m.forward_flops))
    row += [seconds(m.latency_s) if m.calls else "-", str(m.calls) if m.calls else "-"]
    return row
