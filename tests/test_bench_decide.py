"""benchmarks/bench_aggregation.py --decide: issue 45's targets decided over several runs, on run CSVs made up
here with known statistics, against the Student-t interval of the log statistics computed by hand."""

import csv
import importlib.util
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from conftest import ROOT, assert_usage_error, run_script

spec = importlib.util.spec_from_file_location("bench_aggregation", ROOT / "benchmarks" / "bench_aggregation.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

POOL = dict(section="pool", case="geometric", K=4, V=32000, N=256, dtype="float32")
BUSY = dict(section="recursion+busy", case="llm", K=4, V=256, N=10001, dtype="H=64")


def row(size, contender, ratio_med):
    return dict(size, contender=contender, threads=2, wall_min=0.1, wall_med=0.1, wall_max=0.1, cpu_med=0.1,
                ratio_min=ratio_med, ratio_med=ratio_med, ratio_max=ratio_med, bw_fraction=0.5)


def write_run(path, rows):
    with open(path, "w", newline="") as f:
        f.write("# made up by the test\n")
        wr = csv.DictWriter(f, fieldnames=bench.FIELDS)
        wr.writeheader()
        wr.writerows(rows)
    return path


def runs(tmp_path, torch_ratios, floor_ratios=(0.5, 0.5, 0.5), one_thread=(1.0, 1.01, 0.99), only_first=None):
    """Three runs: numpy / ours 3x in each (never the fastest peer), torch / ours as given, the floor / ours
    and ours on one thread / ours (busy core) as given; ``only_first``: a size measured in the first run only."""
    paths = []
    for i, (t, fl, one) in enumerate(zip(torch_ratios, floor_ratios, one_thread)):
        rows = [row(POOL, "ours", 1.0), row(POOL, "ours-fresh", 0.2), row(POOL, "compute", 0.1),
                row(POOL, "numpy", 3.0), row(POOL, "torch", t), row(POOL, "floor", fl),
                row(BUSY, "ours", 1.0), row(BUSY, "ours-1thread", one), row(BUSY, "numpy", 0.01)]
        if i == 0 and only_first:
            rows.append(row(dict(POOL, K=8), "torch", only_first))
        paths.append(write_run(tmp_path / f"run{i}.csv", rows))
    return paths


def by_target(rows):
    return {r["target"]: r for r in rows}


def t_interval(values, level=0.95):
    x = np.log(values)
    half = stats.t.ppf(0.5 + level / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size)
    return math.exp(x.mean()), math.exp(x.mean() - half), math.exp(x.mean() + half)


def test_the_fastest_peer_decides_with_the_t_interval_of_the_runs(tmp_path):
    torch = np.array([1.5, 1.55, 1.45])
    got = by_target(bench.decide(runs(tmp_path, torch)))
    peer = got["geometric >= 1.2x the fastest peer (float32)"]
    mean, lo, hi = t_interval(torch)                       # torch, not numpy: the least of the peers' medians
    assert (peer["geo_mean"], peer["lo"], peer["hi"]) == pytest.approx((mean, lo, hi), rel=1e-12)
    assert peer["runs"] == 3 and peer["run_min"] == 1.45 and peer["run_max"] == 1.55
    assert peer["verdict"] == "met" and lo > 1.2
    floor = got["geometric within 1.3x of the floor"]      # ours / floor = 1 / (floor / ours) = 2 in every run
    assert floor["geo_mean"] == pytest.approx(2.0) and floor["verdict"] == "missed"
    busy = got["recursion, other core busy: no worse than one thread (5% margin)"]
    assert busy["verdict"] == "met" and busy["lo"] > 0.95 and busy["hi"] < 1.05     # met at 1 - 5%, not at 1
    assert set(got) == {"geometric >= 1.2x the fastest peer (float32)", "geometric within 1.3x of the floor",
                        "recursion, other core busy: no worse than one thread (5% margin)"}


@pytest.mark.parametrize("torch, verdict", [((1.0, 1.05, 0.95), "missed"), ((1.1, 1.4, 1.25), "inconclusive"),
                                            ((1.3, 1.32, 1.28), "met")])
def test_a_target_is_missed_when_the_interval_is_below_and_undecided_when_it_holds_it(tmp_path, torch, verdict):
    peer = by_target(bench.decide(runs(tmp_path, torch)))["geometric >= 1.2x the fastest peer (float32)"]
    _, lo, hi = t_interval(np.array(torch))
    assert peer["verdict"] == verdict
    assert (verdict == "inconclusive") == (lo <= 1.2 < hi)


def test_an_upper_target_is_met_below_its_threshold_and_a_size_of_one_run_is_left_out(tmp_path):
    rows = bench.decide(runs(tmp_path, (1.5, 1.5, 1.5), floor_ratios=(0.9, 0.95, 0.85), only_first=2.0))
    floor = by_target(rows)["geometric within 1.3x of the floor"]
    assert floor["verdict"] == "met" and floor["hi"] < 1.3
    assert [r["K"] for r in rows if r["target"].startswith("geometric >= 1.2x")] == ["4"]     # K = 8: one run


def test_the_command_line_writes_its_own_csv_and_refuses_a_single_run(tmp_path):
    paths = runs(tmp_path, (1.5, 1.55, 1.45))
    out = tmp_path / "decisions.csv"
    run_script("benchmarks/bench_aggregation.py", "--decide", *paths, "--csv", out)
    table = pd.read_csv(out)
    assert list(table.verdict) == [r["verdict"] for r in bench.decide(paths)]
    assert_usage_error(run_script("benchmarks/bench_aggregation.py", "--decide", paths[0], check=False))
