"""The host expert store: every routed expert as one padded byte buffer in pinned host memory,
already in the kernel's layout for the target device, so that a load is a single copy.

Two sources:
- `from_checkpoint`: a local safetensors checkpoint, streamed tensor by tensor (per-expert names
  as original checkpoints store them, or transformers 5's fused `gate_up_proj`/`down_proj`);
  an expert is quantized and packed as soon as its three matrices have been read, so host
  memory holds the store plus one tensor at a time.
- `random`: seeded random weights with a preset's exact shapes, generated directly as int4 codes
  (on the GPU when there is one) and packed there, for timing studies at full scale.

A run whose policy computes missed experts on the CPU also needs a CPU twin of each expert
(the CPU kernel reads another int4 layout). `cpu_twins` holds the same codes and scales in that
layout, in pageable memory; on a CPU run the main store already is the CPU layout. Pageable
buffers ask for 2 MiB pages (`cmoe.core.hugepages`): the CPU kernel streams a whole expert a call,
a TLB miss every 4 KiB on small pages. On the lent H100s' hosts (thirty-third session, same bytes,
one process, alternating) that was no worse on average and sometimes much better: `static` at batch
8 ran 11-17% faster in one call and 1.5-2.5% slower in the next; over twelve such pairs of runs the
CPU-expert policies moved -7% to +17%, +2.4% on average (BENCHMARKS.md).
Legend: M MoE layers, E experts per layer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from cmoe.core.checkpoint import PackedExperts
from cmoe.core.errors import CmoeError
from cmoe.core.hugepages import huge_share, huge_zeros, pages_word
from cmoe.executor.kernels import cuda_refusal, expert_bytes_of, write_dense, write_int4
from cmoe.executor.layout import ExpertLayout, expert_layout, slot_size
from cmoe.core.spec import ModelSpec


def packing_for(fmt: str, device: torch.device, fused: bool) -> str:
    """How a store packs its int4 experts: "tiled" for the one-launch layer kernel (`fused`: the
    lean engine, on either device), else the torch int4 kernel's layout of the device ("cuda" or
    "cpu"). Float formats have one layout; they report their device."""
    if fused and fmt.startswith("w4"):
        return "tiled"
    return device.type


class HostStore:
    def __init__(self, spec: ModelSpec, fmt: str, device: torch.device, packing: str | None = None):
        self.spec, self.fmt, self.device = spec, fmt, device
        self.packing = packing or device.type
        self.layout: ExpertLayout = expert_layout(fmt, spec.hidden, spec.expert_ffn)
        if self.layout.zero_point and self.packing == "cuda":
            raise CmoeError(cuda_refusal(fmt))
        self.slot = slot_size(self.layout)
        pin = device.type == "cuda"
        # one [E, slot] buffer per block: each expert is one contiguous padded row
        self.blocks = [self._empty(pin) for _ in range(spec.num_moe_layers)]
        self.cpu_twins: list[torch.Tensor] | None = None
        self.seed: int | None = None          # set for random stores
        self._pages: tuple = (None, None)     # (the buffers' addresses, their share on huge pages)

    def _empty(self, pin: bool) -> torch.Tensor:
        if pin:
            return torch.zeros((self.spec.num_experts, self.slot), dtype=torch.uint8, pin_memory=True)
        return huge_zeros((self.spec.num_experts, self.slot))

    def cpu_huge_share(self) -> float | None:
        """The share of the CPU experts' bytes on huge pages (None: no CPU layout here, or unknown),
        read once per set of buffers (smaps is read whole: ~10 ms a GiB resident, every run asks)."""
        held = self.blocks if self.packing == "cpu" else self.cpu_twins
        if not held:
            return None
        key = tuple(t.data_ptr() for t in held)
        if self._pages[0] != key:
            self._pages = (key, huge_share(held))
        return self._pages[1]

    def cpu_pages(self) -> str | None:
        """The record's word for them: "2 MiB pages", "4 KiB pages" or None (`pages_word`)."""
        return pages_word(self.cpu_huge_share())

    @property
    def slot_bytes(self) -> list[int]:
        return [self.slot] * self.spec.num_moe_layers

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.blocks)

    def expert(self, m: int, e: int) -> torch.Tensor:
        return self.blocks[m][e]

    def cpu_expert(self, m: int, e: int) -> torch.Tensor:
        """Bytes of expert (m, e) in the CPU kernel's layout."""
        if self.packing == "cpu":
            return self.blocks[m][e]
        assert self.cpu_twins is not None, "CPU twins were not built"
        return self.cpu_twins[m][e]

    def put(self, m: int, e: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Quantize and pack one expert's float weights into its host buffer (and CPU twin)."""
        dev = self.device
        buf = torch.zeros(self.slot, dtype=torch.uint8, device=dev)
        expert_bytes_of(self.layout, w13.to(dev, torch.float32), w2.to(dev, torch.float32), self.packing, buf)
        self.blocks[m][e].copy_(buf)
        if self.cpu_twins is not None:
            twin = torch.zeros(self.slot, dtype=torch.uint8)
            expert_bytes_of(self.layout, w13.float().cpu(), w2.float().cpu(), "cpu", twin)
            self.cpu_twins[m][e].copy_(twin)

    def put_codes(self, m: int, e: int, parts: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One expert already quantized: {"w13": (codes [2F, H], sz), "w2": (codes [H, F], sz)}, codes
        0..15 and sz [in/g, out, 2], bf16 (scale, zero) or for a -fp16 layout fp16 (scale, zero
        point), written as they are (no requantization)."""
        for target, packing in ((self.blocks[m][e], self.packing), (self.cpu_twins[m][e] if self.cpu_twins is not None
                                                                     else None, "cpu")):
            if target is None:
                continue
            buf = torch.zeros(self.slot, dtype=torch.uint8, device=self.device if packing != "cpu" else "cpu")
            for name, (codes, sz) in parts.items():
                write_int4(buf, self.layout, name, codes.to(buf.device), sz.to(buf.device), packing)
            target.copy_(buf)

    def build_cpu_twins(self, progress: bool = False) -> None:
        """The CPU-layout copy of every random expert (same codes and scales), built on demand."""
        if self.packing == "cpu" or self.cpu_twins is not None:
            return
        assert self.seed is not None, "checkpoint stores build their twins while loading"
        self.cpu_twins = [self._empty(False) for _ in range(self.spec.num_moe_layers)]
        self._fill_random(self.cpu_twins, "cpu", progress)

    def _fill_random(self, targets: list[torch.Tensor], pack_for: str, progress: bool) -> None:
        from tqdm import tqdm
        dev = self.device
        stage = torch.empty(self.slot, dtype=torch.uint8, device=dev)
        for m in tqdm(range(self.spec.num_moe_layers), disable=not progress, desc=f"experts ({pack_for} layout)"):
            for e in range(self.spec.num_experts):
                stage.zero_()
                random_expert(self.layout, _expert_seed(self.seed, m, e), dev, pack_for, stage)
                targets[m][e].copy_(stage)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)


def _expert_seed(seed: int, m: int, e: int) -> int:
    return (seed * 1_000_003 + m * 4099 + e) % (2**63)


def random_expert(layout: ExpertLayout, seed: int, dev: torch.device, pack_for: str, buf: torch.Tensor) -> None:
    """Random int4 codes and scales (or N(0, 0.02) weights) for one expert, written in
    `pack_for`'s layout into buf; generated on `dev`."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    for name in ("w13", "w2"):
        o, i = layout.part(name).shape
        if layout.group:
            g = layout.group
            codes = torch.randint(0, 16, (o, i), generator=gen, device=dev, dtype=torch.int32)
            scale = torch.rand((i // g, o), generator=gen, device=dev) * 0.004 + 0.002
            if layout.zero_point:                     # fp16 (scale, zero point), as GPTQ stores them
                zp = torch.randint(0, 16, (i // g, o), generator=gen, device=dev).float()
                sz = torch.stack([scale, zp], -1).to(torch.float16)
            else:
                zero = (torch.rand((i // g, o), generator=gen, device=dev) - 0.5) * 0.004
                sz = torch.stack([scale, zero], -1).to(torch.bfloat16)
            write_int4(buf, layout, name, codes, sz, pack_for)
        else:
            write_dense(buf, layout, name, torch.randn((o, i), generator=gen, device=dev) * 0.02)


def random_store(spec: ModelSpec, fmt: str, device: torch.device, seed: int = 0, progress: bool = False,
                 packing: str | None = None) -> HostStore:
    """Seeded random experts of `spec`'s exact shapes. Expert (m, e) depends only on (seed, m, e)
    (and not on the packing: the same codes and scales in every layout)."""
    store = HostStore(spec, fmt, device, packing)
    store.seed = seed
    store._fill_random(store.blocks, store.packing, progress)
    return store


# --- checkpoints ---------------------------------------------------------------------------------
#
# 4-bit experts as stored, unpacked to codes [out, in] in 0..15 and one (scale, zero) pair per group
# and output, exactly: a scale the layout's pair dtype cannot hold is refused, never rounded.
# - compressed-tensors pack-quantized (symmetric): weight_packed int32 [out, in/8], value k of a row
#   at bits 4k as unsigned = signed + 8; weight_scale [out, in/g]; w = (q - 8) * s.
# - GPTQ: qweight int32 [in/8, out] (in-feature 8r + k at bits 4k of row r), qzeros int32
#   [in/g, out/8] (output 8j + k at bits 4k of word j), scales fp16 [in/g, out], g_idx [in];
#   w = (q - z) * s, the original layout storing z - 1 (so a stored 15 is z = 16).
# - AWQ (gemm): qweight int32 [in, out/8] and qzeros [in/g, out/8], nibble k of word j holding
#   output 8j + (0, 2, 4, 6, 1, 3, 5, 7)[k]; scales fp16 [in/g, out]; w = (q - z) * s.

_AWQ_COLUMNS = (0, 4, 1, 5, 2, 6, 3, 7)          # the nibble holding output 8j + c, c = 0..7


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., n] -> their 8 nibbles [..., n, 8], nibble k = bits 4k..4k+3, unsigned."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(w >> (4 * k)) & 15 for k in range(8)], -1)


def unpack_ct_int4(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """compressed-tensors' int32 packing of int4 values along the input dimension (value i of a row
    at bits 4i, as unsigned = signed + 8) -> codes int32 [out, in] in 0..15. cmoe's codes are
    the same unsigned values: w = (q - 8) * scale, the zero term 0 for a symmetric scheme."""
    out, inp = shape
    return _nibbles(packed).reshape(out, -1)[:, :inp].to(torch.int32)


def _exact(scale: torch.Tensor, dtype: torch.dtype, what: str, model_dir: Path) -> torch.Tensor:
    s = scale.to(dtype)
    if not torch.equal(s.to(scale.dtype), scale):
        raise CmoeError(f"{model_dir}: the experts' {scale.dtype} {what} scales do not fit {dtype} exactly, and "
                        f"cmoe's int4 kernels read {dtype} scales for them: running them would change the weights")
    return s


def _check_shapes(t: dict, want: dict[str, tuple[int, ...]], what: str, model_dir: Path) -> None:
    for k, shape in want.items():
        if tuple(t[k].shape) != shape or (k != "scales" and t[k].dtype != torch.int32):
            raise CmoeError(f"{model_dir}: an expert's {what} {k} is {t[k].dtype} {list(t[k].shape)}, not "
                            f"{list(shape)}{'' if k == 'scales' else ' int32'}: cmoe reads 4-bit {what} packed in "
                            f"int32 words, as its quantization_config says")


def _ct_codes(t: dict, layout: ExpertLayout, model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [out, in], sz [in/g, out, 2]) of one compressed-tensors linear, exactly: bf16 (scale, 0),
    or for a -fp16 layout fp16 (scale, zero point 8)."""
    group = layout.group
    out, inp = (int(x) for x in t["weight_shape"].tolist())
    codes = unpack_ct_int4(t["weight_packed"], (out, inp))
    scale = t["weight_scale"]
    if scale.shape != (out, inp // group):
        raise CmoeError(f"{model_dir}: a compressed-tensors scale has shape {tuple(scale.shape)}, not "
                        f"{(out, inp // group)} for groups of {group}: the checkpoint does not match its config")
    if layout.zero_point:
        s16 = _exact(scale, torch.float16, "compressed-tensors", model_dir)
        return codes, torch.stack([s16.T, torch.full_like(s16.T, 8)], -1).contiguous()
    s16 = _exact(scale, torch.bfloat16, "compressed-tensors", model_dir)
    return codes, torch.stack([s16.T, torch.zeros_like(s16.T)], -1).contiguous()


def _gptq_codes(t: dict, group: int, zeros_minus_one: bool, model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [out, in], fp16 (scale, zero point) [in/g, out, 2]) of one GPTQ linear (desc_act off:
    g_idx must be i // g, as the kernels read groups in order)."""
    rows, out = t["qweight"].shape
    inp = rows * 8
    _check_shapes(t, {"qweight": (inp // 8, out), "qzeros": (inp // group, out // 8),
                      "scales": (inp // group, out)}, "GPTQ", model_dir)
    if not torch.equal(t["g_idx"].long(), torch.arange(inp) // group):
        raise CmoeError(f"{model_dir}: the GPTQ experts were quantized with desc_act (their g_idx reorders the "
                        f"groups), which cmoe's kernels cannot read: use a checkpoint quantized with desc_act=False")
    codes = _nibbles(t["qweight"]).permute(0, 2, 1).reshape(inp, out).T          # [out, in]
    zp = _nibbles(t["qzeros"]).reshape(inp // group, out) + int(zeros_minus_one)
    s16 = _exact(t["scales"], torch.float16, "GPTQ", model_dir)
    return codes.to(torch.int32).contiguous(), torch.stack([s16, zp.to(torch.float16)], -1).contiguous()


def _awq_codes(t: dict, group: int, model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [out, in], fp16 (scale, zero point) [in/g, out, 2]) of one AWQ gemm linear."""
    inp, words = t["qweight"].shape
    out = words * 8
    _check_shapes(t, {"qweight": (inp, out // 8), "qzeros": (inp // group, out // 8),
                      "scales": (inp // group, out)}, "AWQ", model_dir)
    cols = list(_AWQ_COLUMNS)
    codes = _nibbles(t["qweight"])[..., cols].reshape(inp, out).T                  # [out, in]
    zp = _nibbles(t["qzeros"])[..., cols].reshape(inp // group, out)
    s16 = _exact(t["scales"], torch.float16, "AWQ", model_dir)
    return codes.to(torch.int32).contiguous(), torch.stack([s16, zp.to(torch.float16)], -1).contiguous()


def packed_codes(t: dict, packed: PackedExperts, layout: ExpertLayout, model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """One stored linear's tensors (suffix -> tensor) as (codes, sz) for `layout` (see above)."""
    if packed.style == "ct":
        return _ct_codes(t, layout, model_dir)
    if packed.style == "gptq":
        return _gptq_codes(t, packed.group, packed.zeros_minus_one, model_dir)
    return _awq_codes(t, packed.group, model_dir)


def checkpoint_store(model_dir: Path, spec: ModelSpec, fmt: str, device: torch.device,
                     keep_cpu_twins: bool, progress: bool = False,
                     packing: str | None = None) -> tuple[HostStore, list[tuple[str, Path]]]:
    """Stream a checkpoint's expert tensors into a HostStore. Returns the store and the names of
    the other (non-expert) tensors with their files, for the model loader. The checkpoint has
    passed `check_checkpoint(..., float_experts=True)`: every expert stored as float weights, or
    4-bit as `packed_experts` reads them (then `fmt` is their executor format), none beyond the
    spec's count."""
    from safetensors import safe_open
    from tqdm import tqdm

    from cmoe.core.checkpoint import _FUSED, _PER_EXPERT, packed_experts, safetensors_files
    packed = packed_experts(model_dir, spec)
    assert packed is None or packed.fmt == fmt, (packed, fmt)
    store = HostStore(spec, fmt, device, packing)
    if keep_cpu_twins and store.packing != "cpu":
        store.cpu_twins = [store._empty(False) for _ in range(spec.num_moe_layers)]
    moe_index = {d: m for m, d in enumerate(spec.moe_layers)}
    take = _Collector(store, spec, model_dir, packed)
    others: list[tuple[str, Path]] = []
    with tqdm(total=spec.num_moe_layers * spec.num_experts, disable=not progress, desc="experts") as bar:
        for path in safetensors_files(model_dir):
            with safe_open(str(path), framework="pt") as fh:
                for name in fh.keys():
                    pe, fu = _PER_EXPERT.match(name), _FUSED.match(name)
                    if pe and int(pe.group(1)) in moe_index:
                        bar.update(take.per_expert(fh, name, pe, moe_index[int(pe.group(1))]))
                    elif fu and int(fu.group(1)) in moe_index:
                        bar.update(take.fused(fh, name, fu, moe_index[int(fu.group(1))]))
                    else:
                        others.append((name, path))
    missing = spec.num_moe_layers * spec.num_experts - len(take.done)
    if missing:
        m, e = next((m, e) for m in range(spec.num_moe_layers) for e in range(spec.num_experts)
                    if (m, e) not in take.done)
        raise CmoeError(f"{model_dir}: {missing} experts have no complete weights (first: MoE layer {m}, expert {e})")
    return store, others


class _Collector:
    """Gathers each expert's w1, w3, w2 as the checkpoint's tensors stream by (per-expert tensors,
    or fused [E, ...] ones) and puts the expert into the store once all three are there."""

    def __init__(self, store: HostStore, spec: ModelSpec, model_dir: Path, packed: PackedExperts | None):
        self.store, self.spec, self.model_dir = store, spec, model_dir
        self.packed = packed             # cmoe.core.checkpoint.PackedExperts, or None: float weights
        self.parts = packed.parts if packed else ()      # the tensors of one 4-bit matrix
        self.pending: dict[tuple[int, int], dict] = {}
        self.done: set[tuple[int, int]] = set()

    def _finish(self, m: int, e: int) -> int:
        got = self.pending.pop((m, e))
        w1, w3, w2 = got["w1"], got["w3"], got["w2"]
        if isinstance(w1, dict):                         # 4-bit: the checkpoint's own codes
            c1, c3, c2 = (packed_codes(x, self.packed, self.store.layout, self.model_dir) for x in (w1, w3, w2))
            self.store.put_codes(m, e, {"w13": (torch.cat([c1[0], c3[0]], 0), torch.cat([c1[1], c3[1]], 1)),
                                        "w2": c2})
        else:
            self.store.put(m, e, torch.cat([w1, w3], 0), w2)
        self.done.add((m, e))
        return 1

    def per_expert(self, fh, name: str, pe, m: int) -> int:
        """One tensor of one expert (`...experts.E.w1.weight`, or a part of a 4-bit matrix)."""
        from cmoe.core.checkpoint import _CANON
        suffix = pe.group(4)
        assert suffix in (self.parts or ("weight",)), f"{name}: quantized experts passed the float check"
        key = (m, int(pe.group(2)))
        assert key[1] < self.spec.num_experts, f"{name}: expert beyond the spec passed check_checkpoint"
        got = self.pending.setdefault(key, {})
        if suffix == "weight":
            got[_CANON[pe.group(3)]] = fh.get_tensor(name)
        else:
            got.setdefault(_CANON[pe.group(3)], {})[suffix] = fh.get_tensor(name)
        if len(got) == 3 and all(not isinstance(v, dict) or len(v) == len(self.parts) for v in got.values()):
            return self._finish(*key)
        return 0

    def fused(self, fh, name: str, fu, m: int) -> int:
        """A layer's experts in one tensor [E, ...] (`gate_up_proj` or `down_proj`)."""
        assert not fu.group(3), f"{name}: quantized fused experts passed the float check"
        t = fh.get_tensor(name)
        assert t.shape[0] == self.spec.num_experts, f"{name}: fused experts passed check_checkpoint"
        n = 0
        for e in range(t.shape[0]):
            got = self.pending.setdefault((m, e), {})
            if fu.group(2) == "gate_up_proj":
                got["w1"], got["w3"] = t[e].chunk(2, 0)
            else:
                got["w2"] = t[e]
            if len(got) == 3:
                n += self._finish(m, e)
        return n
