"""The config fuzz corpus: seeded mutations of real configs, each with the outcome it must have.

Bases: the seed's ds_config.json, a DeepSpeed-style ZeRO-3 + CPU offload + fp16 + WarmupLR
config, and the `engine` sections of jobs/configs/*.json. Every mutation states what it expects,
from rules written here (the schema's type hints say which type a key has; what each type accepts
and which cross-field rules hold is restated below, not read from the loader):

    accept           load_config returns, and so does initialize at world size 1
    refuse           ConfigError whose message starts with `prefix`
    unsupported      NotSupportedError whose message starts with `prefix`
    world            load_config returns (some data-parallel size can run the batch); at world
                     size 1 initialize refuses with the message of resolve_batch(1)

Mutations that are valid only by a rule with a judgement in it are classified by that rule, and
the rule is named where it is made (a decreasing warm-up is accepted, as DeepSpeed accepts it).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import random
from pathlib import Path
from typing import (Any, Iterator, List, Literal, Optional, Tuple, Union, get_args, get_origin,
                    get_type_hints)

from hybrid_ray.config import Config, OptimizerConfig, SchedulerConfig
from hybrid_ray.config.optim import SCHEDULER_PARAMS, optimizer_params_schema

REPO = Path(__file__).resolve().parents[2]
SEED = 20240611

# The seed's ds_config.json (FEATURES.md section 2.3), verbatim.
SEED_DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "optimizer": {"type": "AdamW", "params": {"lr": 5e-5, "weight_decay": 0.01}},
    "fp16": {"enabled": True, "loss_scale_window": 1000, "initial_scale_power": 16},
}
# DeepSpeed's ZeRO-3 + CPU offload + fp16 + WarmupLR recipe (offload_param is left out: it is
# not supported yet, and a mutation adds it).
ZERO3_OFFLOAD = {
    "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8,
    "steps_per_print": 100, "gradient_clipping": 1.0, "wall_clock_breakdown": False,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                              "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5,
                                                 "warmup_num_steps": 500, "warmup_type": "linear"}},
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 5e7,
        "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True, "sub_group_size": 1e9},
    "activation_checkpointing": {
        "partition_activations": False, "cpu_checkpointing": False,
        "contiguous_memory_optimization": False, "number_checkpoints": None,
        "synchronize_checkpoint_boundary": False, "profile": False},
}
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_CASE_FREE = {"optimizer.type", "scheduler.type"}  # Literal keys matched ignoring case
_LEGACY_BOOL = {"zero_optimization"}  # sections DeepSpeed's old format gives as true/false (config/legacy.py)


@dataclasses.dataclass
class Mutation:
    name: str
    raw: Any  # what load_config gets directly (None for a file-only case)
    expect: str  # accept | refuse | unsupported | world
    prefix: str = ""
    text: Optional[bytes] = None  # the file's bytes when json.dumps(raw) cannot write them
    in_dict: bool = True  # also loaded as a dict (False: only a file can hold it)
    in_file: bool = True  # also written to a file (False: no JSON text holds it)
    same_message: bool = True  # the dict and the file are refused with the same message

    def file_bytes(self) -> bytes:
        return self.text if self.text is not None else json.dumps(self.raw).encode()


def bases() -> List[Tuple[str, dict]]:
    out = [("seed", SEED_DS_CONFIG), ("zero3", ZERO3_OFFLOAD)]
    for path in sorted((REPO / "jobs" / "configs").glob("*.json")):
        engine = json.loads(path.read_text())["engine"]
        # The mutations run at world size 1; a job file that splits the model over several
        # processes cannot load there at all (the "world" kind covers T and P).
        if engine.get("tensor_model_parallel_size", 1) * engine.get("pipeline_model_parallel_size", 1) == 1:
            out.append((path.stem, engine))
    return out


# ---- the schema's type at a key path, and what a type accepts --------------------------------

def hint_at(cfg: dict, path: Tuple) -> Tuple[Any, bool]:
    """(type hint, null allowed) of the value at `path` (keys and list indexes) in `cfg`."""
    hint, null_ok, node = Config, False, cfg
    for key in path:
        hint = _unwrap(hint)
        if hint is OptimizerConfig and key == "params":
            kind = _canonical(node.get("type", "AdamW"), ("AdamW", "Adam", "SGD"))
            hint, null_ok = dict[str, Any], False
            schema = optimizer_params_schema(kind)
        elif hint is SchedulerConfig and key == "params":
            hint, null_ok = SCHEDULER_PARAMS[_canonical(node["type"], tuple(SCHEDULER_PARAMS))], False
        elif dataclasses.is_dataclass(hint):
            field = {f.name: f for f in dataclasses.fields(hint)}[key]
            hint = get_type_hints(hint)[key]
            null_ok = _is_optional(hint) or bool(field.metadata.get("null_is_default"))
        elif get_origin(hint) is dict:
            hint, null_ok = schema[key], False
        else:  # a tuple (betas)
            hint, null_ok = get_args(hint)[key], False
        node = node[key]
    return hint, null_ok


def _unwrap(hint: Any) -> Any:
    args = [a for a in get_args(hint) if a is not type(None)]
    return args[0] if get_origin(hint) is Union else hint


def _is_optional(hint: Any) -> bool:
    return get_origin(hint) is Union and type(None) in get_args(hint)


def _canonical(name: str, choices: tuple) -> str:
    return next(c for c in choices if c.lower() == str(name).lower())


def type_ok(hint: Any, value: Any, case_free: bool = False) -> bool:
    """Whether `value` has the type `hint` asks for (ranges aside): bool is never a number, an
    int field takes an integral float (5e8), a float field an int; Literal is an exact match."""
    hint = _unwrap(hint) if value is not None else hint
    if value is None:
        return _is_optional(hint)
    if get_origin(hint) is Literal:
        match = (lambda a, b: a.lower() == b.lower()) if case_free else (lambda a, b: a == b)
        # exact types, as the loader: Literal[True, False, "auto"] takes no 1 nor "true"
        return any(type(value) is type(c) and (match(value, c) if isinstance(c, str) else value == c)
                   for c in get_args(hint))
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return not isinstance(value, bool) and (isinstance(value, int) or (
            isinstance(value, float) and value.is_integer()))
    if hint is float:
        return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if get_origin(hint) is tuple:
        return isinstance(value, list) and len(value) == len(get_args(hint)) and all(
            type_ok(h, v) for h, v in zip(get_args(hint), value))
    return isinstance(value, dict)  # a section or a dict field


# ---- batch sizes: the load-time and the world-size-1 rule ---------------------------------------

def batch_outcome(cfg: dict) -> Tuple[str, str]:
    """(expect, prefix) for the batch keys of a config that is otherwise valid."""
    b, m, g = (cfg.get(k) for k in _BATCH_KEYS)
    b, m, g = (None if v is None else int(v) for v in (b, m, g))
    keys = "train_batch_size, train_micro_batch_size_per_gpu"
    if b is None and m is None:
        return "refuse", f"{keys}: missing"
    if b is not None and m is not None and g is not None:
        if b % (m * g):
            return "refuse", f"{keys}, gradient_accumulation_steps: contradiction"
        return ("accept", "") if b == m * g else ("world", "")
    if b is not None and m is not None and b % m:
        return "refuse", f"{keys}: not divisible"
    if b is not None and g is not None and b % g:
        return "refuse", "train_batch_size, gradient_accumulation_steps: not divisible"
    return "accept", ""


def with_batch(base: dict, b: Any, m: Any, g: Any) -> dict:
    cfg = {k: v for k, v in base.items() if k not in _BATCH_KEYS}
    cfg.update({k: v for k, v in zip(_BATCH_KEYS, (b, m, g)) if v is not None})
    return cfg


# ---- walking a config -----------------------------------------------------------------------

def key_paths(cfg: Any, path: Tuple = ()) -> Iterator[Tuple]:
    """Every dict key's path, depth first."""
    if isinstance(cfg, dict):
        for key, value in cfg.items():
            yield path + (key,)
            yield from key_paths(value, path + (key,))


def leaf_paths(cfg: Any, path: Tuple = ()) -> Iterator[Tuple]:
    """Every value that is not a dict: scalars, and lists with their items."""
    if isinstance(cfg, dict):
        for key, value in cfg.items():
            yield from leaf_paths(value, path + (key,))
    else:
        yield path
        if isinstance(cfg, list):
            for i in range(len(cfg)):
                yield path + (i,)


def dotted(path: Tuple) -> str:
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else key)
    return out


def replaced(cfg: dict, path: Tuple, value: Any) -> dict:
    out = copy.deepcopy(cfg)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def renamed(cfg: dict, path: Tuple, new: str) -> dict:
    out = copy.deepcopy(cfg)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[new] = node.pop(path[-1])
    return out


def merged(cfg: dict, path: Tuple, update: dict) -> dict:
    """cfg with the section at `path` updated (created if absent)."""
    out = copy.deepcopy(cfg)
    node = out
    for key in path:
        node = node.setdefault(key, {})
    node.update(update)
    return out


def rng() -> random.Random:
    return random.Random(SEED)


# ---- whole-file garbage ---------------------------------------------------------------------

FILE = "{file}"  # stands for the file's path in a prefix; the runner fills it in


def deep_dict(levels: int) -> dict:
    """{"a": {"a": ...}} `levels` deep, built without recursion."""
    out: dict = {}
    node = out
    for _ in range(levels - 1):
        node["a"] = {}
        node = node["a"]
    return out


def garbage() -> Iterator[Mutation]:
    """Inputs no mutation of a key reaches: non-object tops, huge ints, deep nesting, bytes that
    are not UTF-8, duplicate keys, broken JSON."""
    ok = {"train_batch_size": 8}
    # Passed directly, a str is a path and None is "no config" (initialize says so).
    for top in ([], [1, 2], 3, 3.5, None, True, False, "fp16"):
        yield Mutation(f"top {top!r}", top, "refuse", "<config>: expected an object",
                       in_dict=top is not None and not isinstance(top, str))
    digits = "9" * 5000
    yield Mutation("top 5000-digit int", None, "refuse", "<config>: out of range",
                   text=digits.encode(), in_dict=False)
    yield Mutation("top 10**5000", 10**5000, "refuse", "<config>: out of range", in_file=False)
    yield Mutation("negative 5000 digits", None, "refuse", "train_batch_size: out of range",
                   text=f'{{"train_batch_size": -{digits}}}'.encode(), in_dict=False)
    yield Mutation("20-digit int", {**ok, "seed": 10**19}, "refuse", "seed: out of range")
    yield Mutation("1e400 is inf", None, "refuse", "gradient_clipping: expected a finite number",
                   text=b'{"train_batch_size": 8, "gradient_clipping": 1e400}', in_dict=False)
    yield Mutation("-Infinity", None, "refuse", "gradient_clipping: expected a finite number",
                   text=b'{"train_batch_size": 8, "gradient_clipping": -Infinity}', in_dict=False)
    nested = json.loads("[" * 40 + "]" * 40)
    yield Mutation("40 levels", {**ok, "fp16": nested}, "refuse",
                   "fp16" + "[0]" * 31 + ": nested too deeply")
    deep = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    yield Mutation("100000 levels (file)", None, "refuse", f"{FILE}: nested too deeply at line 1",
                   text=deep, in_dict=False)
    yield Mutation("100000 levels unclosed", None, "refuse", f"{FILE}: nested too deeply",
                   text=b"{" + b'"a":{' * 100_000, in_dict=False)
    yield Mutation("100000 levels (dict)", {**ok, "a": deep_dict(100_000)}, "refuse",
                   "a" + ".a" * 31 + ": nested too deeply", in_file=False)
    cyclic: dict = {**ok}
    cyclic["fp16"] = cyclic
    yield Mutation("a dict that holds itself", cyclic, "refuse",
                   "fp16" + ".fp16" * 31 + ": nested too deeply", in_file=False)
    yield from _bad_bytes(ok)


def _bad_bytes(ok: dict) -> Iterator[Mutation]:
    unreadable, invalid = f"{FILE}: cannot read config file", f"{FILE}: invalid JSON"
    files = [
        ("latin-1 byte", b'{"train_batch_size": 8, "caf\xe9": 1}', unreadable),
        ("0xff in a string", b'{"train_batch_size": 8, "x": "\xff"}', unreadable),
        ("UTF-16", json.dumps(ok).encode("utf-16"), unreadable),
        ("UTF-8 BOM", b"\xef\xbb\xbf" + json.dumps(ok).encode(), invalid),
        ("empty", b"", invalid), ("blank", b" \n\t ", invalid),
        ("truncated", json.dumps(ZERO3_OFFLOAD).encode()[:200], invalid),
        ("trailing comma", b'{"train_batch_size": 8,}', invalid),
        ("comment", b'{"train_batch_size": 8 // per step\n}', invalid),
        ("single quotes", b"{'train_batch_size': 8}", invalid),
        ("two objects", b'{"train_batch_size": 8} {}', invalid),
        ("NUL byte", b'{"train_batch_size": 8}\x00', invalid),
        ("duplicate key", b'{"train_batch_size": 8, "train_batch_size": 16}',
         f"{FILE}: duplicate key 'train_batch_size'"),
        ("nested duplicate", b'{"train_batch_size": 8, "fp16": {"enabled": true, "enabled": false}}',
         f"{FILE}: duplicate key 'enabled'"),
    ]
    for name, text, prefix in files:
        yield Mutation(name, None, "refuse", prefix, text=text, in_dict=False)
    yield Mutation("lone surrogate key", {**ok, "\ud800": 1}, "refuse",
                   "['\\ud800']: unknown key", text=b'{"train_batch_size": 8, "\\ud800": 1}')
    yield Mutation("non-ASCII key", {**ok, "über": 1}, "refuse", "über: unknown key",
                   text='{"train_batch_size": 8, "über": 1}'.encode())
    long_key = "k" * 10_000
    yield Mutation("10000-character key", {**ok, long_key: 1}, "refuse", f"{long_key}: unknown key")
