"""benchmarks/reproduce.py and its analysis: alignment, rank correlations against scipy, bootstrap CIs, the
gain rule, the verdicts, the report on synthetic results, resumability with a fake trainer, and (slow)
``reproduce.py all --quick`` for real."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import reproduce  # noqa: E402
import reproduce_analysis as A  # noqa: E402
import reproduce_report as R  # noqa: E402
import reproduce_verdicts as V  # noqa: E402

stats = pytest.importorskip("scipy.stats")


def _write_metrics(run_dir: Path, rows: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps({"time": 0.0, **row}) + "\n")


# ---------------------------------------------------------------- correlations
def test_rank_averages_ties():
    assert A.rank([10, 20, 20, 5]).tolist() == [2, 3.5, 3.5, 1]


def test_spearman_and_pearson_match_scipy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=40)
    y = 0.5 * x + rng.normal(size=40)
    y[:5] = y[5]  # ties
    assert A.spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)
    assert A.pearson(x, y) == pytest.approx(stats.pearsonr(x, y).statistic, abs=1e-12)
    assert A.spearman([1, 2, 3, 4], [1, 4, 9, 16]) == pytest.approx(1.0)  # monotone, not linear
    assert A.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(A.pearson([1, 2, 3], [5, 5, 5]))  # constant side: undefined
    assert math.isnan(A.spearman([1, 2], [1, 2]))  # fewer than 3 points


def test_bootstrap_ci_is_seeded_and_brackets_the_statistic():
    rng = np.random.default_rng(1)
    x = rng.normal(size=60)
    y = x + 0.5 * rng.normal(size=60)
    ci = A.bootstrap_ci(x, y, A.spearman, n_boot=300, seed=3)
    assert ci == A.bootstrap_ci(x, y, A.spearman, n_boot=300, seed=3)
    assert ci[0] < A.spearman(x, y) < ci[1] and ci[0] > 0
    noise = A.bootstrap_ci(x, rng.normal(size=60), A.spearman, n_boot=300)
    assert noise[0] < 0 < noise[1]
    assert A.ci_sign(ci) == 1 and A.ci_sign(noise) == 0 and A.ci_sign((-0.5, -0.1)) == -1
    assert A.ci_sign((math.nan, math.nan)) == 0


# ---------------------------------------------------------------- alignment
def test_validation_points_take_the_nearest_logged_step(tmp_path):
    from ragen_jax.train.metrics import read_metrics

    mi = "collapse_trajectory_sample/mi_zscore"
    rows = [{"step": 0, "val/success": 0.1}, {"step": 1, mi: 1.0, "actor/entropy": 0.5},
            *({"step": s, "actor/entropy": 0.5 + s} for s in range(2, 10) if s != 5),
            {"step": 5, mi: 2.0, "actor/entropy": 5.5}, {"step": 10, mi: 3.0, "val/success": 0.4},
            {"step": 20, "val/success": 0.9}]
    _write_metrics(tmp_path, rows)
    rows = read_metrics(str(tmp_path))  # sorted by step
    assert A.predictor_keys(rows) == ["actor/entropy", mi]
    points = A.validation_points(rows, ["actor/entropy", mi], max_gap=5)
    assert [p["step"] for p in points] == [0, 10, 20]
    assert points[0][mi] == 1.0 and points[0]["actor/entropy"] == 0.5  # step 0: nearest is step 1
    assert points[1][mi] == 3.0 and points[1]["actor/entropy"] == 9.5  # step 10 lacks it: step 9
    assert points[2][mi] is None  # nothing within 5 steps of step 20
    assert A.family_of(mi) == "mi" and A.family_of("actor/entropy") == "entropy"
    assert A.family_of("collapse_first_turn_sample/conditional_entropy_seq_est") == "entropy"
    assert A.family_of("collapse_first_turn_sample/retrieval_accuracy") == "mi"
    assert A.family_of("val/success") is None


def test_validation_points_break_ties_to_the_earlier_step():
    rows = [{"step": 4, "k": 1.0}, {"step": 5, "val/success": 0.5}, {"step": 6, "k": 2.0}]
    assert A.validation_points(rows, ["k"], max_gap=1)[0]["k"] == 1.0


def test_correlation_table_over_points_of_several_runs(tmp_path):
    from ragen_jax.train.metrics import read_metrics

    rng = np.random.default_rng(2)
    points = []
    for run in range(4):
        rows = []
        for s in range(0, 50, 10):
            success = float(rng.uniform())
            rows += [{"step": s, "val/success": success},
                     {"step": s + 1, "collapse_trajectory_sample/mi_zscore": success + 0.1 * float(rng.normal()),
                      "actor/entropy": float(rng.normal())}]
        _write_metrics(tmp_path / f"r{run}", rows)
        points += A.run_record(read_metrics(str(tmp_path / f"r{run}")))["points"]
    assert len(points) == 20
    table = {t["metric"]: t for t in A.correlation_table(points, A.predictor_keys(points), n_boot=200)}
    x = [p["collapse_trajectory_sample/mi_zscore"] for p in points]
    y = [p["success"] for p in points]
    mi = table["collapse_trajectory_sample/mi_zscore"]
    assert mi["n"] == 20 and mi["spearman"] == pytest.approx(stats.spearmanr(x, y).statistic)
    assert mi["pearson"] == pytest.approx(stats.pearsonr(x, y).statistic)
    assert A.ci_sign(mi["spearman_ci"]) == 1
    checks = V.predictor_checks(list(table.values()))
    assert checks[0][1] and checks[2][1]


# ---------------------------------------------------------------- seeds, the gain rule, verdicts
def test_seed_band_and_paired_deltas():
    band = A.seed_band([[(0, 0.0), (10, 0.2), (20, 0.4)], [(0, 0.2), (10, 0.4)]])
    assert band["step"] == [0, 10]
    assert band["mean"] == pytest.approx([0.1, 0.3]) and band["std"] == pytest.approx([0.1, 0.1])
    assert band["min"] == pytest.approx([0.0, 0.2]) and band["max"] == pytest.approx([0.2, 0.4])
    assert A.paired_final_deltas({0: 0.5, 1: 0.7, 2: 0.1}, {0: 0.25, 1: 0.5}) == pytest.approx({0: 0.25, 1: 0.2})


def test_a_gain_must_exceed_the_seeds_spread():
    assert A.compare([0.5, 0.6, 0.7], [0.1, 0.2, 0.3]) == "gain"  # diff 0.4 > std 0.082
    assert A.compare([0.1, 0.2, 0.3], [0.5, 0.6, 0.7]) == "loss"
    assert A.compare([0.2, 0.6], [0.1, 0.5]) == "within spread"  # diff 0.1 < std 0.2
    assert A.compare([0.9], [0.1]) == "too few seeds"
    assert A.spread([0.2, 0.6], [0.1, 0.1]) == pytest.approx(0.2)
    assert V.verdict_from_counts(0, 0) == "not run yet"
    assert V.verdict_from_counts(2, 2) == "reproduced"
    assert V.verdict_from_counts(1, 3) == "partly"
    assert V.verdict_from_counts(0, 3) == "not reproduced"


def _run(task, condition, seed, final, study="filter", curves=None):
    return {"study": study, "task": task, "condition": condition, "seed": seed, "name": f"{task}-{condition}-seed{seed}",
            "val_curve": [[0, 0.0], [10, final / 2], [20, final]], "points": [], "curves": curves or {}}


def test_filter_and_top_p_verdicts():
    finals = {"no_filter": (0.1, 0.11, 0.12), "top_p_linear": (0.5, 0.51, 0.52),
              "top_p_softmax": (0.05, 0.25, 0.15)}  # +0.04 on average, within its seeds' std 0.08
    runs = [_run("sokoban", c, s, f[s]) for s in range(3) for c, f in finals.items()]
    checks = V.filter_checks(runs)
    assert [ok for _, ok in checks] == [True, False]
    assert V.verdict(checks) == "partly"
    assert V.verdict(V.filter_checks([r for r in runs if r["seed"] == 0])) == "undecided (too few seeds)"
    sweep = [_run("sokoban", f"p={p}", s, f + 0.02 * s, "top_p")
             for s in range(2) for p, f in (("1.0", 0.1), ("0.98", 0.4), ("0.9", 0.35), ("0.6", 0.2))]
    assert V.verdict(V.top_p_checks(sweep)) == "reproduced"


def test_collapse_and_gradient_verdicts():
    def curves(mi, h):
        return {V.COLLAPSE_MI: [[1, mi[0]], [20, mi[1]]], V.COLLAPSE_ENTROPY: [[1, h[0]], [20, h[1]]]}
    runs = [_run("sokoban", "no_filter", s, 0.0, "collapse", curves((0.8, 0.2 + 0.01 * s), (1.0, 1.1))) for s in range(2)]
    runs += [_run("sokoban", "top_p_linear", s, 0.3, "collapse", curves((0.8, 0.7 + 0.01 * s), (1.0, 0.9)))
             for s in range(2)]
    assert V.verdict(V.collapse_checks(runs)) == "reproduced"
    held = [_run("sokoban", c, s, 0.3, "collapse", curves((1.0, 1.0), (1.0, 1.0 + 0.01 * s)))
            for c in ("no_filter", "top_p_linear") for s in range(2)]
    assert V.verdict(V.collapse_checks(held)) == "not reproduced"  # no collapse: MI and entropy both hold
    # The coin runs (a reward that ignores the input) are checked on their own: here they collapse, the
    # real-reward runs do not.
    coin = [_run("sokoban", "coin_no_filter", s, 0.0, "collapse", curves((1.0, 0.3 + 0.01 * s), (1.0, 1.2)))
            for s in range(2)]
    checks = dict(V.collapse_checks(held + coin))
    assert checks["coin_no_filter: retrieval accuracy falls while the conditional entropy does not"] is True
    assert checks["no_filter: retrieval accuracy falls while the conditional entropy does not"] is False
    assert not any("coin_top_p_linear" in what for what in checks)  # not run: no check
    probe = {"step": 1, **{f"grad_norm/bucket_{i}/task": float(i) for i in range(1, 7)},
             **{f"grad_norm/bucket_{i}/entropy": 2.0 + 0.01 * (i % 2) for i in range(1, 7)}}
    trend = A.gradient_trend([probe], "task")
    assert trend["rho"] == pytest.approx(1.0) and trend["ratio"] == pytest.approx(6.0)
    assert V.verdict(V.gradient_checks([probe])) == "reproduced"
    assert V.gradient_checks([]) == []


# ---------------------------------------------------------------- the report
def test_report_on_synthetic_results(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    filt = [_run(t, c, s, f + 0.01 * s) for t in ("sokoban", "frozen_lake") for s in range(3)
            for c, f in (("no_filter", 0.1), ("top_p_linear", 0.5), ("top_p_softmax", 0.45))]
    (results / "reproduce_filter.json").write_text(json.dumps({"study": "filter", "quick": False, "runs": filt,
                                                               "command": "python benchmarks/reproduce.py filter"}))
    table = [{"metric": "collapse_trajectory_sample/mi_zscore", "family": "mi", "n": 30, "spearman": 0.4,
              "spearman_ci": [0.1, 0.6], "pearson": 0.3, "pearson_ci": [0.0, 0.5]},
             {"metric": "actor/entropy", "family": "entropy", "n": 30, "spearman": -0.1,
              "spearman_ci": [-0.4, 0.2], "pearson": -0.1, "pearson_ci": [-0.4, 0.2]}]
    (results / "reproduce_predictors.json").write_text(json.dumps(
        {"study": "predictors", "quick": True, "sources": ["filter"], "num_points": 30, "num_runs": 6,
         "n_boot": 100, "table": table}))
    doc = tmp_path / "docs" / "reproduction.md"
    R.write_report(results, doc)
    text = doc.read_text()
    assert "| 1. SNR-aware filtering beats no filtering | reproduced |" in text
    assert "no verdict (quick smoke size)" in text and "Quick smoke size" in text
    assert text.count("not run yet") >= 3  # top_p, collapse, gradients
    assert "0.510 +- 0.008 (n=3)" in text and "s0: +0.400" in text
    assert "+0.40 [+0.10, +0.60]" in text
    for png in ("filter_sokoban.png", "filter_frozen_lake.png", "predictors.png"):
        assert (doc.parent / "reproduction" / png).stat().st_size > 1000
        assert f"(reproduction/{png})" in text


# ---------------------------------------------------------------- runs, resumability
def test_study_runs_cover_the_issue():
    filt = reproduce.study_runs("filter", None)
    assert len(filt) == 27 and {r.seed for r in filt} == {0, 1, 2}
    slippery = [r for r in filt if r.task == "frozen_lake_slippery"]
    assert all("env.params.success_rate=0.8" in r.overrides for r in slippery)
    assert {r.condition for r in filt} == {"no_filter", "top_p_linear", "top_p_softmax"}
    top_p = reproduce.study_runs("top_p", None)
    assert {r.condition for r in top_p} == {"p=1.0", "p=0.98", "p=0.9", "p=0.6"} and len(top_p) == 8
    collapse = reproduce.study_runs("collapse", [5])
    assert len(collapse) == 4 and all("algorithm.entropy_coeff=0.01" in r.overrides and r.seed == 5 for r in collapse)
    assert [("algorithm.train_reward=coin" in r.overrides, r.condition.removeprefix("coin_")) for r in collapse] == [
        (False, "no_filter"), (False, "top_p_linear"), (True, "no_filter"), (True, "top_p_linear")]
    args = reproduce.config_args(collapse[0], quick=True, extra=["rollout.temperature=0.7"])
    assert args[0] == "--config=tests/configs/small.py:sokoban" and "--config.seed=5" in args
    assert args.index("--config.trainer.total_steps=4") < args.index("--config.rollout.temperature=0.7")


def test_a_finished_run_is_skipped(tmp_path):
    calls = []

    def fake_runner(args, log):
        calls.append(args)
        run_dir = Path(next(a for a in args if a.startswith("--config.run_dir=")).split("=", 1)[1])
        _write_metrics(run_dir, [{"step": 0, "val/success": 0.25}, {"step": 1, "actor/entropy": 1.0},
                                 {"step": 2, "val/success": 0.5}])
        with open(log, "a") as f:  # what ragen_jax.main prints last
            f.write("training...\n" + json.dumps({"run_dir": str(run_dir), "stop_reason": "completed",
                                                   "wall_time_s": 3.0}, indent=2) + "\n")
        return 3.0

    a = reproduce.parse_args(["top_p", "--quick", "--out-dir", str(tmp_path / "runs"),
                              "--results-dir", str(tmp_path / "results"), "--limit", "2"])
    first = reproduce.run_study("top_p", a, runner=fake_runner)
    assert len(calls) == 2 and [r["skipped"] for r in first["runs"]] == [False, False]
    # a run cut off before its summary is run again; the finished one is not
    log = tmp_path / "runs" / "top_p" / f"{first['runs'][1]['name']}.log"
    log.write_text("cut off\n")
    second = reproduce.run_study("top_p", a, runner=fake_runner)
    assert len(calls) == 3 and [r["skipped"] for r in second["runs"]] == [True, False]
    saved = json.loads((tmp_path / "results" / "reproduce_top_p.json").read_text())
    assert saved["quick"] and saved["seeds"] == [0] and len(saved["runs"]) == 2
    assert saved["runs"][0]["val_curve"] == [[0, 0.25], [2, 0.5]] and saved["runs"][0]["wall_s"] == 3.0
    assert saved["runs"][0]["points"][0]["actor/entropy"] == 1.0


def test_conditions_pick_runs_of_the_study_and_an_unknown_one_names_the_known(tmp_path):
    calls = []

    def fake_runner(args, log):
        calls.append(next(a for a in args if a.startswith("--config.run_dir=")))
        run_dir = Path(calls[-1].split("=", 1)[1])
        _write_metrics(run_dir, [{"step": 0, "val/success": 0.25}])
        log.write_text(json.dumps({"run_dir": str(run_dir), "wall_time_s": 1.0}, indent=2) + "\n")

    argv = ["collapse", "--task", "countdown", "--out-dir", str(tmp_path / "runs"), "--results-dir", str(tmp_path / "r")]
    result = reproduce.run_study("collapse", reproduce.parse_args([*argv, "--conditions", "no_filter", "coin_no_filter"]),
                                 runner=fake_runner)
    assert [r["name"] for r in result["runs"]] == ["countdown-no_filter-seed0", "countdown-coin_no_filter-seed0",
                                                   "countdown-no_filter-seed1", "countdown-coin_no_filter-seed1"]
    assert "--config.algorithm.train_reward=coin" in result["runs"][1]["args"]
    with pytest.raises(SystemExit, match="its conditions are"):
        reproduce.run_study("collapse", reproduce.parse_args([*argv, "--conditions", "coin"]), runner=fake_runner)


def test_a_task_replaces_every_studys_task():
    for study in ("filter", "top_p", "collapse", "gradients"):
        runs = reproduce.study_runs(study, [0], task="countdown")
        assert runs and {r.task for r in runs} == {"countdown"}
        assert reproduce.config_args(runs[0], quick=False, extra=[])[0] == "--config=configs/countdown.py"
    assert len(reproduce.study_runs("filter", None, task="countdown")) == 9
    with pytest.raises(SystemExit):
        reproduce.parse_args(["filter", "--task", "cartpole"])


def test_a_run_another_study_finished_with_the_same_flags_is_reused(tmp_path):
    calls = []

    def fake_runner(args, log):
        calls.append(args)
        run_dir = Path(next(a for a in args if a.startswith("--config.run_dir=")).split("=", 1)[1])
        _write_metrics(run_dir, [{"step": 0, "val/success": 0.25}, {"step": 2, "val/success": 0.5}])
        log.write_text(json.dumps({"run_dir": str(run_dir), "stop_reason": "completed", "wall_time_s": 3.0}, indent=2))

    common = ["--quick", "--task", "countdown", "--out-dir", str(tmp_path / "runs"),
              "--results-dir", str(tmp_path / "results")]
    reproduce.run_study("filter", reproduce.parse_args(["filter", *common]), runner=fake_runner)
    assert len(calls) == 3  # no_filter, top_p_linear, top_p_softmax
    sweep = reproduce.run_study("top_p", reproduce.parse_args(["top_p", *common]), runner=fake_runner)
    trained = [Path(a.split("=", 1)[1]).name for args in calls[3:] for a in args if a.startswith("--config.run_dir=")]
    assert sorted(trained) == ["countdown-p=0.6-seed0", "countdown-p=0.98-seed0"]
    by_condition = {r["condition"]: r for r in sweep["runs"]}
    assert by_condition["p=1.0"]["skipped"] and by_condition["p=1.0"]["run_dir"].endswith("filter/countdown-no_filter-seed0")
    assert by_condition["p=0.9"]["run_dir"].endswith("filter/countdown-top_p_softmax-seed0")
    assert [list(p) for p in by_condition["p=0.9"]["val_curve"]] == [[0, 0.25], [2, 0.5]]
    assert sweep["tasks"] == ["countdown"]
    predictors = reproduce.run_predictors(reproduce.parse_args(["predictors", *common, "--n-boot", "10"]))
    assert predictors["num_runs"] == 5 and predictors["num_points"] == 10  # the two reused runs count once


def test_the_gradient_probe_runs_once_per_checkpoint(tmp_path):
    calls = []

    def fake_runner(args, log):
        calls.append(args[0])
        run_dir = Path(next(a for a in args if a.startswith("--config.run_dir=")).split("=", 1)[1])
        if args[0] == "-m":  # the trainer: metrics, checkpoints 2 and 4, its summary
            _write_metrics(run_dir, [{"step": 0, "val/success": 0.0}, {"step": 4, "val/success": 0.5}])
            for step in (2, 4):
                (run_dir / "checkpoints" / str(step)).mkdir(parents=True)
            log.write_text(json.dumps({"run_dir": str(run_dir), "wall_time_s": 1.0}, indent=2) + "\n")
        else:  # reproduce_gradients.py
            out = Path(next(a for a in args if a.startswith("--out=")).split("=", 1)[1])
            out.write_text(json.dumps({"probes": [{"step": s, "grad_norm/bucket_1/task": 1.0} for s in (0, 2, 4)]}))

    a = reproduce.parse_args(["gradients", "--quick", "--out-dir", str(tmp_path / "runs"),
                              "--results-dir", str(tmp_path / "results")])
    first = reproduce.run_study("gradients", a, runner=fake_runner)
    assert calls == ["-m", "benchmarks/reproduce_gradients.py"]
    assert [p["step"] for p in first["runs"][0]["probes"]] == [0, 2, 4]
    reproduce.run_study("gradients", a, runner=fake_runner)
    assert len(calls) == 2  # nothing left to do
    (tmp_path / "runs" / "gradients" / first["runs"][0]["name"] / "checkpoints" / "6").mkdir()
    reproduce.run_study("gradients", a, runner=fake_runner)
    assert calls[2:] == ["benchmarks/reproduce_gradients.py"]  # a new checkpoint: probed again


# ---------------------------------------------------------------- for real, at the smoke size
@pytest.mark.slow  # minutes on 2 CPU cores: 3 tiny training runs, one gradient probe, the report
def test_all_quick_for_real(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    doc = tmp_path / "docs" / "reproduction.md"
    proc = subprocess.run([sys.executable, "benchmarks/reproduce.py", "all", "--quick", "--limit", "1",
                           "--out-dir", str(tmp_path / "runs"), "--results-dir", str(tmp_path / "results"),
                           "--doc", str(doc), "--n-boot", "50"],
                          # A guard against a hang, not a speed check: the quick studies took 6.7 minutes on a
                          # quiet 2-core machine with one more run, and more than 15 while other jobs shared it.
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for study in ("filter", "top_p", "collapse", "gradients", "predictors"):
        data = json.loads((tmp_path / "results" / f"reproduce_{study}.json").read_text())
        assert data["quick"]
    grads = json.loads((tmp_path / "results" / "reproduce_gradients.json").read_text())
    probes = grads["runs"][0]["probes"]
    assert [p["step"] for p in probes] == [0, 2, 4] and "grad_norm/all/task" in probes[0]
    pred = json.loads((tmp_path / "results" / "reproduce_predictors.json").read_text())
    # filter, collapse and gradients each train one run; top_p's first run (p=1.0) is filter's no_filter run
    assert pred["num_runs"] == 3 and pred["table"]
    text = doc.read_text()
    assert text.count("no verdict (quick smoke size)") >= 5
