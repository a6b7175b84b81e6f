"""A static KV cache for transformers' attention modules, and the attention mask over it.

Every supported family's attention module touches its cache through one call,
`past_key_values.update(key_states, value_states, layer_idx)`, and attends over what it returns;
so a cache is anything with that method. This one allocates each layer's keys and values once,
at [batch, heads, max_len, dim] (MLA's compressed latents are just other shapes), writes a pass's
new entries at the cache positions held in a device tensor, and returns the whole buffer. Reads
and writes never change an address and the positions live on the device, so a decode step that
uses it can be captured in a CUDA graph and replayed with new positions.

The mask is a boolean [batch, 1, queries, max_len] (True: attend), the form SDPA takes: key j is
visible to query i when slot j holds a real token of that row (left padding is not) and j <= i.
A padding query sees its own slot, so no row of the softmax is empty (its output is never used).
"""

from __future__ import annotations

import torch


class StaticKV:
    def __init__(self, batch: int, max_len: int, device: torch.device):
        self.batch, self.max_len, self.device = batch, max_len, device
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.length = 0                                            # slots written so far (host)
        self.slots = torch.zeros(1, dtype=torch.long, device=device)   # decode: the slot written
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.decode_mask = self.valid[:, None, None, :]            # a view: follows `valid` in place
        self._write = self.slots

    # --- what the attention modules call ---------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        k = self.keys.get(layer_idx)
        if k is None:
            b, h, _, dk = key_states.shape
            k = self.keys[layer_idx] = key_states.new_zeros(b, h, self.max_len, dk)
            self.values[layer_idx] = value_states.new_zeros(b, value_states.shape[1], self.max_len,
                                                            value_states.shape[-1])
        v = self.values[layer_idx]
        k.index_copy_(2, self._write, key_states)
        v.index_copy_(2, self._write, value_states)
        return k, v

    @property
    def decoding(self) -> bool:
        """True while writes go to the one decode slot (`aim_decode`, `step`), not a prefill's range."""
        return self._write is self.slots

    # --- what the engine calls before a pass -----------------------------------------------------
    def prefill(self, n: int, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Positions 0..n-1 for a first pass of n tokens per row; returns its mask [B, 1, n, max_len]."""
        if self.length:
            raise ValueError("a static cache takes one prefill, at its start")
        if n > self.max_len:
            raise ValueError(f"a prefill of {n} tokens does not fit a cache of {self.max_len}")
        dev = self.device
        self._write = torch.arange(n, device=dev)
        real = torch.ones(self.batch, n, dtype=torch.bool, device=dev) if attention_mask is None \
            else attention_mask[:, :n].to(dev).bool()
        self.valid[:, :n] = real
        self.length = n
        i = torch.arange(n, device=dev)[:, None]
        j = torch.arange(self.max_len, device=dev)[None, :]
        causal = (j <= i)[None]                                    # [1, n, max_len]
        own = (j == i)[None]
        return ((self.valid[:, None, :] & causal) | own)[:, None]

    def aim_decode(self) -> None:
        """Point writes at the next decode slot without taking it (a graph's warm-up run writes
        there; the real step overwrites it)."""
        self.slots.fill_(self.length)
        self._write = self.slots

    def step(self) -> int:
        """Make room for one decode token per row: its slot is written on the device, in place
        (outside any graph). Returns the slot. The decode mask is `decode_mask`."""
        s = self.advance()
        self.slots.fill_(s)
        self.valid[:, s] = True
        return s

    def device_step(self) -> None:
        """`step`'s device side as two kernels that take the slot from the device: the slot one past
        the last written, and its mask column. The first work of a graphed decode pass
        (`lean_program._capture`), so no pass copies its slot in from the host; the host's
        `advance` keeps the count, and `aim_device_steps` sets the slot before the first replay."""
        self.slots.add_(1)
        self.valid.index_fill_(1, self.slots, True)

    def aim_device_steps(self) -> None:
        """Before the first pass of graphs that hold `device_step`: the slot last written, so that
        their step lands on the next one."""
        self.slots.fill_(self.length - 1)                         # -1 with no prefill: the first step lands on 0
        self._write = self.slots

    def check_device_steps(self) -> None:
        """After graphed passes that stepped on the device: the device's slot is the last the host
        took. The device counts, so a pass that took a slot without replaying its first graph (or
        the reverse) would shift every later pass's writes; refused, not passed on."""
        on_device = int(self.slots.item())
        if on_device != self.length - 1:
            raise RuntimeError(f"the cache's slot on the device ({on_device}) is not the last one the host took "
                               f"({self.length - 1}): a pass stepped one side only")

    def advance(self) -> int:
        """`step`'s host side alone: the next slot, taken; the caller writes `slots` and the
        `valid` column on the device (`lean_io.pass_inputs`' runtime calls, or P's graph:
        `device_step`)."""
        if self.length >= self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions and all are used")
        s = self.length
        self._write = self.slots
        self.length += 1
        return s


def check_window(config, max_len: int) -> None:
    """The static cache's mask attends to the whole context; a model that attends within a sliding
    window shorter than the run's context would be computed wrongly, so it is refused."""
    from cmoe.core.errors import CmoeError
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window is not None and max_len > window:
        raise CmoeError(f"this model attends within a sliding window of {window} tokens and the run needs "
                        f"{max_len}: use --engine hf, or fewer --tokens")
