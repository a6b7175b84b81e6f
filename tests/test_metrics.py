"""cmoe.core.metrics: one definition of every figure both engines report."""

from cmoe.core.metrics import DEMAND, HIT, LATE, RunRecord, classify, summary


def test_classify_by_hand():
    assert classify(False, None, 10.0) == (HIT, 0.0)            # nothing pending
    assert classify(False, 8.0, 10.0) == (HIT, 0.0)             # prefetched, landed before it was due
    assert classify(False, 13.5, 10.0) == (LATE, 3.5)           # prefetched, still in flight: the kernel waits
    assert classify(True, 9.0, 10.0) == (DEMAND, 0.0)           # its own layer loaded it: a miss however fast
    assert classify(True, 12.0, 10.0) == (DEMAND, 2.0)


def test_summary_counts_decode_passes_only():
    rec = RunRecord()
    rec.pass_us = [(0, False, 8, 4000.0), (1, True, 1, 1000.0), (2, True, 1, 3000.0)]
    rec.occupancy = [3, 5, 7]
    rec.loaded(0, 100)                                           # prefill
    rec.ran(0, DEMAND, 50.0)
    rec.loaded(1, 100)
    rec.ran(1, DEMAND, 20.0)
    rec.ran(1, HIT, 0.0)
    rec.loaded(2, 100)                                           # a prefetch that came late
    rec.ran(2, LATE, 5.0)
    rec.ran(2, HIT, 0.0)
    rec.at(2).fallbacks += 1
    rec.at(2).stall_us += 7.0                                    # the GPU waited for the CPU
    m = summary(rec)
    assert (m["scope"], m["decode_passes"], m["decode_tokens"]) == ("decode", 2, 2)
    assert m["tokens_per_s"] == 2 / 4000e-6 and m["prefill_ms"] == 4.0
    assert (m["loads"], m["prefill_loads"], m["bytes_moved"]) == (2, 1, 200)
    assert (m["hits"], m["late"], m["demand"], m["fallbacks"]) == (2, 1, 1, 1)
    assert m["hit_rate"] == 2 / 5 and m["stall_ms"] == (20 + 5 + 7) / 1e3 and m["mean_occupancy"] == 6
    assert rec.loads == 3 and rec.gpu_experts == 5                 # whole-run totals keep prefill
    assert [r["hits"] for r in rec.pass_rows()] == [0, 1, 1] and [r["experts"] for r in rec.pass_rows()] == [1, 2, 3]
