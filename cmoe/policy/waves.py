"""How the lean executor launches a layer's GPU experts, shared with the simulator so both
engines group them alike: one fused launch ("wave") for all of them, except that an expert whose
copy must wait for another expert of the same layer to be read (a load deferred behind its
victim's kernel, with one FIFO copy stream) runs in the launch after that expert's. A wave
starts once every copy it reads has landed."""

from __future__ import annotations


def waves(gpu: list[int], after: dict[int, int]) -> list[list[int]]:
    """`gpu` in launch order, grouped into waves; `after`: loaded expert -> the expert of this
    layer whose slot it overwrites (its victim). Empty `gpu`: no wave."""
    wave_of: dict[int, int] = {}
    for e in gpu:
        v = after.get(e)
        wave_of[e] = wave_of[v] + 1 if v is not None and v in wave_of else 0
    n = max(wave_of.values(), default=-1) + 1
    return [[e for e in gpu if wave_of[e] == k] for k in range(n)]
