"""HardwareProfile: what the simulator needs to know about a machine, as a frozen, JSON-serialisable
dataclass. Floor 1: plain data and arithmetic.

Transfer time of a copy is its size over the effective bandwidth at that size, interpolated in
log-size between measured points (small copies are far slower: 5.3 GB/s at 64 KiB against 55 at
64 MiB on the H200). Expert FFN time is a launch cost per matrix, plus the expert's bytes over the
kernel's effective bandwidth for its weight format, plus the matmul work of the extra tokens. Every
figure names its source in `sources`; `cmoe calibrate` measures a profile on the machine at hand.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

from cmoe.core.errors import CmoeError
from cmoe.core.hw_checks import NON_NEGATIVE, WAIT_TABLES, bad, check_pairs, rule, whole
from cmoe.core.hw_math import _width, beside_copy, pairs, split_plan, split_runs, table_us  # noqa: F401  (re-exported)
from cmoe.core.hw_variants import HOST_FIELDS, HOST_POINTS, Variants  # noqa: F401  (re-exported)

GB = 1e9

_PAIRS = ("h2d_pinned", "d2h_pinned", "expert_gbps", "expert_rows_us", *HOST_POINTS, "wave_count_us",
          "host_wake_points", "host_route_waits", "cpu_wake_points", "roundtrip_points",
          "cpu_expert_points", "host_pass_start_points", "host_boundary_points")      # the fields that are lists of pairs (JSON <-> tuples)


@dataclass(frozen=True)
class HardwareProfile(Variants):
    name: str
    gpu_mem_bytes: int
    h2d_pinned: tuple[tuple[int, float], ...]       # (copy bytes, GB/s), ascending sizes
    d2h_pinned: tuple[tuple[int, float], ...]
    h2d_pageable_gbps: float
    copy_engines: int                               # concurrent H2D copies the link serves
    hbm_gbps: float                                 # device memory bandwidth (read + write)
    matmul_tflops: float                            # dense bf16
    expert_gbps: tuple[tuple[str, float], ...]      # weight bits class -> effective GB/s of expert kernels
    launch_us: float                                # one kernel launch
    layer_fixed_us: float                           # per decoder layer at batch 1: norms, attention, router, routing read-back
    attn_us_per_token: float                        # extra attention/router time per extra token in a pass
    cpu_expert_gbps: float                          # CPU expert throughput, as expert bytes read per second
    roundtrip_us: float                             # GPU->CPU->GPU hidden-state round trip with its synchronisations
    copy_compute_slowdown: float = 0.0              # expert kernels' slowdown while a side-stream copy runs
    copy_attention_slowdown: float | None = None    # the rest of a layer's (attention, norms, router) while one
                                                    # runs; None: copy_compute_slowdown's (`attention_slow`)
    copy_launch_us: float | None = None             # a fused launch's fixed extra beside a copy (`wave_beside_copy`)
    attn_us_per_ctx_token: float = 0.0              # per decoder layer, per key attended (a pass's context)
    readback_gpu_us: float = 0.0                    # per MoE layer, GPU: packing its routing for the read-back
    predict_gpu_us: float = 0.0                     # per MoE layer, GPU: the next layer's router on this layer's
                                                    # hidden state (the policies that predict; in a graph: no host cost)
    attn_us_per_cache_key: float = 0.0              # per decoder layer, per key of the pass's longest row: a kernel
                                                    # running the rows side by side up to the step's slot (the lean
                                                    # decode); a prefill (SDPA over the prompt) pays it per key summed
    attn_us_per_split_run: float = 0.0              # per decoder layer in decode, per run past the first the lean
                                                    # attention cuts each head's keys into, sized by the cache
                                                    # (`attn_split_us`: mostly empty at short contexts, still merged)
    attn_split_max: int = 0                         # ... at most this many runs (0: the kernel does not split)
    attn_split_block: int = 64                      # ... each a multiple of this many keys
    h2d_queued_us: float = 0.0                      # a pinned copy starting on its engine as the one before lands: its
                                                    # bytes at the curve's last rate plus this (`h2d_queued`); 0: curve
    pass_start_us: float = 0.0                      # per pass, before the first layer: embedding, masks, sync
    head_us: float = 0.0                            # per pass, after the last layer: final norm, LM head
    # The host thread that issues the work (all 0: a host that never holds the GPU back). The
    # times above are the GPU's own; these are the Python thread's, which the GPU cannot outrun.
    host_layer_us: float = 0.0                      # per decoder layer: issuing norms, attention, router
    host_attn_us_per_token: float = 0.0
    host_sync_us: float = 0.0                       # per MoE layer: the read-back once the GPU has caught up
    host_route_us: float = 0.0                      # per MoE layer, after the read-back: routes, plan, issuing loads
    host_route_us_per_token: float = 0.0
    host_expert_us: float = 0.0                     # issuing one expert's kernels
    host_expert_us_per_token: float = 0.0
    host_expert_tail_us: float = 0.0                # ... of which after the kernel's end mark (bookkeeping)
    cpu_expert_us_per_token: float = 0.0            # CPU expert: each extra token (0: the old max(1, tokens/8) scaling)
    cpu_lead_us: float = 0.0                        # per layer with CPU experts, host: from its last launch to its first
    cpu_gap_us: float = 0.0                         # ... between two CPU experts
    cpu_tail_us: float = 0.0                        # ... from the results' return to the layer's end (their sum added)
    cpu_pass_start_us: float = 0.0                  # per pass, a CPU-expert policy's host_pass_start_us (0: that one)
    cpu_pass_gap_us: float = 0.0                    # ... of it, the part before a queued pass's first mark
    host_load_us: float = 0.0                       # issuing one load: planning it, events, the copy call
    host_pass_start_us: float = 0.0                 # per pass, host side of pass_start_us
    host_head_us: float = 0.0
    pass_gap_us: float = 0.0                        # per synced pass (`pass_overlap` off), of host_pass_start_us: the part
                                                    # before its first mark (GPU idle); the rest is layer 0's start-up
    predict_layer_us: float = 0.0                   # per MoE layer, policies that predict, on the host: the early router
    commit_route_us: float = 0.0                    # per MoE layer, commit in decode: its larger read-back and OWA
    copy_fifo: bool = False                         # loads run in issue order on one stream, not most-urgent first
    copy_on_host: bool = False                      # the host thread copies (the executor on a CPU): a load costs host time
    dense_rows: int = 0                             # up to this many rows a pass, every expert runs on all (dense path)
    silent_upper: bool = False                      # upper has no host step between a layer's attention and its experts
                                                    # (the lean executor's one launch): no read-back, plan or issue
    commit_ahead: bool = False                      # commit in decode launches a layer's committed experts before its
                                                    # read-back, plans the next layer while they run (the lean executor)
    pass_overlap: bool = False                      # decode passes queued back to back (the lean executor's graphs
                                                    # on CUDA): the host waits only for the pass before, syncs nothing
                                                    # (copies included) before the next; the first (capture) syncs
    # The lean executor's fused expert launch (calibrate fits it from upper's own layers): with
    # wave_gbps > 0 a layer's GPU experts run in waves (`cmoe.policy.waves`), each one launch that
    # starts once all of its copies have landed and takes wave_us + its experts' bytes at wave_gbps
    # + wave_row_us per row, issued by the host once (host_expert of the wave's rows); 0: each
    # expert is a kernel of its own (expert_us), as in the reference engine.
    wave_gbps: float = 0.0
    wave_us: float = 0.0
    wave_row_us: float = 0.0
    wave_count_us: tuple = ()                       # (experts, us): a launch's fixed cost by its expert count (calibrate:
                                                    # upper's launches less their experts' shares); replaces wave_us
    owa_gpu_us: float = 0.0                         # commit's decode launch also weights its rows by OWA on the
                                                    # device (`owa_device`): once per launch (calibrate: its own runs)
    commit_gpu_us: float = 0.0                      # per MoE layer, commit's ahead path, GPU: between its attention
                                                    # and its launch, the read-back's start and the launch's inputs
                                                    # (candidates, slot table) copied on the compute stream
    commit_start_us: float = 0.0                    # per decode pass of commit, host: beyond host_sync_us, turning
                                                    # layer 0's prediction into its plan and loads at the pass's start
    commit_gpu_copy_us: float = 0.0                 # ... and this much more when a load is moving as it starts: those
                                                    # small copies wait behind the load's on the one H2D engine
    readback_copy_us: float = 0.0                   # per MoE layer of a read-back policy: what its route step takes
                                                    # more when a load is moving as it starts (an H100: 5-15 us)
    launch_copy_us: float = 0.0                     # ... and each launch of its experts starts this much later when
                                                    # a load moves as it is issued: its slot table's copy waits too
    start_copy_us: float = 0.0                      # a queued pass's GPU start-up, when a load is moving as it starts:
                                                    # its inputs (the cache's slot) wait behind it on the H2D engine
    # Measured shapes (calibrate, from enough points): where given, they replace the lines above.
    # (rows, us) pairs, rows ascending; read piecewise-linearly, held flat below the first point and
    # past the last one when the last piece falls, extended along the last piece when it rises.
    expert_rows_us: tuple = ()                      # one expert of expert_rows_bytes, class expert_rows_class
    expert_rows_bytes: int = 0
    expert_rows_class: str = ""
    host_layer_points: tuple = ()                   # host_layer(tokens)
    host_route_points: tuple = ()                   # host_route(tokens)
    host_expert_points: tuple = ()                  # host_expert(rows)
    host_wake_points: tuple = ()                    # (read-back wait us, factor): the route step after a wait that
                                                    # long takes factor x its cost (`host_wake`; `cmoe.calibrate.wake`)
    host_route_waits: tuple = ()                    # (tokens, us): the read-back wait of the runs host_route was
                                                    # measured in, whose factor its points hold already
    cpu_wake_points: tuple = ()                     # (idle us, extra us): a CPU expert after the CPU idled that long
    host_pass_start_points: tuple = ()              # (pass us, extra us): a pass start after a pass that long
    host_boundary_points: tuple = ()                # (wait us, extra us): a pass start after a pass whose last
                                                    # read-back waited that long (`boundary_extra_us`)
    roundtrip_points: tuple = ()                    # (rows, us): roundtrip_us by the pass's rows (`roundtrip`)
    cpu_expert_points: tuple = ()                   # (tokens, factor): a CPU expert's time over its time at one token
    omp_wait_policy: str = ""                       # OpenMP settings of calibrate's CPU experts ("": unrecorded)
    cpu_pages: str = ""                             # the pages they sat on ("2 MiB pages"; "": unrecorded)
    few_experts: str = ""                           # CMOE_FEW_EXPERTS' thresholds at calibration ("off", "8:3";
                                                    # "": unrecorded, read as off: `cmoe.executor.few_experts`)
    cpu_ref_us: float = 0.0                         # the host CPU's plain loop at calibration (`cmoe.core.cpu_ref`;
                                                    # 0: unrecorded), which the runs' own readings are held to
    python_host: dict = field(default_factory=dict, hash=False)   # host fields of the Python step (`python_step`)
    sources: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        """Every field checked where a profile is made (built in, fitted or read from JSON): the
        simulator divides by rates and adds up times, so a zero rate, a negative time, NaN or a
        string would give a crash or a wrong answer far from its cause."""
        if not isinstance(self.name, str) or not self.name:
            raise bad("?", "name", self.name, "a non-empty string")
        for f in fields(self):
            ok = rule(f.name, f.type)
            if ok and not ok[0](getattr(self, f.name)):
                raise bad(self.name, f.name, getattr(self, f.name), ok[1])
        for curve in ("h2d_pinned", "d2h_pinned"):
            check_pairs(self.name, curve, getattr(self, curve), whole(1)[0], "[bytes, GB/s]: a whole number "
                        "of bytes > 0, GB/s positive, sizes ascending", ascending=True)
        check_pairs(self.name, "expert_gbps", self.expert_gbps, lambda k: k in ("int4", "int8", "bf16"),
                    "[class, GB/s]: class int4, int8 or bf16 (each once), GB/s positive", ascending=False)
        for table in ("expert_rows_us", *HOST_POINTS, "wave_count_us", "host_route_waits", "roundtrip_points"):
            if getattr(self, table) != ():                         # none measured; anything else is checked
                check_pairs(self.name, table, getattr(self, table), whole(1)[0], "[rows, us]: a whole number "
                            "of rows >= 1, us >= 0, rows ascending", ascending=True, rate=NON_NEGATIVE[0])
        for table, what, y_ok in WAIT_TABLES:
            if getattr(self, table) != ():
                check_pairs(self.name, table, getattr(self, table), NON_NEGATIVE[0], what, ascending=True, rate=y_ok)
        if self.cpu_expert_points != ():
            check_pairs(self.name, "cpu_expert_points", self.cpu_expert_points, whole(1)[0],
                        "[tokens, factor]: a whole number of tokens >= 1, a factor > 0, tokens ascending", ascending=True)
        if self.expert_rows_us and not (self.expert_rows_bytes > 0 and self.expert_rows_class in ("int4", "int8", "bf16")):
            raise bad(self.name, "expert_rows_bytes", self.expert_rows_bytes,
                      "above 0, with expert_rows_class int4, int8 or bf16, when expert_rows_us is given")
        if self.wave_gbps and not self.copy_fifo:
            raise bad(self.name, "wave_gbps", self.wave_gbps, "0 unless copy_fifo is true (the fused launches "
                      "are the executor's, whose loads run on one copy stream in issue order)")
        for k in ("copy_attention_slowdown", "copy_launch_us"):
            a = getattr(self, k)
            if a is not None and not NON_NEGATIVE[0](a):
                raise bad(self.name, k, a, f"null or {NON_NEGATIVE[1]}")
        if not isinstance(self.python_host, dict) or set(self.python_host) - {*HOST_FIELDS, *HOST_POINTS}:
            raise bad(self.name, "python_host", self.python_host, f"an object of {HOST_FIELDS + HOST_POINTS}")
        object.__setattr__(self, "python_host", {k: pairs(v) if k in HOST_POINTS else v     # JSON's lists
                                                 for k, v in self.python_host.items()})
        self.python_step()                                        # its fields checked as the profile's own
        if not isinstance(self.sources, dict):
            raise bad(self.name, "sources", self.sources, "an object of field -> where its figure comes from")

    # transfers ------------------------------------------------------------------------------
    @staticmethod
    def curve_gbps(pts: tuple[tuple[int, float], ...], nbytes: int) -> float:
        """A (bytes, GB/s) curve's rate at `nbytes`: linear in log2(bytes), flat past its ends."""
        if nbytes <= pts[0][0]:
            return pts[0][1]
        if nbytes >= pts[-1][0]:
            return pts[-1][1]
        x = math.log2(nbytes)
        for (b0, g0), (b1, g1) in zip(pts, pts[1:]):
            if nbytes <= b1:
                t = (x - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
                return g0 + t * (g1 - g0)
        raise AssertionError("unreachable")

    def h2d_us(self, nbytes: int, pinned: bool = True) -> float:
        gbps = self.curve_gbps(self.h2d_pinned, nbytes) if pinned else self.h2d_pageable_gbps
        return nbytes / (gbps * GB) * 1e6

    def h2d_queued(self, nbytes: int) -> float:
        """A pinned copy queued behind another on its engine (the executor's loads, back to back):
        the curve's points time copies alone, each paying the DMA's start-up (on the H200 a 3.3 MB
        OLMoE expert took 65-67 us queued, 70-75 after an idle engine, 76.5 on the curve); <= h2d_us."""
        if not self.h2d_queued_us:
            return self.h2d_us(nbytes)
        return min(nbytes / (self.h2d_pinned[-1][1] * GB) * 1e6 + self.h2d_queued_us, self.h2d_us(nbytes))

    def d2h_us(self, nbytes: int) -> float:
        return nbytes / (self.curve_gbps(self.d2h_pinned, nbytes) * GB) * 1e6

    # compute --------------------------------------------------------------------------------
    def expert_kernel_gbps(self, bits: float) -> float:
        table = dict(self.expert_gbps)
        key = "int4" if bits <= 4 else "int8" if bits <= 8 else "bf16"
        return table[key]

    def expert_us(self, nbytes: int, bits: float, tokens: int, params: int) -> float:
        """One expert (three matrices) over `tokens` tokens; params = weights in the expert. From the
        measured table where there is one for this width (scaled by bytes), else the line."""
        if self.expert_rows_us and _width(bits) == self.expert_rows_class:
            return table_us(self.expert_rows_us, tokens) * nbytes / self.expert_rows_bytes
        extra_flops = 2 * params * max(tokens - 1, 0)
        return (3 * self.launch_us + nbytes / (self.expert_kernel_gbps(bits) * GB) * 1e6
                + extra_flops / (self.matmul_tflops * 1e12) * 1e6)

    def wave_fixed_us(self, experts: int) -> float:
        """A fused launch's own cost beside its experts' shares: by its expert count where measured."""
        return table_us(self.wave_count_us, experts) if self.wave_count_us else self.wave_us

    def wave_expert_us(self, nbytes: int, rows: int) -> float:
        """One expert's share of a fused launch (the launch adds wave_us once)."""
        return nbytes / (self.wave_gbps * GB) * 1e6 + self.wave_row_us * rows

    def layer_us(self, tokens: int, resident_bytes: int = 0) -> float:
        """Non-expert work of one decoder layer: fixed cost, weights read, per-token growth."""
        return self.layer_fixed_us + resident_bytes / (self.hbm_gbps * GB) * 1e6 \
            + self.attn_us_per_token * max(tokens - 1, 0)

    def attn_split_us(self, cache_len: int) -> float:
        """What a decode layer's attention costs beyond one run a head, over a cache of `cache_len`
        slots (`split_runs`)."""
        return self.attn_us_per_split_run * (split_runs(cache_len, self.attn_split_max, self.attn_split_block) - 1)

    @property
    def attention_slow(self) -> float:
        """The factor on a layer's non-expert GPU time that starts while a copy is in flight. Apart
        from the experts' since the twenty-third session: on an H100 the model's own attention step
        ran 10-14% slower beside a load and its experts 6-11%, in every loading run of three calls."""
        a = self.copy_attention_slowdown
        return 1.0 + (self.copy_compute_slowdown if a is None else a)

    def wave_beside_copy(self, dur: float, extra: float) -> float:
        """A fused expert launch of `dur` us (of which `extra`, commit's OWA, is not its experts')
        that starts while a copy is in flight. Where calibrate measured it (`copy_launch_us`), a
        fixed part per launch plus `copy_compute_slowdown` on the experts' own part: on the H200
        (thirty-ninth session) a launch beside a load took 5.7-7.6 us more at two experts and
        9.8-11.8 at eight, the same for commit's launches, 48-50 us longer, as for the read-back
        policies'. Else (profiles from before) the factor on the whole launch."""
        launch = -1.0 if self.copy_launch_us is None else self.copy_launch_us
        return beside_copy(dur, extra, 1.0 + self.copy_compute_slowdown, launch)

    def cpu_expert_us(self, nbytes: int, tokens: int) -> float:
        """A CPU expert of `nbytes` on `tokens` rows: its one-token time by `cpu_expert_gbps`, times
        the measured factor by tokens where `cpu_expert_points` holds one (a table: the torch CPU
        kernel steps, e.g. 2.45 to 4.04 ms from 4 to 5 tokens on an H100's host, twenty-ninth
        session, which a line through all the token counts misses), else the line."""
        one = nbytes / (self.cpu_expert_gbps * GB) * 1e6
        if self.cpu_expert_points:
            return one * table_us(self.cpu_expert_points, tokens)
        if self.cpu_expert_us_per_token:
            return one + self.cpu_expert_us_per_token * max(tokens - 1, 0)
        return one * max(1.0, tokens / 8)

    # files ----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        for k in _PAIRS:
            d[k] = [list(p) for p in d[k]]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareProfile":
        if not isinstance(d, dict):
            raise CmoeError("a hardware profile is a JSON object of fields: write one with cmoe calibrate")
        d = dict(d)
        d.pop("fallback_overlap", None)      # profiles before the host model: now follows from the host's times
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise CmoeError(f"hardware profile has unknown fields {sorted(unknown)}")
        if missing := [f.name for f in fields(cls)
                       if f.name not in d and f.default is MISSING and f.default_factory is MISSING]:
            raise CmoeError(f"hardware profile is missing the fields {missing}: write one with cmoe calibrate")
        for k in _PAIRS:                                          # JSON lists -> tuples, checked later
            if k in d:                                            # null: none measured (a curve: refused below)
                d[k] = pairs(d[k])
        for f in fields(cls):                                       # 1.41e11 bytes in JSON: a whole number
            if f.type == "int" and isinstance(d.get(f.name), float) and d[f.name].is_integer():
                d[f.name] = int(d[f.name])
        return cls(**d)


KiB, MiB = 1024, 1024 * 1024

_H200_CURVE = ((64 * KiB, 5.3), (1 * MiB, 34.6), (4 * MiB, 49.9), (16 * MiB, 53.8), (64 * MiB, 55.2))
H200 = HardwareProfile(
    name="h200", gpu_mem_bytes=141 * 10**9, h2d_pinned=_H200_CURVE,
    d2h_pinned=tuple((b, g * 55.0 / 55.2) for b, g in _H200_CURVE), h2d_pageable_gbps=13.0,
    copy_engines=1, hbm_gbps=4300.0, matmul_tflops=788.0,
    expert_gbps=(("int4", 1730.0), ("int8", 2600.0), ("bf16", 3390.0)),
    launch_us=5.0, layer_fixed_us=255.0, attn_us_per_token=1.0,
    cpu_expert_gbps=30.0, roundtrip_us=60.0, copy_compute_slowdown=0.02,
    sources={
        "h2d_pinned": "DESIGN.md: measured on the lent H200 (PCIe Gen5 x16, torch 2.11, 2026-11)",
        "d2h_pinned": "DESIGN.md: about 55 GB/s pinned; same size curve as H2D assumed",
        "h2d_pageable_gbps": "DESIGN.md: pageable H2D 8-19 GB/s; midpoint",
        "copy_engines": "one H2D stream saturates the PCIe link; more engines share the same 55 GB/s",
        "hbm_gbps": ".library/device/KINDS.md: device-to-device copy about 4.3 TB/s (read + write)",
        "matmul_tflops": ".library/device/KINDS.md: 8192^3 bf16 product 769-798 TFLOP/s on random data",
        "expert_gbps": "DESIGN.md: int4pack_mm 14336x4096 one token 18 us (31.2 MB -> 1.73 TB/s); "
                       "bf16 Mixtral expert 104 us (352 MB -> 3.39 TB/s); int8 interpolated (estimate)",
        "launch_us": "estimate; calibrate with `cmoe calibrate`",
        "layer_fixed_us": "DESIGN.md: lean Mixtral decode step 12.0 ms/token eager with routing read-back; "
                          "minus 32 x 2 experts x 54 us, minus attention weight reads, over 32 layers",
        "attn_us_per_token": "estimate",
        "cpu_expert_gbps": "estimate for int4 CPU expert kernels on 16 cores (_weight_int4pack_mm_for_cpu)",
        "roundtrip_us": "estimate: two small copies at 64 KiB-class latency plus two stream synchronisations",
        "copy_compute_slowdown": "DESIGN.md: a side-stream copy slows concurrent matmuls by about 2%",
    })

_PCIE4_CURVE = tuple((b, g * 25.0 / 55.2) for b, g in _H200_CURVE)
RTX4090 = HardwareProfile(
    name="rtx4090", gpu_mem_bytes=24 * 1024**3, h2d_pinned=_PCIE4_CURVE, d2h_pinned=_PCIE4_CURVE,
    h2d_pageable_gbps=10.0, copy_engines=1, hbm_gbps=1008.0, matmul_tflops=165.0,
    expert_gbps=(("int4", 700.0), ("int8", 800.0), ("bf16", 850.0)),
    launch_us=5.0, layer_fixed_us=200.0, attn_us_per_token=2.0,
    cpu_expert_gbps=20.0, roundtrip_us=60.0, copy_compute_slowdown=0.02,
    sources={
        "h2d_pinned": "PCIe 4.0 x16: 32 GB/s raw, about 25 GB/s in practice; H200 size curve scaled",
        "gpu_mem_bytes": "NVIDIA RTX 4090 specifications: 24 GB GDDR6X",
        "hbm_gbps": "NVIDIA RTX 4090 specifications: 1008 GB/s",
        "matmul_tflops": "NVIDIA Ada whitepaper: 165 dense FP16/BF16 tensor TFLOP/s (FP32 accumulate)",
        "expert_gbps": "estimate: about 70% of memory bandwidth for small-batch int4 kernels",
        "layer_fixed_us": "estimate: launch- and sync-bound like the H200's, less attention read time",
        "cpu_expert_gbps": "estimate for a desktop CPU (dual-channel DDR5)",
        "roundtrip_us": "estimate, as for the H200",
    })

PROFILES: dict[str, HardwareProfile] = {"h200": H200, "rtx4090": RTX4090}


def load_profile(name_or_path: str) -> HardwareProfile:
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    p = Path(name_or_path)
    if not p.is_file():
        raise CmoeError(f"unknown hardware profile '{name_or_path}': use {', '.join(PROFILES)} or a profile JSON file")
    try:
        return HardwareProfile.from_dict(json.loads(p.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise CmoeError(f"{p} is not a valid hardware profile ({e})") from None
