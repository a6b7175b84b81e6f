"""`cmoe.core.hugepages`: buffers that ask for 2 MiB pages, what the kernel granted, and the record's
word; the CPU-expert stores and calibrate's experts use them; `pages_note` names a mismatch."""

from __future__ import annotations

import pytest
import torch

from cmoe.analysis.cpu_settings import pages_note, setting_notes
from cmoe.core import hugepages
from cmoe.core.hugepages import HUGE, huge_bytes, huge_share, huge_zeros, pages_word, thp_mode


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    for text, want in (("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                       ("always madvise [never]", "never"), ("always madvise never", "")):
        (tmp_path / "enabled").write_text(text)
        assert thp_mode(str(tmp_path / "enabled")) == want
    assert thp_mode(str(tmp_path / "absent")) == ""


def test_huge_zeros_is_zeroed_aligned_and_shaped():
    t = huge_zeros((3, HUGE // 2 + 5))
    assert t.shape == (3, HUGE // 2 + 5) and t.dtype == torch.uint8 and t.is_contiguous()
    assert int(t.count_nonzero()) == 0
    if thp_mode() not in ("", "never"):
        assert t.data_ptr() % HUGE == 0
    f = huge_zeros(HUGE, torch.float32)
    assert f.shape == (HUGE,) and f.dtype == torch.float32 and float(f.abs().sum()) == 0.0
    small = huge_zeros(1000)                                      # below 2 MiB: torch.zeros
    assert small.shape == (1000,) and int(small.count_nonzero()) == 0


def test_huge_zeros_falls_back_where_huge_pages_are_off(monkeypatch):
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "never")
    t = huge_zeros(3 * HUGE)
    assert t.shape == (3 * HUGE,) and int(t.count_nonzero()) == 0
    t[0] = 7                                                      # writable, its own storage
    assert t.untyped_storage().nbytes() == 3 * HUGE


SMAPS = """\
7f0000000000-7f0000600000 rw-p 00000000 00:00 0
Size:               6144 kB
AnonHugePages:      4096 kB
Locked:                0 kB
THPeligible:    1
VmFlags: rd wr mr mw me ac sd hg
7f0000600000-7f0000800000 rw-p 00000000 00:00 0
Size:               2048 kB
AnonHugePages:         0 kB
VmFlags: rd wr mr mw me ac sd hg
7f0000800000-7f0000c00000 rw-p 00000000 00:00 0
AnonHugePages:      2048 kB
VmFlags: rd wr mr mw me ac sd

7f1000000000-7f1000200000 r-xp 00000000 08:01 1234   /usr/lib/libc.so.6
AnonHugePages:      2048 kB
VmFlags: rd ex mr mw me sd hg
"""


class _Fake:
    """The two numbers huge_bytes reads of a tensor: where it starts and how many bytes."""
    def __init__(self, ptr: int, n: int):
        self.ptr, self.n = ptr, n

    def data_ptr(self) -> int:
        return self.ptr

    def numel(self) -> int:
        return self.n

    def element_size(self) -> int:
        return 1


def test_huge_bytes_counts_the_mappings_that_asked_by_their_share(tmp_path):
    """Of a mapping flagged `hg` (it asked for huge pages) the bytes overlapped times its share on
    huge pages; of any other mapping nothing, whatever its AnonHugePages (a heap under `always`
    cannot say which of its bytes have them); a blank line is skipped."""
    (tmp_path / "smaps").write_text(SMAPS)
    p = str(tmp_path / "smaps")
    base = 0x7F0000000000
    assert huge_bytes([_Fake(base, 6 << 20)], p) == 4 << 20             # the mapping's huge bytes
    assert huge_bytes([_Fake(base, 3 << 20)], p) == 2 << 20             # half of it: half its share
    assert huge_bytes([_Fake(base + (6 << 20), 2 << 20)], p) == 0        # asked, got none
    assert huge_bytes([_Fake(base + (8 << 20), 4 << 20)], p) == 0        # huge pages, never asked
    assert huge_bytes([_Fake(base, 3 << 20), _Fake(base + (3 << 20), 5 << 20)], p) == 4 << 20
    assert huge_bytes([_Fake(0x1000, 4096)], p) == 0                     # in no mapping
    assert huge_bytes([_Fake(base, 1)], str(tmp_path / "absent")) is None


def test_pages_word():
    assert (pages_word(None), pages_word(0.0), pages_word(0.49), pages_word(0.5), pages_word(1.0)) == \
        (None, "4 KiB pages", "4 KiB pages", "2 MiB pages", "2 MiB pages")


def _thp_off_here() -> bool:
    """This process may not have huge pages (`prctl(PR_SET_THP_DISABLE)`, inherited from a runner)."""
    try:
        with open("/proc/self/status") as f:
            return any(ln.split() == ["THP_enabled:", "0"] for ln in f)
    except OSError:
        return True


@pytest.mark.skipif(thp_mode() in ("", "never") or _thp_off_here(), reason="no transparent huge pages here")
def test_a_huge_buffer_gets_huge_pages_and_a_plain_one_does_not():
    """On this machine: the kernel grants what was asked (nearly all: it may keep a few small pages
    where memory is short, so the bound is a half), and a plain buffer of the same size, a fresh
    mapping touched without asking, counts nothing. (Not `torch.zeros`: the allocator may hand back
    memory that something else in the process asked huge pages for; in one full CI run 0.7% of
    such a buffer counted.)"""
    import mmap
    big = huge_zeros((4, HUGE))
    assert huge_share([big]) >= 0.5 and huge_share([big[1:3]]) >= 0.5
    m = mmap.mmap(-1, 4 * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    plain = torch.frombuffer(m, dtype=torch.uint8)
    plain[::4096].zero_()                                   # every page touched, none asked for
    assert huge_share([plain]) == 0.0


def test_the_cpu_store_and_calibrates_experts_ask_for_huge_pages(monkeypatch):
    """A CPU store's blocks, a GPU store's twins and calibrate's random CPU experts go through
    `huge_zeros`; the store reports the share and the record's word."""
    from cmoe.calibrate import measure
    from cmoe.core.spec import ModelSpec
    from cmoe.executor import store as store_mod
    made = []

    def spy(shape, dtype=None):
        made.append(shape)
        return torch.zeros(shape, dtype=dtype or torch.uint8)
    monkeypatch.setattr(store_mod, "huge_zeros", spy)
    monkeypatch.setattr(measure, "huge_zeros", spy)
    spec = ModelSpec(name="tiny", family="mixtral", num_layers=2, hidden=128, expert_ffn=128, num_experts=4, top_k=2,
                     num_heads=1, num_kv_heads=1, head_dim=128, vocab=8, moe_layers=(0, 1))
    s = store_mod.HostStore(spec, "w4g32", torch.device("cpu"))
    assert made == [(spec.num_experts, s.slot)] * spec.num_moe_layers
    asked = []
    monkeypatch.setattr(store_mod, "huge_share", lambda ts: asked.append(ts) or (0.75 if ts is s.blocks else 0.25))
    assert (s.cpu_huge_share(), s.cpu_pages()) == (0.75, "2 MiB pages")
    assert asked == [s.blocks]                                    # read once for the same buffers
    s.blocks = [b.clone() for b in s.blocks]                      # other buffers: read again
    assert (s.cpu_huge_share(), len(asked)) == (0.75, 2)
    made.clear()
    lay = store_mod.expert_layout("w4g32", spec.hidden, spec.expert_ffn)
    measure.random_cpu_experts(lay, 2)
    assert made == [store_mod.slot_size(lay)] * 2


def _v(prof, runs, n=3):
    return {"op_kinds": {"cpu_expert": {"n": n}}, "cpu_pages": {"profile": prof, "runs": runs}}


def test_pages_note_names_a_profile_on_other_pages():
    tail = (", the runs' sat on 2 MiB pages: the same bytes on 2 MiB pages moved the CPU-expert runs -7% to +17% "
            "on the lent H100s' hosts; calibrate again")
    assert pages_note(_v("4 KiB pages", "2 MiB pages")) == \
        "  the profile's CPU experts were measured on 4 KiB pages" + tail
    assert pages_note(_v(None, "2 MiB pages")) == ("  the profile's CPU experts were measured on pages it does "
                                                   "not record (4 KiB before cmoe asked for huge ones)" + tail)
    assert pages_note(_v("2 MiB pages", "4 KiB pages")).startswith(
        "  the profile's CPU experts were measured on 2 MiB pages, the runs' sat on 4 KiB pages: ")
    for prof, runs, n in (("2 MiB pages", "2 MiB pages", 3), (None, "4 KiB pages", 3), ("4 KiB pages", None, 3),
                          ("4 KiB pages", "2 MiB pages", 0)):
        assert pages_note(_v(prof, runs, n)) is None
    both = _v("4 KiB pages", "2 MiB pages") | {"omp_wait": {"profile": "default", "runs": "ACTIVE"}}
    notes = setting_notes(both)
    assert len(notes) == 2 and "OpenMP default" in notes[0] and "4 KiB pages" in notes[1]
    assert setting_notes({"op_kinds": {}}) == []


def test_an_expert_on_huge_pages_computes_as_on_small_ones():
    """The same random expert's bytes in a `huge_zeros` buffer and a `torch.zeros` one: identical
    bytes, identical `ffn` output through the CPU kernel; the huge one asked for 2 MiB pages."""
    from cmoe.calibrate.measure import random_expert
    from cmoe.executor.kernels import ExpertViews, ffn
    from cmoe.executor.layout import expert_layout, slot_size
    lay = expert_layout("w4g128", 1024, 2048)
    n = slot_size(lay)
    assert n > HUGE                                               # big enough to ask
    small, huge = torch.zeros(n, dtype=torch.uint8), huge_zeros(n)
    for b in (small, huge):
        random_expert(lay, 3, torch.device("cpu"), "cpu", b)
    assert torch.equal(small, huge)
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert torch.equal(ffn(x, ExpertViews(lay, small, "cpu")), ffn(x, ExpertViews(lay, huge, "cpu")))
    if thp_mode() not in ("", "never") and not _thp_off_here():
        assert huge_share([huge]) >= 0.5
