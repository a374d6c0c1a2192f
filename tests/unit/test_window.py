"""kite_shared.window.TimeWindow: what telemetry figures are computed over."""

from kite_shared.window import TimeWindow


def test_samples_older_than_the_window_are_forgotten():
    w = TimeWindow(10.0)
    for t, v in ((0.0, 5.0), (4.0, 1.0), (9.0, 3.0)):
        w.add(t, v)
    assert (w.count(9.0), w.total(9.0), w.rate(9.0)) == (3, 9.0, 0.3)
    assert (w.count(12.0), w.total(12.0)) == (2, 4.0)  # the sample at 0 s is 12 s old
    assert w.count(30.0) == 0 and w.percentile(30.0, 0.5) == 0.0


def test_percentiles_are_nearest_rank():
    w = TimeWindow(60.0)
    for v in range(1, 101):  # 1..100
        w.add(0.0, float(v))
    assert w.percentile(0.0, 0.5) == 50.0
    assert w.percentile(0.0, 0.99) == 99.0
    assert w.percentile(0.0, 1.0) == 100.0
    one = TimeWindow(60.0)
    one.add(0.0, 7.0)
    assert one.percentile(0.0, 0.01) == one.percentile(0.0, 0.99) == 7.0
