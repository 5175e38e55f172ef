"""Hardware profiles: what a rank can compute and move, as plain data.

Two kinds, one class:
* spec-sheet profiles (`numesh/plan/profiles/*.json`, shipped with the package): peak
  FLOP/s of the training dtype, an achieved-GEMM efficiency, memory and its bandwidth, and
  intra-/inter-node link latency and bandwidth; each file names its sources. They let a
  user plan for a cluster they don't have.
* measured profiles (`numesh plan --calibrate`): for each rank count the calibration ran
  with (all ranks busy at once, so a shared machine's contention is in the numbers), the
  seconds of the model's GEMM shapes, of numesh's element-wise kernels and of collectives
  by payload, interpolated between the measured sizes.
"""

from __future__ import annotations

import json
import math
import os
from importlib import resources
from pathlib import Path
from typing import Any

import attrs

from numesh.base.errors import ConfigError
from numesh.base.files import os_reason, read_user_file, write_atomic
from numesh.plan import costs

Points = tuple[tuple[float, float], ...]  # (size, seconds), sorted by size

# Memory passes (element reads + writes) of numesh's element-wise kernels, per element of
# the array each works on, counted from numesh/nn/layers.py: what a spec-sheet profile
# divides by memory bandwidth (a measured profile times the kernels themselves).
PASSES = {
    "layernorm_fwd": 9, "layernorm_bwd": 14,  # mean, centre, variance, scale, affine; grads of w and x
    "gelu_fwd": 12, "gelu_bwd": 14,  # tanh form in place, counted when the forward also kept tanh(u)
    # numesh/host/llama_kernels.py: x read twice, y and xhat written; dy and xhat read twice,
    # dx written, w's grad summed. Per hidden value: gate and up read, y written; and back
    # gate, up and dy read (the sigmoid computed again), both grads written
    "rmsnorm_fwd": 4, "rmsnorm_bwd": 6, "swiglu_fwd": 3, "swiglu_bwd": 5,
    # attention's passes over each score (numesh/kernels.py stripe_*): max, shift, exp, sum;
    # backward the logits, exp and the gradient (reads p and dp, writes dp)
    "softmax_fwd": 6, "softmax_bwd": 7,
    "copy": 3,  # a residual add or a transposing copy: two reads, a write
    "adamw": 12,  # read p, g, m, v and the masks; write p, m, v (and the scratch)
}


# what a profile calibrated before the Llama parts' kernels had times kernels by: the
# GPT-2 kernels the time model priced them as then
BEFORE_KERNELS = {"rmsnorm_fwd": "layernorm_fwd", "rmsnorm_bwd": "layernorm_bwd", "swiglu_fwd": "gelu_fwd",
                  "swiglu_bwd": "gelu_bwd"}


@attrs.frozen
class Link:
    """One device's share of a link: latency per message (s) and bandwidth (bytes/s, one direction)."""

    latency_s: float
    bandwidth: float


@attrs.frozen
class Measured:
    """What calibration measured with `ranks` ranks busy at once (`threads` BLAS threads each)."""

    ranks: int
    threads: int
    gemm: dict[str, float]  # "b,m,k,n" -> seconds of one (batched) matmul of that shape
    gemm_curve: Points  # (FLOPs, seconds) of square-ish GEMMs, for shapes not in `gemm`
    elementwise: dict[str, Points]  # kernel -> (elements, seconds)
    collectives: dict[str, Points]  # "all_reduce:n" (n ranks per group, all groups at once), "send" -> (bytes, seconds)
    # fitted on real training steps (`numesh.plan.calibrate.fit_steps`): measured kernel
    # times x `in_situ` + `call_overhead_s` per block action (F, B or W) = a step's time
    in_situ: float = 1.0
    call_overhead_s: float = 0.0
    # fitted on a real step of a mesh (`numesh.plan.calibrate.fit_sync`): a blocking
    # collective also waits for its group's last member to arrive (ranks drift apart between
    # calls; with more ranks than cores, until each member is scheduled). The wait grows with
    # the work done since the last call, so a step waits min(sync_s x calls, sync_share x
    # compute): the first term rules where calls are few (dp), the second where they are many.
    sync_s: float = 0.0
    sync_share: float = 0.0
    # added to every blocking call by `comm_time`: only `timing.predict_time` sets it, to count calls
    call_probe_s: float = attrs.field(default=0.0, eq=False, repr=False)


@attrs.frozen
class Profile:
    name: str
    source: str
    dtype: str = "float32"
    itemsize: int = 4
    memory_bytes: float = 0.0  # per device (0: unknown, nothing is marked as not fitting)
    devices_per_node: int = 1
    peak_flops: float = 0.0  # dense matmul FLOP/s of `dtype` per device
    gemm_efficiency: float = 1.0  # achieved / peak for large GEMMs
    mem_bandwidth: float = 0.0  # bytes/s per device
    intra: Link = Link(1e-6, 1e10)
    inter: Link = Link(1e-5, 1e10)
    # gradient reduction progresses during backward (NCCL streams: yes; MPICH without a progress thread: no)
    overlap: bool = True
    cores: int = 0  # CPU cores of a node (measured profiles)
    measured: dict[int, Measured] = attrs.field(factory=dict)

    # ------------------------------------------------------------------ lookups

    def for_ranks(self, ranks_on_node: int) -> tuple[Measured | None, float]:
        """The measurement to use for `ranks_on_node` ranks sharing a node, and a factor for
        its compute times: measured with the same count, 1; else the nearest count, scaled by
        how much more each rank's share of the cores shrinks (time-sharing when oversubscribed)."""
        if not self.measured:
            return None, 1.0
        if ranks_on_node in self.measured:
            return self.measured[ranks_on_node], 1.0
        near = min(self.measured, key=lambda n: (abs(n - ranks_on_node), n))
        cores = self.cores or 1
        share = lambda n: max(1.0, n / cores)  # noqa: E731  (how many ranks share a core)
        return self.measured[near], share(ranks_on_node) / share(near)

    def gemm_time(self, b: int, m: int, k: int, n: int, ranks_on_node: int) -> float:
        """Seconds of b matmuls [m, k] @ [k, n] on one rank."""
        flops = 2.0 * b * m * k * n
        meas, scale = self.for_ranks(ranks_on_node)
        if meas is None:
            return flops / (self.peak_flops * self.gemm_efficiency)
        hit = meas.gemm.get(f"{b},{m},{k},{n}")
        if hit is not None:
            return hit * scale * meas.in_situ
        return costs.interp_time(meas.gemm_curve, flops) * scale * meas.in_situ

    def elementwise_time(self, kernel: str, elements: float, ranks_on_node: int) -> float:
        """Seconds of numesh's element-wise `kernel` over `elements` values on one rank."""
        if elements <= 0:
            return 0.0
        meas, scale = self.for_ranks(ranks_on_node)
        if meas is None:
            return PASSES[kernel] * elements * self.itemsize / self.mem_bandwidth
        points = meas.elementwise.get(kernel) or meas.elementwise[BEFORE_KERNELS.get(kernel, kernel)]
        return costs.interp_time(points, elements) * scale * meas.in_situ

    def call_overhead(self, ranks_on_node: int) -> float:
        """Seconds a block action (F, B or W) costs beyond its kernels: the Python between
        them, as fitted on real steps (0 on spec-sheet profiles)."""
        meas, scale = self.for_ranks(ranks_on_node)
        return 0.0 if meas is None else meas.call_overhead_s * scale

    def comm_time(self, op: str, payload: float, n: int, intra: bool, ranks_on_node: int) -> float:
        """Seconds of one collective (or a send, n=2) of `payload` bytes over a group of n ranks;
        `exchange` is a send both partners wait in (a ring hop), blocking like a collective."""
        blocking = op != "send"
        op = "send" if op == "exchange" else op
        if payload <= 0 or (n <= 1 and op != "send"):
            return 0.0
        if self.measured:
            meas = self.comm_measurement(ranks_on_node)
            return self._measured_comm(meas, op, payload, n) + (meas.call_probe_s if blocking else 0.0)
        link = self.intra if intra else self.inter
        return costs.collective_time(op, payload, n, link.latency_s, link.bandwidth)

    def times_communication(self) -> bool:
        """Whether this profile can time a collective: a spec-sheet profile from its links, a
        measured one when some calibration ran on several ranks (one rank times none)."""
        return not self.measured or any(m.collectives for m in self.measured.values())

    def comm_measurement(self, ranks_on_node: int) -> Measured:
        """The measurement that times communication for `ranks_on_node` ranks: `for_ranks`'
        if it timed any, else the nearest that did (a calibration on one rank times none).
        None did: a ConfigError saying how to calibrate with more ranks."""
        meas, _ = self.for_ranks(ranks_on_node)
        if meas is not None and meas.collectives:
            return meas
        timed = [n for n, m in self.measured.items() if m.collectives]
        if not timed:
            n = min(max(ranks_on_node, 2), max(self.cores, 8))
            raise ConfigError(
                f"hardware profile {self.name} was calibrated on one rank, which times no communication: to plan for "
                f"{ranks_on_node} ranks, calibrate with several too (`mpirun -n {n} numesh plan --calibrate ...`, "
                f"each run adds its rank count) or plan on a spec-sheet profile "
                f"(--hardware {' or '.join(builtin_profiles())})")
        return self.measured[min(timed, key=lambda k: (abs(k - ranks_on_node), k))]

    def extrapolation(self, ranks: int) -> str | None:
        """What a plan for `ranks` ranks takes from other rank counts' measurements, as a
        note for the user; None on a spec-sheet profile or one calibrated with `ranks`."""
        if not self.measured or ranks in self.measured:
            return None
        meas, _ = self.for_ranks(ranks)
        said = [f"compute is scaled from the {meas.ranks}-rank measurement"]
        if ranks > 1:
            comm = self.comm_measurement(ranks)
            groups = sorted(int(k.split(":")[1]) for k in comm.collectives if k.startswith("all_reduce:"))
            said.append(f"communication is extrapolated from the {comm.ranks}-rank one (all-reduce timed on "
                        f"groups of {', '.join(map(str, groups)) or 'none'})")
        *others, last = sorted(self.measured)
        counts = f"{', '.join(map(str, others))} and {last}" if others else str(last)
        return (f"note: profile {self.name} was calibrated with {counts} ranks, not {ranks}: {'; '.join(said)}; "
                f"`mpirun -n {ranks} numesh plan --calibrate ...` measures them")

    def _measured_comm(self, meas: Measured, op: str, payload: float, n: int) -> float:
        if op == "send":
            return costs.interp_time(meas.collectives["send"], payload)
        key = f"all_reduce:{n}"
        if key in meas.collectives:
            t = costs.interp_time(meas.collectives[key], payload)
        else:  # a group size not measured: α and β fitted on the nearest measured group
            sizes = sorted(int(k.split(":")[1]) for k in meas.collectives if k.startswith("all_reduce:"))
            g = min(sizes, key=lambda s: abs(s - n))
            alpha, beta = costs.fit_alpha_beta(meas.collectives[f"all_reduce:{g}"], 2 * (g - 1), 2 * (g - 1) / g)
            t = costs.ring_time("all_reduce", payload, n, alpha, beta)
        # a ring all-gather or reduce-scatter is half an all-reduce's steps and bytes, and so a
        # (balanced) all-to-all: n-1 steps of 1/n of the buffer
        return t if op == "all_reduce" else t / 2

    # ------------------------------------------------------------------ files

    def to_json(self) -> dict[str, Any]:
        d = attrs.asdict(self, recurse=True)
        d["measured"] = {str(k): {f: x for f, x in v.items() if f != "call_probe_s"} for k, v in d["measured"].items()}
        return d


def _points(rows: Any) -> Points:
    return tuple(sorted((float(a), float(b)) for a, b in rows))


def profile_from_json(d: dict[str, Any], where: str) -> Profile:
    """A Profile from its JSON form; a missing or unknown key is a ConfigError naming `where`."""
    fields = {f.name for f in attrs.fields(Profile)} | {"comment"}
    unknown = set(d) - fields
    if unknown:
        raise ConfigError(f"hardware profile {where} has unknown keys {', '.join(sorted(unknown))}: "
                          f"the keys are {', '.join(sorted(fields))}")
    try:
        d = dict(d)
        d.pop("comment", None)
        for link in ("intra", "inter"):
            if link in d:
                d[link] = Link(**d[link])
        d["measured"] = {
            int(n): Measured(
                ranks=int(m["ranks"]), threads=int(m["threads"]), gemm={k: float(v) for k, v in m["gemm"].items()},
                gemm_curve=_points(m["gemm_curve"]),
                elementwise={k: _points(v) for k, v in m["elementwise"].items()},
                collectives={k: _points(v) for k, v in m["collectives"].items()},
                in_situ=float(m.get("in_situ", 1.0)), call_overhead_s=float(m.get("call_overhead_s", 0.0)),
                sync_s=float(m.get("sync_s", 0.0)), sync_share=float(m.get("sync_share", 0.0)),
            )
            for n, m in d.get("measured", {}).items()
        }
        prof = Profile(**d)
    except (TypeError, KeyError, ValueError) as e:
        raise ConfigError(f"hardware profile {where} is malformed ({e}): "
                          "write it as `numesh plan --calibrate` does") from None
    _check_numbers(prof, where)
    if not prof.measured and not (prof.peak_flops > 0 and prof.mem_bandwidth > 0):
        raise ConfigError(f"hardware profile {where} has neither measurements nor peak_flops and mem_bandwidth")
    return prof


# what each number of a profile must be (hand-written spec-sheet profiles are documented)
_WHOLE, _POSITIVE, _NONNEGATIVE = ">= 1", "> 0", ">= 0"
_NUMBERS = {"itemsize": _WHOLE, "devices_per_node": _WHOLE, "gemm_efficiency": _POSITIVE, "memory_bytes": _NONNEGATIVE,
            "peak_flops": _NONNEGATIVE, "mem_bandwidth": _NONNEGATIVE, "cores": _NONNEGATIVE}
_LINK_NUMBERS = {"latency_s": _NONNEGATIVE, "bandwidth": _POSITIVE}


def _check_numbers(prof: Profile, where: str) -> None:
    """A ConfigError for a number of the profile that is not one (peak_flops "abc" was a
    TypeError deep in the plan), is NaN or infinite, or breaks its bound (`_NUMBERS`)."""
    checks = [(name, getattr(prof, name), bound) for name, bound in _NUMBERS.items()]
    checks += [(f"{link}.{name}", getattr(getattr(prof, link), name), bound)
               for link in ("intra", "inter") for name, bound in _LINK_NUMBERS.items()]
    for name, v, bound in checks:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not ok or not {_WHOLE: v >= 1, _POSITIVE: v > 0, _NONNEGATIVE: v >= 0}[bound]:
            raise ConfigError(f"hardware profile {where}: {name} must be a finite number {bound}, got {v!r}")


def builtin_profiles() -> list[str]:
    """Names of the spec-sheet profiles shipped with numesh."""
    files = resources.files("numesh.plan") / "profiles"
    return sorted(p.name[:-5] for p in files.iterdir() if p.name.endswith(".json"))


def local_profile_path() -> Path:
    """Where `numesh plan --calibrate` saves this machine's profile (NUMESH_PROFILE_DIR or ~/.cache/numesh)."""
    base = Path(os.environ.get("NUMESH_PROFILE_DIR") or Path.home() / ".cache" / "numesh")
    return base / "local.json"


def load_profile(name: str) -> Profile:
    """A profile by file path, by builtin name, or "local" (this machine's calibration)."""
    path = Path(name)
    if name == "local":
        path = local_profile_path()
        if not path.is_file():
            raise ConfigError(f"no calibrated profile of this machine at {path}: run `numesh plan --calibrate` "
                              f"(under mpirun -n N for N ranks), "
                              f"or pass --hardware one of {', '.join(builtin_profiles())}")
    elif not (name.endswith(".json") or path.is_file()):
        names = builtin_profiles()
        if name not in names:
            raise ConfigError(f"unknown hardware profile '{name}': use one of {', '.join(names)}, local "
                              "(after `numesh plan --calibrate`) or a profile's .json path")
        text = (resources.files("numesh.plan") / "profiles" / f"{name}.json").read_text()
        return profile_from_json(json.loads(text), name)
    d = read_user_file(path, "hardware profile", "JSON", ConfigError,
                       hint=f"give a profile's .json path or a builtin name ({', '.join(builtin_profiles())})")
    if not isinstance(d, dict):
        raise ConfigError(f"hardware profile {path} is not a JSON object: write it as `numesh plan --calibrate` does")
    return profile_from_json(d, str(path))


def check_profile_out(path: Path) -> None:
    """Before a calibration (a minute or more): a ConfigError if `path` cannot take the
    profile, or holds one that cannot be read to merge with, rather than after it."""
    if path.is_dir():
        raise ConfigError(f"--profile-out {path} is a directory: name a .json file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot write the profile to {path}: {os_reason(e)}: choose another --profile-out") from None
    if path.is_file():
        load_profile(str(path))  # this calibration's rank count is merged into it


def save_profile(profile: Profile, path: Path) -> Path:
    """Write `profile` as JSON (atomically: a temp file, then rename)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(profile.to_json(), indent=1))
    except OSError as e:
        raise ConfigError(f"cannot write the profile to {path}: {os_reason(e)}: choose another --profile-out") from None
    return path
