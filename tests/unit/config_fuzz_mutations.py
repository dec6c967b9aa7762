"""The mutation generators of the config fuzz corpus (rules and bases: config_fuzz_corpus.py).

Each generator yields Mutations of one base config with their expected outcome; `garbage()` yields
whole-file inputs that belong to no base. The seeded random.Random only picks among variants
(which character a typo drops, which wrong-type values a leaf gets), so the corpus is the same on
every run.
"""
from __future__ import annotations

import dataclasses
import json
import random
from typing import Any, Iterator, List, Literal, Set, get_args, get_origin, get_type_hints

from hybrid_ray.config import Config
from hybrid_ray.config.optim import (_DEEPSPEED_ONLY, ENGINE_CHOSEN, SCHEDULER_PARAMS,
                                     optimizer_params_schema)

from tests.unit.config_fuzz_corpus import (_CASE_FREE, _LEGACY_BOOL, Mutation, batch_outcome, dotted,
                                           hint_at, key_paths, leaf_paths, merged, renamed, replaced,
                                           type_ok, with_batch)

WRONG_TYPES = ["7", [], {}, True, 7, 1.5, [1, 2], None, float("nan"), float("inf")]
HUGE = 10**5000  # past Python's int-string limit: json.dumps cannot write it, so files get text
# (bad values, good values) per key name; the good ones hold in every base that has the key.
RANGES = {
    "train_batch_size": ([0, -8], []),
    "train_micro_batch_size_per_gpu": ([0, -1], []),
    "gradient_accumulation_steps": ([0, -2], []),
    "stage": ([-1, 4, 7], [1, 2]),  # 0 is a contradiction with offload (contradictions())
    "steps_per_print": ([0, -5], [1, 10**6]),
    "gradient_clipping": ([-1.0, -1e-9], [0, 1e300]),
    "seed": ([-1, 2**32], [0, 2**32 - 1]),
    "lr": ([-1e-3, -1], [0, 1e300]),
    "weight_decay": ([-0.01], [0, 0.5]),
    "eps": ([-1e-8], [0]),
    "betas": ([[1.0, 0.9], [0.9, 1.0], [-0.1, 0.9], [0.9, 2]], [[0.0, 0.0], [0.5, 0.999]]),
    "loss_scale_window": ([0, -1], [1]),
    "initial_scale_power": ([-1, 65], [0, 64]),  # min_loss_scale is 1 in every base: 1 <= 2**0
    "hysteresis": ([0, -3], [1]),
    "min_loss_scale": ([0, -1.0], [1e-3]),
    "loss_scale": ([-1.0], [128.0]),
    "warmup_num_steps": ([-1], [0, 1]),  # 0: DeepSpeed's 2-step warm-up, as 1 is
    "total_num_steps": ([0, -1], []),
    "warmup_min_ratio": ([-0.1, 1.5], [0, 1]),
    "cos_min_ratio": ([-0.1, 1.01], [0, 1]),
    "warmup_min_lr": ([-1e-5], [0, 3e-5]),
    "warmup_max_lr": ([-1e-5], [0]),
    "reduce_bucket_size": ([0, -1], [1]),
    "stage3_prefetch_bucket_size": ([-1], [0]),
    "stage3_param_persistence_threshold": ([-1], [0]),
    "stage3_max_live_parameters": ([-1], [0]),
    "stage3_max_reuse_distance": ([-1], [0]),
    "sub_group_size": ([0], [1]),
}


def known_keys() -> Set[str]:
    """Every key name the schema knows anywhere, so a typo never lands on a real key."""
    names: Set[str] = set(ENGINE_CHOSEN) | set(_DEEPSPEED_ONLY)
    todo: List[Any] = [Config, *SCHEDULER_PARAMS.values()]
    while todo:
        cls = todo.pop()
        for f in dataclasses.fields(cls):
            names.add(f.name)
            hint = get_type_hints(cls)[f.name]
            todo += [a for a in (hint, *get_args(hint)) if dataclasses.is_dataclass(a)]
    for kind in ("AdamW", "Adam", "SGD"):
        names |= set(optimizer_params_schema(kind))
    return names


def typos(key: str, r: random.Random, known: Set[str]) -> List[str]:
    """Two distinct misspellings: a dropped, doubled or swapped character, or a wrong case."""
    i = r.randrange(len(key))
    j = min(i, len(key) - 2)
    candidates = [key[:i] + key[i + 1:], key[:i] + key[i] + key[i:],
                  key[:j] + key[j + 1] + key[j] + key[j + 2:] if len(key) > 1 else key + key,
                  key.upper(), key + "s"]
    out = [c for c in dict.fromkeys(candidates) if c and c != key and c not in known]
    return r.sample(out, 2)


def key_typos(name: str, base: dict, r: random.Random, known: Set[str]) -> Iterator[Mutation]:
    for path in key_paths(base):
        for typo in typos(path[-1], r, known):
            yield Mutation(f"{name}: key {dotted(path)} -> {typo}", renamed(base, path, typo),
                           "refuse", f"{dotted(path[:-1] + (typo,))}: unknown key")


def wrong_types(name: str, base: dict, r: random.Random) -> Iterator[Mutation]:
    """Values of a type the key does not take, at every leaf and every section: three picked
    from WRONG_TYPES, and null wherever the key is not nullable (nullable ones: nulls())."""
    paths = list(leaf_paths(base)) + [p for p in key_paths(base) if isinstance(_at(base, p), dict)]
    for path in paths:
        hint, null_ok = hint_at(base, path)
        literal = get_origin(_unwrap_optional(hint)) is Literal
        wrong = [v for v in WRONG_TYPES if v is not None and v != _at(base, path)
                 and not type_ok(hint, v, dotted(path) in _CASE_FREE)
                 and not (isinstance(v, bool) and dotted(path) in _LEGACY_BOOL)]
        picks = r.sample(wrong, min(3, len(wrong))) + ([] if null_ok else [None])
        for value in picks:
            problem = "invalid value" if literal else "expected"
            yield Mutation(f"{name}: {dotted(path)} = {value!r}", replaced(base, path, value),
                           "refuse", f"{dotted(path)}: {problem}")


def nulls(name: str, base: dict) -> Iterator[Mutation]:
    """null where the schema allows it: the config is then as valid as its batch sizes."""
    for path in key_paths(base):
        _, null_ok = hint_at(base, path)
        if null_ok and _at(base, path) is not None:
            cfg = replaced(base, path, None)
            yield Mutation(f"{name}: {dotted(path)} = null", cfg, *batch_outcome(cfg))


def out_of_range(name: str, base: dict) -> Iterator[Mutation]:
    for path in leaf_paths(base):
        if isinstance(path[-1], int) or path[-1] not in RANGES:
            continue
        bad, good = RANGES[path[-1]]
        for value in bad:
            where = dotted(path)
            if isinstance(value, list):  # betas: the first item outside [0, 1)
                where += f"[{next(i for i, v in enumerate(value) if not 0 <= v < 1)}]"
            yield Mutation(f"{name}: {dotted(path)} = {value!r}", replaced(base, path, value),
                           "refuse", f"{where}: out of range")
        for value in good:
            cfg = replaced(base, path, value)
            yield Mutation(f"{name}: {dotted(path)} = {value!r}", cfg, *batch_outcome(cfg))


def huge_values(name: str, base: dict, r: random.Random) -> Iterator[Mutation]:
    """2**63 at every leaf, 1e300 at every integer leaf, 10**5000 at three leaves (in the file a
    5001-digit literal, which json.dumps cannot write: Python's int-string limit)."""
    leaves = list(leaf_paths(base))
    for path in leaves:
        yield Mutation(f"{name}: {dotted(path)} = 2**63", replaced(base, path, 2**63), "refuse",
                       f"{dotted(path)}: out of range")
        if _unwrap_optional(hint_at(base, path)[0]) is int:
            yield Mutation(f"{name}: {dotted(path)} = 1e300", replaced(base, path, 1e300),
                           "refuse", f"{dotted(path)}: out of range")
    for path in r.sample(leaves, min(3, len(leaves))):
        text = json.dumps(replaced(base, path, "@HUGE@")).replace('"@HUGE@"', "1" + "0" * 5000)
        # The dict's message counts bits, the file's digits: the same key, another measure.
        yield Mutation(f"{name}: {dotted(path)} = 10**5000", replaced(base, path, HUGE), "refuse",
                       f"{dotted(path)}: out of range", text=text.encode(), same_message=False)


def literal_values(name: str, base: dict) -> Iterator[Mutation]:
    """Each string choice in another case and misspelt: only optimizer and scheduler types are
    matched ignoring case (a typo that lands on another choice, AdamW -> Adam, is that choice)."""
    for path in leaf_paths(base):
        value = _at(base, path)
        if not isinstance(value, str):
            continue
        hint, _ = hint_at(base, path)
        for variant in dict.fromkeys([value.upper(), value.lower(), value[:-1], value + "x"]):
            if variant == value:
                continue
            ok = type_ok(hint, variant, dotted(path) in _CASE_FREE)
            cfg = replaced(base, path, variant)
            yield Mutation(f"{name}: {dotted(path)} = {variant!r}", cfg,
                           *(batch_outcome(cfg) if ok else ("refuse", f"{dotted(path)}: invalid value")))


def _at(cfg: Any, path: tuple) -> Any:
    for key in path:
        cfg = cfg[key]
    return cfg


def _unwrap_optional(hint: Any) -> Any:
    args = [a for a in get_args(hint) if a is not type(None)]
    return args[0] if args and type(None) in get_args(hint) else hint


# ---- cross-field rules, batch arithmetic, unsupported features --------------------------------

# (b, m, g): batch_outcome classifies each; chosen to hit every branch of the rule.
TRIPLES = [(7, 2, 2), (4, 2, 4), (3, 2, None), (5, None, 2), (None, None, 4), (None, None, None),
           (9, 2, None), (8, 2, 2), (12, 2, 3), (16, 4, 2), (16, 4, None), (6, None, 3),
           (None, 4, 3), (8, None, None), (None, 1, None), (4, 2, 2), (16.0, 4.0, None),
           (2**63 - 1, None, None)]
FP16 = ("fp16",)


def batches(name: str, base: dict) -> Iterator[Mutation]:
    for b, m, g in TRIPLES:
        cfg = with_batch(base, b, m, g)
        yield Mutation(f"{name}: batch {b}, {m}, {g}", cfg, *batch_outcome(cfg))


def contradictions(name: str, base: dict) -> Iterator[Mutation]:
    """Each rule that spans keys, broken and kept, on this base (its batch sizes are valid)."""
    def case(what: str, cfg: dict, expect: str, prefix: str = "") -> Mutation:
        return Mutation(f"{name}: {what}", cfg, expect, prefix)

    both = merged(merged(base, FP16, {"enabled": True}), ("bf16",), {"enabled": True})
    yield case("fp16 and bf16", both, "refuse", "fp16.enabled, bf16.enabled: contradiction")
    # The dynamic scale starts at 2**initial_scale_power and never goes below min_loss_scale;
    # checked while fp16 is off too (fp16 modules use the section), moot for a static scale.
    floor = "fp16.min_loss_scale: out of range"
    yield case("min scale > start", merged(base, FP16, {"initial_scale_power": 3, "min_loss_scale": 9}),
               "refuse", floor)
    yield case("min scale = start", merged(base, FP16, {"initial_scale_power": 3, "min_loss_scale": 8}),
               "accept")
    yield case("min scale > static", merged(base, FP16, {"initial_scale_power": 3, "min_loss_scale": 9,
                                                         "loss_scale": 128}), "accept")
    yield from _scheduler_rules(name, base)
    yield from _optimizer_rules(name, base)
    zero = ("zero_optimization",)
    yield case("offload at stage 0", merged(base, zero, {"stage": 0, "offload_optimizer": {"device": "cpu"}}),
               "refuse", "zero_optimization.offload_optimizer.device: needs ZeRO stage 1")
    comp = {"gradient_compression": {"type": "fp16"}, "communication_data_type": "bf16"}
    yield case("compression dtype", {**base, **comp}, "refuse",
               "gradient_compression.type, communication_data_type: contradiction")
    for kind in ("bf16", "topk", "powersgd", "auto"):
        yield case(f"compression {kind}", {**base, "gradient_compression": {"type": kind},
                                           "communication_data_type": "bf16" if kind == "bf16" else None},
                   "accept")
    yield case("keep_every alone", {**base, "checkpoint": {"keep_every": 5}}, "refuse",
               "checkpoint.keep_every: needs keep_last")
    yield case("keep_every with keep_last", {**base, "checkpoint": {"keep_every": 5, "keep_last": 2}},
               "accept")
    steps = [{"step": 10, "dtype": "fp32"}, {"step": 5, "dtype": "bf16"}]
    yield case("schedule descending", {**base, "precision": {"schedule": steps}}, "refuse",
               "precision.schedule[1].step: not ascending")
    yield case("schedule ascending", {**base, "precision": {"schedule": steps[::-1]}}, "accept")
    yield case("module regex", {**base, "precision": {"modules": {"(": "fp16"}}}, "refuse",
               "precision.modules['(']: invalid regular expression")
    yield case("checkpointing on", {**base, "activation_checkpointing": {"enabled": True}}, "accept")
    yield case("checkpointing regex", {**base, "activation_checkpointing": {"module_pattern": "(("}},
               "refuse", "activation_checkpointing.module_pattern: invalid regular expression")
    yield from _unsupported(name, base)


def _scheduler_rules(name: str, base: dict) -> Iterator[Mutation]:
    sched = base.get("scheduler")
    tv = "scheduler.params.total_num_steps, scheduler.params.warmup_num_steps: contradiction"
    if sched and sched["type"] == "WarmupLR":
        # A warm-up from a higher to a lower lr: DeepSpeed's WarmupLR computes it as written
        # (a ramp down), so it is accepted, not read as a swapped pair.
        down = merged(base, ("scheduler", "params"), {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-5})
        yield Mutation(f"{name}: warmup_min_lr > warmup_max_lr", down, "accept")
        decay = merged(base, ("scheduler",), {"type": "WarmupDecayLR"})
        yield Mutation(f"{name}: decay without total", decay, "refuse",
                       "scheduler.params.total_num_steps: missing required key")
    if sched and "total_num_steps" in sched["params"]:
        warm = sched["params"]["warmup_num_steps"]
        for total, expect in ((warm, "refuse"), (warm - 1, "refuse"), (warm + 1, "accept")):
            cfg = merged(base, ("scheduler", "params"), {"total_num_steps": total})
            yield Mutation(f"{name}: total {total}, warmup {warm}", cfg, expect,
                           tv if expect == "refuse" else "")
        lr = merged(base, ("scheduler",), {"type": "WarmupLR"})
        yield Mutation(f"{name}: cosine params under WarmupLR", lr, "refuse",
                       "scheduler.params.total_num_steps: unknown key")
    for params in ({"warmup_num_steps": 0}, {"total_num_steps": 10, "warmup_num_steps": 0}):
        kind = "WarmupDecayLR" if "total_num_steps" in params else "WarmupLR"
        yield Mutation(f"{name}: {kind} {params}", {**base, "scheduler": {"type": kind, "params": params}},
                       "accept")


def _optimizer_rules(name: str, base: dict) -> Iterator[Mutation]:
    """torch's SGD refuses Nesterov momentum without momentum or with dampening."""
    nesterov = "optimizer.params.nesterov: needs momentum > 0 and dampening 0"
    for params, expect in (({"nesterov": True}, "refuse"), ({"nesterov": True, "momentum": 0}, "refuse"),
                           ({"nesterov": True, "momentum": 0.9}, "accept"),
                           ({"nesterov": True, "momentum": 0.9, "dampening": 0.1}, "refuse"),
                           ({"nesterov": False}, "accept"), ({"momentum": 0.9, "dampening": 0.5}, "accept")):
        cfg = {**base, "optimizer": {"type": "SGD", "params": {"lr": 0.1, **params}}}
        yield Mutation(f"{name}: SGD {params}", cfg, expect, nesterov if expect == "refuse" else "")
    params = base.get("optimizer", {}).get("params", {})
    foreign = [k for k in params if k not in optimizer_params_schema("SGD")]
    cfg = merged(base, ("optimizer",), {"type": "SGD"})
    yield Mutation(f"{name}: {params} under SGD", cfg, *(
        ("refuse", f"optimizer.params.{foreign[0]}: unknown key") if foreign else ("accept", "")))


def _unsupported(name: str, base: dict) -> Iterator[Mutation]:
    zero = ("zero_optimization",)
    stage = {"stage": max(1, base.get("zero_optimization", {}).get("stage", 1))}
    cases = [
        (merged(base, zero + ("offload_param",), {"device": "cpu"}), "zero_optimization.offload_param.device"),
        (merged(merged(base, zero, stage), zero + ("offload_optimizer",), {"device": "nvme"}),
         "zero_optimization.offload_optimizer.device"),
        (merged(base, ("activation_checkpointing",), {"partition_activations": True}),
         "activation_checkpointing.partition_activations"),
    ]
    for cfg, key in cases:
        yield Mutation(f"{name}: {key} unsupported", cfg, "unsupported", f"{key}: not supported yet")
    # Model parallel sizes load; a world of one process cannot hold a replica split in two.
    for key, size in (("tensor_model_parallel_size", 2), ("pipeline_model_parallel_size", 4)):
        yield Mutation(f"{name}: {key} {size}", {**base, key: size}, "world", "")
