"""Step time of gradient compression against the dense reduction, where the link is the bottleneck.

    python jobs/bench_compression.py --rate 100mbit          # 2 gloo ranks over a shaped veth pair
    python jobs/bench_compression.py --rate 20mbit --stage 0 --out /tmp/bc.json
    python jobs/bench_compression.py --link loopback         # the fast link: no namespaces, no shaping
    python jobs/bench_compression.py --device cuda           # 2 GPUs over NCCL (NVLink on 2x H200)

One invocation trains the same GPT (same seed, same random tokens) once per setting and prints
a table: median seconds per step, the speed-up against the dense run, the gradient bytes each
rank sends per step (the engine's compression_stats), and, on the shaped link, the bytes each
rank actually put on the wire (the veth's tx counter: TCP/IP headers, ACKs and ZeRO's
uncompressed parameter all-gather included). Settings:

  dense     fp32 reduction (no gradient_compression)
  bf16      gradient_compression bf16: the reduction in bf16
  topk      gradient_compression topk, topk_ratio 0.01, error feedback
  powersgd  gradient_compression powersgd, rank 4 (reported "not available" while the config
            refuses it)
  onebit    gradient_compression onebit (1-bit Adam: one bit per element and a scale per
            slice; one dense warm-up step, taken among the untimed ones), form auto: the
            momentum form at ZeRO 0-2, the gradient form at 3
  onebit-grad  the same with form gradient (each rank's gradient, at every stage)

--link netns (the default on CPU): two network namespaces joined by a veth pair, each end
shaped with a `tc` token bucket (tbf) at --rate (and a netem delay with --delay, where the
kernel has netem), one gloo rank per namespace started with `ip netns exec`. Needs root and
iproute2. The namespaces (hrbc<pid>...) are deleted on exit, Ctrl-C and SIGTERM; after a
SIGKILL remove them with `ip netns del NAME`.

The link's bandwidth is measured once per run: an all_reduce doubled in size until one takes
a quarter of a second, then timed three times (bus bandwidth, 2(n-1)/n * bytes / s).

At the end the driver's policy (`gradient_compression: {"type": "auto"}`) is fed the medians as
if measured live, twice: speed only, every measured setting a candidate (`policy` in the JSON),
and as shipped, its own candidates through the recorded quality gate (`policy_with_quality`).

Internal: the driver re-runs this file with --worker SPEC.json once per rank.
"""
from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, NoReturn, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

WORLD = 2
DENSE_SETTING = {"type": "none"}
SETTING_NAMES = ("dense", "bf16", "topk", "powersgd", "onebit")  # the default; onebit-grad when asked
# Optional per-step timing keys of compression_stats() (added by later engine work).
TIMING_KEYS = ("step_s", "comm_wait_s", "compress_s")
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def fail(msg: str) -> NoReturn:
    sys.exit(f"bench_compression: {msg}")


def parse_rate(text: str) -> float:
    """'100mbit' -> 1e8 bits/s (tc's bit units; tc's 'bps' means bytes/s, so it is refused)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?bit)\s*", text.lower())
    if not m:
        fail(f"--rate {text!r}: expected a number with kbit, mbit or gbit (e.g. 100mbit)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def setting_configs(args) -> Dict[str, Optional[dict]]:
    """name -> gradient_compression section (None: dense), in --settings order."""
    all_ = {"dense": None, "bf16": {"type": "bf16"},
            "topk": {"type": "topk", "topk_ratio": args.topk_ratio, "error_feedback": True},
            "powersgd": {"type": "powersgd", "rank": args.powersgd_rank},
            "onebit": {"type": "onebit", "warmup_steps": 1},
            "onebit-grad": {"type": "onebit", "warmup_steps": 1, "form": "gradient"}}
    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [n for n in names if n not in all_]
    if unknown or not names:
        fail(f"--settings {args.settings!r}: choose from {','.join(all_)}")
    return {n: all_[n] for n in names}


# ---- the slow link ------------------------------------------------------------------------

def _run(cmd: List[str]) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {(res.stderr or res.stdout).strip()}")


class NetnsLink:
    """Two namespaces joined by a veth pair, each end shaped at `rate` bits/s."""

    def __init__(self, rate_bits: float, rate_text: str, delay: Optional[str]):
        tag = f"hrbc{os.getpid()}{secrets.token_hex(2)}"[:13]  # interface names: 15 chars at most
        self.ns = [f"{tag}-{r}" for r in range(WORLD)]
        self.ifs = [f"{tag}{'ab'[r]}" for r in range(WORLD)]
        self.addrs = [f"10.213.0.{r + 1}" for r in range(WORLD)]  # private to the two namespaces
        self.rate_bits, self.rate_text, self.delay = rate_bits, rate_text, delay
        self._made: List[str] = []
        self._closed = False

    def open(self) -> None:
        for ns in self.ns:
            _run(["ip", "netns", "add", ns])
            self._made.append(ns)
        _run(["ip", "link", "add", self.ifs[0], "type", "veth", "peer", "name", self.ifs[1]])
        burst = max(32 * 1024, int(self.rate_bits / 8 * 0.004))  # >= 4 ms of traffic
        for ns, dev, addr in zip(self.ns, self.ifs, self.addrs):
            _run(["ip", "link", "set", dev, "netns", ns])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            tbf = ["tbf", "rate", self.rate_text, "burst", str(burst), "latency", "50ms"]
            if self.delay:
                try:
                    _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:",
                          "netem", "delay", self.delay])
                except RuntimeError as exc:
                    raise RuntimeError(f"--delay needs the netem qdisc, which this kernel refuses "
                                       f"({exc}); run without --delay") from None
                _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:"]
                     + tbf)
            else:
                _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root"] + tbf)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # An end still here (setup failed before moving it) goes now; deleting one end deletes
        # the pair. Ends inside a namespace go with it (the kernel finishes that asynchronously).
        for dev in self.ifs:
            subprocess.run(["ip", "link", "del", dev], capture_output=True)
        for ns in self._made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def env(self, rank: int) -> dict:
        return {"MASTER_ADDR": self.addrs[0], "MASTER_PORT": "29512",
                "GLOO_SOCKET_IFNAME": self.ifs[rank], "BENCH_TX_IFACE": self.ifs[rank]}

    def wrap(self, rank: int, cmd: List[str]) -> List[str]:
        return ["ip", "netns", "exec", self.ns[rank]] + cmd

    def describe(self) -> dict:
        return {"mode": "netns", "rate": self.rate_text, "rate_bits_per_s": self.rate_bits,
                "delay": self.delay, "shaping": "tc tbf on each veth end" +
                (" under netem delay" if self.delay else ""), "namespaces": self.ns}


class LocalLink:
    """Loopback (gloo over lo) or NCCL between two local GPUs: nothing to set up."""

    def __init__(self, device: str):
        self.device = device
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def env(self, rank: int) -> dict:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port)}
        if self.device == "cpu":
            env["GLOO_SOCKET_IFNAME"] = "lo"
        return env

    def wrap(self, rank: int, cmd: List[str]) -> List[str]:
        return cmd

    def describe(self) -> dict:
        return {"mode": "loopback" if self.device == "cpu" else "nccl (local GPUs)",
                "rate": None, "rate_bits_per_s": None, "delay": None}


# ---- the driver -----------------------------------------------------------------------------

def check_prerequisites(args) -> None:
    if args.link != "netns" and (args.rate or args.delay):
        fail("--rate/--delay shape the netns link only: drop them or use --link netns")
    if args.device == "cuda":
        if args.link == "netns":
            fail("--device cuda runs over NCCL between local GPUs: use --link loopback (the default "
                 "with cuda)")
        import torch
        if torch.cuda.device_count() < WORLD:
            fail(f"--device cuda needs {WORLD} GPUs, found {torch.cuda.device_count()}")
        return
    if args.link == "netns":
        missing = [c for c in ("ip", "tc") if shutil.which(c) is None]
        if os.geteuid() != 0 or missing:
            why = f"missing {' and '.join(missing)}" if missing else "not root"
            fail(f"--link netns needs root and iproute2's ip and tc ({why}); try --link loopback")


def launch(args, link, spec_path: str, workdir: str) -> None:
    """Start one worker per rank (in its own session) and wait; kill the rest if one fails."""
    procs, logs = [], []
    base = [sys.executable, os.path.abspath(__file__), "--worker", spec_path]
    try:
        for rank in range(WORLD):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(WORLD), **link.env(rank))
            if args.device == "cpu":
                env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
            log_path = os.path.join(workdir, f"rank{rank}.log")
            log = open(log_path, "w")
            logs.append((log_path, log))
            # Rank 0's progress lines go to our stderr; stdout keeps only the table.
            out = sys.stderr if rank == 0 and not args.quiet else log
            procs.append(subprocess.Popen(link.wrap(rank, base), env=env, stdout=out,
                                          stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True))
        deadline = time.monotonic() + args.timeout
        while True:
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes):
                return
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad or time.monotonic() > deadline:
                tails = []
                for path, log in logs:
                    log.flush()
                    with open(path) as f:
                        text = f.read().strip()
                    if text:
                        tails.append(f"--- {os.path.basename(path)} ---\n" + "\n".join(text.splitlines()[-20:]))
                print("\n".join(tails), file=sys.stderr)
                what = f"rank {bad[0][0]} exited with {bad[0][1]}" if bad else f"timed out after {args.timeout} s"
                fail(what + (" (see its output above)" if bad else ""))
            time.sleep(0.2)
    finally:
        for p in procs:  # only the workers this call started, each by its own process group
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        for _, log in logs:
            log.close()


def _median(xs: List[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def summarize(args, link_info: dict, ranks: List[dict]) -> dict:
    """Merge the ranks' records: a step takes as long as its slowest rank."""
    r0 = ranks[0]
    out = {"command": "python jobs/bench_compression.py " + " ".join(args.argv),
           "link": dict(link_info, measured=r0["bandwidth"]), "machine": r0["machine"],
           "model": r0["model"], "zero_stage": args.stage, "dtype": r0["dtype"],
           "warmup_steps": args.warmup, "timed_steps": args.steps, "rounds": args.rounds,
           "settings": {}}
    for name in r0["settings"]:
        recs = [r["settings"][name] for r in ranks]
        if not recs[0]["available"]:
            out["settings"][name] = {"available": False, "reason": recs[0]["reason"],
                                     "compression": recs[0]["compression"]}
            continue
        per_step = [max(ts) for ts in zip(*(r["step_s"] for r in recs))]
        s = {"available": True, "compression": recs[0]["compression"],
             "step_s_median": _median(per_step), "step_s": per_step,
             "bytes_sent_per_step": max(r["bytes_sent"] for r in recs),
             "dense_bytes_per_step": max(r["dense_bytes"] for r in recs),
             "round_medians": [max(ms) for ms in zip(*(r["round_medians"] for r in recs))],
             "wire_tx_bytes_per_step": None, "final_loss": recs[0]["losses"][-1],
             "losses_rank0": recs[0]["losses"]}
        s["compression_ratio"] = s["dense_bytes_per_step"] / s["bytes_sent_per_step"] \
            if s["bytes_sent_per_step"] else None
        if all(r["tx_bytes"] is not None for r in recs):
            s["wire_tx_bytes_per_step"] = max(r["tx_bytes"] for r in recs) / len(per_step)
        for key in TIMING_KEYS:  # reported by the engine: the slowest rank's median
            vals = [_median(r["timings"][key]) for r in recs if r["timings"].get(key)]
            s[f"engine_{key}_median"] = max(vals) if len(vals) == len(recs) else None
        out["settings"][name] = s
    dense = out["settings"].get("dense")
    for s in out["settings"].values():
        if s["available"]:
            s["speedup_vs_dense"] = (dense["step_s_median"] / s["step_s_median"]
                                     if dense and dense["available"] else None)
    return out


def _speed_key(setting: Optional[dict], stage: int) -> str:
    """What decides a setting's step time: the exchange it runs (1-bit Adam's warm-up and
    update_bound change no byte on the wire), so a measured setting can time a candidate."""
    gc = dict(setting or DENSE_SETTING)
    kind = gc.get("type", "none")
    if kind == "topk":
        return json.dumps([kind, gc.get("topk_ratio", 0.01), gc.get("topk_values", "fp32"),
                           gc.get("topk_indices", "int32")])
    if kind == "powersgd":
        return json.dumps([kind, gc.get("rank", 1)])
    if kind == "onebit":
        form = gc.get("form", "auto")
        return json.dumps([kind, ("gradient" if stage >= 3 else "momentum") if form == "auto" else form])
    return json.dumps([kind])


def policy_replay(res: dict, quality: bool = False) -> List[str]:
    """What the Ray driver's policy (gradient_compression type auto) decides when fed these
    measurements: the dense run's median step and exposed communication first, then each
    setting it asks to try, as if measured live. Checks the policy against the measured best.
    quality False: speed only, every measured setting a candidate (the quality gate off).
    quality True: what `type: auto` does here: its own candidates (compression_policy.candidates
    at this run's topk_ratio and rank) through the recorded quality gate at its default
    max_quality_loss, each timed by the measured setting that runs the same exchange (a
    candidate measured by none is left out)."""
    from hybrid_ray.cluster.compression_policy import CompressionPolicy, Interval, candidates

    stage = res.get("zero_stage", 2)
    measured = {_speed_key(s["compression"], stage): s for s in res["settings"].values() if s["available"]}
    dense = res["settings"].get("dense")
    if not dense or not dense["available"] or dense.get("engine_comm_wait_s_median") is None:
        return []
    if quality:
        auto = {"type": "auto"}
        for s in res["settings"].values():
            gc = s["compression"] or {}
            auto.update({k: gc[k] for k in ("topk_ratio", "rank") if k in gc})
        options = [o for o in candidates(auto) if _speed_key(o, stage) in measured]
        policy = CompressionPolicy(options)
    else:
        options = [s["compression"] for n, s in res["settings"].items() if s["available"] and n != "dense"]
        policy = CompressionPolicy(options, max_quality_loss=None)
    bw = res["link"]["measured"]["bus_bytes_per_s"]
    reasons = [d.reason for d in [policy.on_group(WORLD, bw)] if d]
    current, sample = 0, dense
    for _ in range(4 * (len(options) + 2)):  # skip-first + measured intervals per setting, at most
        if policy.settled is not None:
            break
        iv = Interval(current, 1, sample["step_s_median"], sample.get("engine_comm_wait_s_median") or 0.0)
        decision = policy.observe(iv)
        if decision is not None:
            reasons.append(decision.reason)
            current = decision.setting_id
            sample = measured[_speed_key(decision.setting, stage)]
    return reasons


def _mb(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 1e6:.3f} MB"


def format_table(res: dict) -> str:
    link, bw = res["link"], res["link"]["measured"]
    m = res["model"]
    lines = [f"link: {link['mode']}" + (f", shaped at {link['rate']}" if link.get("rate") else "")
             + (f", delay {link['delay']}" if link.get("delay") else "")
             + f"; measured all_reduce bus bandwidth {bw['bus_bits_per_s'] / 1e6:,.1f} Mbit/s"
             f" ({bw['bytes'] / 1e6:.2f} MB in {bw['seconds']:.4f} s)",
             f"model: GPT {m['n_layer']} layers, d {m['d_model']}, vocab {m['vocab_size']}, seq "
             f"{m['seq_len']}, micro-batch {m['micro_batch']}, {m['params'] / 1e6:.2f}M params; "
             f"ZeRO-{res['zero_stage']}, {res['dtype']}; {res['rounds']} round(s) of "
             f"{res['warmup_steps']} warm-up + {res['timed_steps']} timed steps per setting; "
             f"{res['machine']['summary']}; load average {res['load_before']:.2f} before, "
             f"{res['load_after']:.2f} after",
             "",
             "| setting | s/step (median) | round medians | speed-up vs dense | grad bytes sent/step/rank | compression "
             "| wire bytes/step/rank | exposed comm wait s | compress s | final loss |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in res["settings"].items():
        if not s["available"]:
            lines.append(f"| {name} | not available | - | - | - | - | - | - | - | - |")
            continue
        ratio, up = s["compression_ratio"], s["speedup_vs_dense"]
        wait, comp = s.get("engine_comm_wait_s_median"), s.get("engine_compress_s_median")
        cells = [name, f"{s['step_s_median']:.3f}", "/".join(f"{x:.3f}" for x in s["round_medians"]),
                 "-" if up is None else f"{up:.2f}x",
                 _mb(s["bytes_sent_per_step"]), "-" if ratio is None else f"{ratio:.1f}x",
                 _mb(s["wire_tx_bytes_per_step"]), "-" if wait is None else f"{wait:.3f}",
                 "-" if comp is None else f"{comp:.3f}",
                 f"{s['final_loss']:.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    for name, s in res["settings"].items():
        if not s["available"]:
            lines.append(f"{name}: not available: {s['reason']}")
    return "\n".join(lines)


def drive(args) -> None:
    check_prerequisites(args)
    configs = setting_configs(args)
    if args.link == "netns":
        link = NetnsLink(parse_rate(args.rate or "100mbit"), args.rate or "100mbit", args.delay)
    else:
        link = LocalLink(args.device)
    workdir = tempfile.mkdtemp(prefix="bench_compression_")

    def cleanup() -> None:
        link.close()
        shutil.rmtree(workdir, ignore_errors=True)

    atexit.register(cleanup)
    # SIGTERM and SIGINT (even where a shell started us with it ignored) unwind through finally.
    old_term = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        try:
            link.open()
        except RuntimeError as exc:
            fail(f"setting up the link failed: {exc}")
        spec = {"device": args.device, "threads": args.threads, "stage": args.stage,
                "dtype": args.dtype or ("bf16" if args.device == "cuda" else "fp32"),
                "model": {"n_layer": args.layers, "n_head": args.heads, "d_model": args.dim,
                          "vocab_size": args.vocab, "seq_len": args.seq},
                "micro_batch": args.micro_batch, "seed": args.seed, "warmup": args.warmup,
                "steps": args.steps, "rounds": args.rounds, "settings": configs, "bucket": args.reduce_bucket_size,
                "bw_cap_bytes": args.bw_max_mb * 1_000_000, "outdir": workdir}
        spec_path = os.path.join(workdir, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        t0, load0 = time.monotonic(), os.getloadavg()[0]
        launch(args, link, spec_path, workdir)
        ranks = []
        for r in range(WORLD):
            with open(os.path.join(workdir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
        res = summarize(args, link.describe(), ranks)
        res.update(wall_s=time.monotonic() - t0, load_before=load0, load_after=os.getloadavg()[0])
    finally:
        cleanup()
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
    res["policy"] = policy_replay(res)
    res["policy_with_quality"] = policy_replay(res, quality=True)
    print(format_table(res))
    for line in res["policy"]:
        print("driver policy on these measurements (speed only):", line)
    for line in res["policy_with_quality"]:
        print("driver policy with the recorded quality gate (type auto as shipped):", line)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
        print(f"wrote {args.out}")


# ---- the workers ----------------------------------------------------------------------------

def _tx_bytes() -> Optional[int]:
    """This namespace's veth tx counter (ip netns exec mounts the namespace's own /sys)."""
    iface = os.environ.get("BENCH_TX_IFACE")
    if not iface:
        return None
    with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
        return int(f.read())


def measure_bandwidth(device, cap_bytes: int) -> dict:
    """all_reduce bus bandwidth: double the size until one takes >= 0.25 s (or the cap)."""
    import torch
    import torch.distributed as dist

    def timed(buf) -> float:
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dist.all_reduce(buf)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = torch.tensor([time.perf_counter() - t], dtype=torch.float64, device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # every rank picks the same size next
        return float(dt)

    nbytes = 1 << 16
    while True:
        buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        dt = timed(buf)
        if dt >= 0.25 or nbytes * 2 > cap_bytes:
            break
        nbytes *= 2
    dt = statistics.median(timed(buf) for _ in range(3))
    world = dist.get_world_size()
    bus = 2 * (world - 1) / world * nbytes / dt
    return {"bytes": nbytes, "seconds": dt, "bus_bytes_per_s": bus, "bus_bits_per_s": 8 * bus,
            "method": "median of 3 fp32 all_reduce, bus bandwidth 2(n-1)/n*bytes/s"}


def run_setting(spec: dict, gc: Optional[dict], topo) -> dict:
    import torch
    import torch.distributed as dist
    from hybrid_ray.config import ConfigError, load_config
    from hybrid_ray.engine import Engine
    from hybrid_ray.models import GPT, GPTConfig

    cfg = {"train_micro_batch_size_per_gpu": spec["micro_batch"], "gradient_accumulation_steps": 1,
           "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
           "zero_optimization": {"stage": spec["stage"]}}
    if spec["bucket"]:
        cfg["zero_optimization"]["reduce_bucket_size"] = spec["bucket"]
    if spec["dtype"] != "fp32":
        cfg[spec["dtype"]] = {"enabled": True}
    if gc is not None:
        cfg["gradient_compression"] = gc
    rec = {"compression": gc, "available": True}
    try:
        load_config(cfg)  # the same on every rank, before any collective
    except ConfigError as exc:
        return dict(rec, available=False, reason=str(exc))
    mc = GPTConfig(**spec["model"])
    torch.manual_seed(spec["seed"])
    engine = Engine(GPT(mc), cfg, topology=topo)
    dev, rank, world = topo.device, topo.rank, topo.world_size
    steps_s, losses, stats = [], [], []
    tx0 = None
    for step in range(spec["warmup"] + spec["steps"]):
        if step == spec["warmup"]:
            dist.barrier()
            tx0 = _tx_bytes()
        g = torch.Generator().manual_seed(spec["seed"] * 1_000_003 + step * world + rank)
        tokens = torch.randint(0, mc.vocab_size, (spec["micro_batch"], mc.seq_len + 1), generator=g)
        x, y = tokens[:, :-1].to(dev), tokens[:, 1:].to(dev)
        t = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        if step >= spec["warmup"]:
            steps_s.append(dt)
            losses.append(float(loss.detach()))
            stats.append(dict(engine.compression_stats()))
    tx1 = _tx_bytes()
    dist.barrier()
    engine.close()
    timings = {k: [s[k] for s in stats if s.get(k) is not None] for k in TIMING_KEYS}
    return dict(rec, step_s=steps_s, losses=losses,
                bytes_sent=statistics.median(s["bytes_sent"] for s in stats),
                dense_bytes=statistics.median(s["dense_bytes"] for s in stats),
                tx_bytes=None if tx0 is None or tx1 is None else tx1 - tx0, timings=timings,
                last_stats=stats[-1])


def worker(spec_path: str) -> None:
    import platform

    import torch
    import torch.distributed as dist
    from hybrid_ray.engine import Topology
    from hybrid_ray.models import GPT, GPTConfig

    with open(spec_path) as f:
        spec = json.load(f)
    rank = int(os.environ["RANK"])
    if spec["device"] == "cuda":
        device = torch.device("cuda", rank)
        summary = f"{WORLD}x {torch.cuda.get_device_name(rank)}, NCCL, torch {torch.__version__}"
    else:
        torch.set_num_threads(spec["threads"])
        device = torch.device("cpu")
        summary = (f"{os.cpu_count()} CPU cores, gloo, {spec['threads']} thread(s) per rank, "
                   f"torch {torch.__version__}")
    topo = Topology.from_environment(device=device, timeout_s=1800)
    say = (lambda m: print(f"[bench_compression] {m}", flush=True)) if rank == 0 else (lambda m: None)
    bw = measure_bandwidth(device, spec["bw_cap_bytes"])
    say(f"all_reduce bus bandwidth {bw['bus_bits_per_s'] / 1e6:,.1f} Mbit/s")
    params = GPT(GPTConfig(**spec["model"])).num_params()
    res = {"machine": {"summary": summary, "cpus": os.cpu_count(), "torch": torch.__version__,
                       "platform": platform.platform()},
           "model": dict(spec["model"], micro_batch=spec["micro_batch"], params=params),
           "dtype": spec["dtype"], "bandwidth": bw, "settings": {}}
    # Rounds interleave the settings, so a neighbour's load on the shared cores hits them alike.
    for rnd in range(spec["rounds"]):
        for name, section in spec["settings"].items():
            rec = run_setting(spec, section, topo)
            prev = res["settings"].setdefault(name, rec)
            if not rec["available"]:
                if rnd == 0:
                    say(f"{name}: not available ({rec['reason']})")
                continue
            med = statistics.median(rec["step_s"])
            if prev is rec:
                rec["round_medians"] = [med]
            else:
                prev["step_s"] += rec["step_s"]
                prev["round_medians"].append(med)
                prev["losses"] = rec["losses"]  # the same run again (same seed, same data)
                if prev["tx_bytes"] is not None and rec["tx_bytes"] is not None:
                    prev["tx_bytes"] += rec["tx_bytes"]
                for k in TIMING_KEYS:
                    prev["timings"][k] += rec["timings"][k]
            say(f"round {rnd + 1}/{spec['rounds']} {name}: median {med:.3f} s/step, "
                f"{rec['bytes_sent'] / 1e6:.3f} MB sent/step")
    with open(os.path.join(spec["outdir"], f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    # The closed engines sit in reference cycles that still hold the process group; left to
    # interpreter shutdown, gloo's teardown sometimes aborts the process ("terminate called
    # without an active exception") after the results are written. As in lm/launch.py.
    gc.collect()
    dist.destroy_process_group()


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(argv[1])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--link", choices=["netns", "loopback"], default=None,
                   help="netns: shaped veth pair (CPU default); loopback: no shaping (cuda default)")
    p.add_argument("--rate", help="tc rate of each veth end, e.g. 1gbit, 100mbit, 20mbit (default 100mbit)")
    p.add_argument("--delay", help="one-way delay per end, e.g. 5ms (needs the netem qdisc)")
    p.add_argument("--settings", default=",".join(SETTING_NAMES))
    p.add_argument("--topk-ratio", type=float, default=0.01)
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--dtype", choices=["fp32", "bf16"], help="default: fp32 on CPU, bf16 on cuda")
    p.add_argument("--layers", type=int)
    p.add_argument("--dim", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--micro-batch", type=int)
    p.add_argument("--reduce-bucket-size", type=int, default=None, help="default: the engine's")
    p.add_argument("--warmup", type=int, help="untimed steps per setting and round (default 2 CPU, 5 cuda)")
    p.add_argument("--steps", type=int, help="timed steps per setting and round (default 5 CPU, 20 cuda)")
    p.add_argument("--rounds", type=int, default=2, help="passes over all settings, interleaved")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU)")
    p.add_argument("--bw-max-mb", type=int, default=None,
                   help="largest all_reduce of the bandwidth probe (default 64 CPU, 1024 cuda)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds for the whole run")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    args.argv = argv
    cuda = args.device == "cuda"
    args.link = args.link or ("loopback" if cuda else "netns")
    # CPU: ~1.7M parameters, ~0.15 s of compute per step on one core. GPU: GPT-2 124M.
    defaults = dict(layers=12, dim=768, heads=12, vocab=50304, seq=1024, micro_batch=8, warmup=5,
                    steps=20) if cuda else \
        dict(layers=2, dim=256, heads=4, vocab=256, seq=128, micro_batch=8, warmup=2, steps=5)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.bw_max_mb is None:
        args.bw_max_mb = 1024 if cuda else 64
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        fail("--warmup, --steps and --rounds must be at least 1")
    try:
        drive(args)
    except KeyboardInterrupt:
        print("bench_compression: interrupted; workers stopped, namespaces removed", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
