"""RAGEN-2's claims at small scale, one resumable command per study (GitHub issue 19).

    python benchmarks/reproduce.py STUDY [--quick] [--seeds 0 1 2] [--task countdown] [--out-dir runs/reproduce]
                                         [--set KEY=VALUE ...]
    python benchmarks/reproduce.py report          # docs/reproduction.md from benchmarks/results/reproduce_*.json

STUDY (RAGEN-2, arXiv 2604.06268):
  filter      top-p 0.9 linear vs softmax vs no filter (filter.value=1.0) on sokoban, frozen_lake and slippery
              frozen_lake (env.params.success_rate=0.8, 20 % slip; fig6), 3 seeds (main table, fig8)
  top_p       filter.value in {1.0, 0.98, 0.9, 0.6} (softmax mode, as the paper's sweep) on sokoban, 2 seeds (fig9);
              p=1.0 and p=0.9 reuse the filter study's no_filter and top_p_softmax runs when it ran them
  predictors  Spearman / Pearson (bootstrap 95 % CI) of each MI- and entropy-family metric with validation
              success over every (run, validation step) of the other studies (fig10); runs nothing
  collapse    a strong entropy bonus (algorithm.entropy_coeff=0.01, ten times the paper's collapsing 0.003;
              it rewards diversity whatever the input) with no filter vs top-p 0.9 linear, sokoban, 2 seeds (fig7);
              and the same two with a reward that ignores the input (algorithm.train_reward=coin, a fair coin
              per episode: coin_no_filter, coin_top_p_linear), the induced collapse
  gradients   a sokoban run with every checkpoint kept, then benchmarks/reproduce_gradients.py: task / entropy /
              KL gradient norms by reward-std bucket at each checkpoint (fig12)
  all         the four training studies, then predictors and the report

Each run is ``python -m ragen_jax.main --config=<task config> --config.<override>... --config.seed=S`` in
``<out-dir>/<study>/<run name>``, one after the other; a run whose log ends with the trainer's summary is
skipped, and one that was cut off resumes from its checkpoint when the command is run again. After every
run ``<results-dir>/reproduce_<study>.json`` gets the settings, seeds, wall times, validation curves,
the (validation, predictor) points and the MI / entropy curves of the runs so far.

``--task countdown`` runs every study on Countdown instead (its CPU default is the one that RL improves,
README "Learning", and a run takes about 6 minutes on 2 cores); each study's JSON records its tasks and holds
the runs of its last invocation. A run with the same flags as a finished run of another study (the top-p
sweep's p=1.0 and p=0.9) is not trained twice: its ``<name>.args.json`` next to the log says what it ran.

``--conditions A B``: only those conditions of the study (its JSON then holds those runs).

``--quick``: tests/configs/small.py's tiny model and batches, 4 steps, 1 seed: a smoke test of the
tooling (minutes for ``all``); its numbers are no reproduction, and it keeps its runs, results and report
under runs/reproduce_quick/ (``report --quick`` renders those). ``--limit N`` keeps the first N runs of
each study (smoke tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import reproduce_analysis as A  # noqa: E402
from learning import finished_summary  # noqa: E402

TRAIN_STUDIES = ("filter", "top_p", "collapse", "gradients")
STUDIES = (*TRAIN_STUDIES, "predictors", "all", "report")
NO_FILTER = ("filter.value=1.0",)
TOP_P_LINEAR = ("filter.value=0.9", "filter.top_p_mode=linear")
TOP_P_SOFTMAX = ("filter.value=0.9", "filter.top_p_mode=softmax")
TASKS = {  # task label -> (config task name, overrides)
    "sokoban": ("sokoban", ()),
    "frozen_lake": ("frozen_lake", ()),
    "frozen_lake_slippery": ("frozen_lake", ("env.params.success_rate=0.8",)),
    # The studies validate Countdown every 10 steps on 256 episodes (the default: every 20 on 512), which gives
    # the predictor study twice as many (validation, metric) points for the same validation cost.
    "countdown": ("countdown", ("validation.every=10", "validation.episodes=256")),
}
# tests/configs/small.py's model and batches, a few steps: every code path of a study in seconds per run.
QUICK = ("trainer.total_steps=4", "validation.every=2", "validation.episodes=2", "mi.every=2",
         "trainer.checkpoint_every=2")
GRADIENT_CHECKPOINTS = ("trainer.checkpoint_every=10", "trainer.keep_checkpoints=1000")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run of a study: ``task`` (a TASKS label), ``condition`` (what the study varies), the
    ``overrides`` of both (``KEY=VALUE`` for ``--config.KEY=VALUE``) and the seed."""

    study: str
    task: str
    condition: str
    overrides: tuple[str, ...]
    seed: int

    @property
    def name(self) -> str:
        return f"{self.task}-{self.condition}-seed{self.seed}"


def study_runs(study: str, seeds: list[int] | None, task: str | None = None) -> list[RunSpec]:
    """The study's runs in execution order (seeds innermost last, so an early stop leaves whole conditions);
    ``task`` (a TASKS label) replaces the study's own task or tasks."""
    def grid(study, tasks, conditions, default_seeds):
        return [RunSpec(study, t, cond, (*TASKS[t][1], *over), seed)
                for seed in (seeds or default_seeds) for t in ((task,) if task else tasks)
                for cond, over in conditions.items()]

    if study == "filter":
        return grid("filter", ("sokoban", "frozen_lake", "frozen_lake_slippery"),
                    {"no_filter": NO_FILTER, "top_p_linear": TOP_P_LINEAR, "top_p_softmax": TOP_P_SOFTMAX}, [0, 1, 2])
    if study == "top_p":
        # p=1.0 and p=0.9 are the filter study's no_filter and top_p_softmax runs, flag for flag, so a
        # run that study finished is reused (``find_finished``).
        sweep = {"p=1.0": NO_FILTER, "p=0.98": ("filter.value=0.98", "filter.top_p_mode=softmax"),
                 "p=0.9": TOP_P_SOFTMAX, "p=0.6": ("filter.value=0.6", "filter.top_p_mode=softmax")}
        return grid("top_p", ("sokoban",), sweep, [0, 1])
    if study == "collapse":
        strong_entropy = ("algorithm.entropy_coeff=0.01",)
        coin = ("algorithm.train_reward=coin",)
        return grid("collapse", ("sokoban",), {"no_filter": (*strong_entropy, *NO_FILTER),
                                              "top_p_linear": (*strong_entropy, *TOP_P_LINEAR),
                                              "coin_no_filter": (*strong_entropy, *coin, *NO_FILTER),
                                              "coin_top_p_linear": (*strong_entropy, *coin, *TOP_P_LINEAR)}, [0, 1])
    if study == "gradients":
        return grid("gradients", ("sokoban",), {"no_filter": (*NO_FILTER, *GRADIENT_CHECKPOINTS)}, [0])
    raise ValueError(f"study {study!r} has no runs")


def config_args(spec: RunSpec, quick: bool, extra: list[str]) -> list[str]:
    """The ``ragen_jax.main`` flags of a run (without run_dir)."""
    task = TASKS[spec.task][0]
    config = f"tests/configs/small.py:{task}" if quick else f"configs/{task}.py"
    overrides = [*spec.overrides, *(QUICK if quick else ()), *extra, f"seed={spec.seed}", "trainer.progress=False"]
    return [f"--config={config}", *(f"--config.{kv}" for kv in overrides)]


def run_command(args: list[str], log: Path) -> float:
    """Run ``python <args>`` from the repository root, output to log; returns wall seconds; raises with
    the log's tail on failure."""
    start = time.time()
    with open(log, "a") as f:
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                              env=dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu")))
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed (exit {proc.returncode}); log {log}:\n"
                           + log.read_text(errors="replace")[-3000:])
    return time.time() - start


def mi_every(run_dir: Path, default: int = 5) -> int:
    """The run's ``mi.every`` (its config.json): how far a validation step may be from its MI metrics."""
    path = run_dir / "config.json"
    if not path.exists():
        return default
    return int(json.loads(path.read_text()).get("mi", {}).get("every", default))


def probes_complete(probes: Path, checkpoints: Path) -> bool:
    """Whether the probe file holds step 0 and every checkpoint step (a finished probe is not rebuilt)."""
    if not probes.exists():
        return False
    done = {p["step"] for p in json.loads(probes.read_text())["probes"]}
    saved = {int(d.name) for d in checkpoints.iterdir() if d.name.isdigit()} if checkpoints.exists() else set()
    return {0} | saved <= done


def find_finished(args: list[str], out_dir: Path) -> tuple[Path, Path] | None:
    """(run_dir, log) of a finished run of any study under ``out_dir`` trained with exactly ``args``."""
    for flags in sorted(out_dir.glob("*/*.args.json")):
        name = flags.name.removesuffix(".args.json")
        log = flags.with_name(f"{name}.log")
        if json.loads(flags.read_text()) == args and finished_summary(log) is not None:
            return flags.with_name(name), log
    return None


def execute(spec: RunSpec, out_dir: Path, quick: bool, extra: list[str], runner=run_command) -> dict:
    """Train one run (skipped when its log, or the log of another study's run with the same flags, holds
    the trainer's summary) and return its record."""
    run_dir, log = out_dir / spec.study / spec.name, out_dir / spec.study / f"{spec.name}.log"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    args = config_args(spec, quick, extra)
    summary = finished_summary(log)
    if summary is None and (found := find_finished(args, out_dir)):
        run_dir, log = found
        summary = finished_summary(log)
    skipped = summary is not None
    if not skipped:
        (out_dir / spec.study / f"{spec.name}.args.json").write_text(json.dumps(args))
        runner(["-m", "ragen_jax.main", *args, f"--config.run_dir={run_dir}"], log)
        summary = finished_summary(log)
        if summary is None:
            raise RuntimeError(f"{spec.name}: the trainer exited without its summary; see {log}")
    from ragen_jax.train.metrics import read_metrics

    record = {**dataclasses.asdict(spec), "name": spec.name, "args": args, "run_dir": str(run_dir),
              "wall_s": summary.get("wall_time_s"), "stop_reason": summary.get("stop_reason"), "skipped": skipped,
              **A.run_record(read_metrics(str(run_dir)), max_gap=mi_every(run_dir))}
    if spec.study == "gradients":
        probes = run_dir / "gradient_probes.json"
        if not probes_complete(probes, run_dir / "checkpoints"):
            runner(["benchmarks/reproduce_gradients.py", *args, f"--config.run_dir={run_dir}", f"--out={probes}",
                    f"--rounds={2 if quick else 4}"], out_dir / spec.study / f"{spec.name}.probe.log")
        record["probes"] = json.loads(probes.read_text())["probes"]
    return record


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def run_study(study: str, a, runner=run_command) -> dict:
    """Run (or resume) a training study, writing its results JSON after every run."""
    specs = study_runs(study, a.seeds or ([0] if a.quick else None), a.task)
    if a.conditions:
        known = sorted({s.condition for s in specs})
        unknown = sorted(set(a.conditions) - set(known))
        if unknown:
            raise SystemExit(f"{study} has no condition(s) {unknown}; its conditions are {known}")
        specs = [s for s in specs if s.condition in a.conditions]
    specs = specs[: a.limit]
    out_dir = Path(a.out_dir).resolve()
    result = {"study": study, "quick": a.quick, "command": " ".join(["python benchmarks/reproduce.py", *sys.argv[1:]]),
              "platform": platform.platform(), "cpu_count": os.cpu_count(), "extra_overrides": a.set,
              "tasks": sorted({s.task for s in specs}), "seeds": sorted({s.seed for s in specs}), "runs": []}
    path = Path(a.results_dir) / f"reproduce_{study}.json"
    for i, spec in enumerate(specs, 1):
        print(f"[{study} {i}/{len(specs)}] {spec.name} ...", flush=True)
        record = execute(spec, out_dir, a.quick, a.set, runner)
        result["runs"].append(record)
        write_json(path, result)
        curve = " ".join(f"{s}:{v:.2f}" for s, v in record["val_curve"])
        print(f"[{study} {i}/{len(specs)}] {spec.name}: {'(done before) ' if record['skipped'] else ''}"
              f"val success {curve} ({record['wall_s'] or 0:.0f}s, {record['stop_reason']})", flush=True)
    return result


def run_predictors(a) -> dict:
    """Correlations over every (run, validation) point of the training studies' results found; a run that
    several studies share (the top-p sweep reuses the filter study's) counts once."""
    points, sources, quick, seen = [], [], False, set()
    for study in TRAIN_STUDIES:
        path = Path(a.results_dir) / f"reproduce_{study}.json"
        if path.exists():
            data = json.loads(path.read_text())
            sources.append(study)
            quick |= data["quick"]
            for run in data["runs"]:
                if run["run_dir"] in seen:
                    continue
                seen.add(run["run_dir"])
                points += [{**p, "run": run["name"], "study": study} for p in run["points"]]
    keys = sorted({k for p in points for k, v in p.items() if v is not None and A.family_of(k)})
    table = A.correlation_table(points, keys, n_boot=a.n_boot, seed=0)
    result = {"study": "predictors", "quick": quick, "command": "python benchmarks/reproduce.py predictors", "sources": sources, "num_points": len(points),
              "num_runs": len({(p["study"], p["run"]) for p in points}), "n_boot": a.n_boot, "table": table}
    write_json(Path(a.results_dir) / "reproduce_predictors.json", result)
    for t in sorted(table, key=lambda t: -t["spearman"] if t["spearman"] == t["spearman"] else 9):
        print(f"{t['family']:8s} {t['metric']:60s} n={t['n']:4d} spearman {t['spearman']:+.2f} "
              f"[{t['spearman_ci'][0]:+.2f}, {t['spearman_ci'][1]:+.2f}]", flush=True)
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("study", choices=STUDIES)
    p.add_argument("--quick", action="store_true", help="tiny model, 4 steps, 1 seed: a smoke test, not a reproduction")
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="replace every study's seeds")
    p.add_argument("--limit", type=int, default=None, help="run only the first N runs of each study")
    p.add_argument("--conditions", nargs="+", default=None, metavar="NAME",
                   help="run only these conditions of the study (e.g. collapse: no_filter coin_no_filter)")
    p.add_argument("--task", choices=sorted(TASKS), default=None,
                   help="run every study on this task instead of its own (countdown: the CPU default RL improves)")
    # --quick has its own defaults: a finished quick run must never be skipped as a finished full one,
    # nor its numbers overwrite the full results or the committed report.
    p.add_argument("--out-dir", default=None, help="runs/reproduce (--quick: runs/reproduce_quick)")
    p.add_argument("--results-dir", default=None,
                   help="benchmarks/results (--quick: runs/reproduce_quick/results)")
    p.add_argument("--doc", default=None,
                   help="the report of report and all: docs/reproduction.md (--quick: runs/reproduce_quick/reproduction.md)")
    p.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples of the correlations")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra overrides for every run")
    a = p.parse_args(argv)
    quick_dir = ROOT / "runs" / "reproduce_quick"
    a.out_dir = a.out_dir or str(quick_dir if a.quick else ROOT / "runs" / "reproduce")
    a.results_dir = a.results_dir or str(quick_dir / "results" if a.quick else ROOT / "benchmarks" / "results")
    a.doc = a.doc or str(quick_dir / "reproduction.md" if a.quick else ROOT / "docs" / "reproduction.md")
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.study in TRAIN_STUDIES:
        run_study(a.study, a)
    elif a.study == "predictors":
        run_predictors(a)
    if a.study == "all":
        for study in TRAIN_STUDIES:
            run_study(study, a)
        run_predictors(a)
    if a.study in ("all", "report"):
        from reproduce_report import write_report

        print(write_report(Path(a.results_dir), Path(a.doc)), flush=True)


if __name__ == "__main__":
    main()
