"""Learning on the CPU default: validation success after the supervised warm start and after RL.

For each task config (``configs/<env>.py``, the tiny preset with ``init=sft``):
  1. ``python -m ragen_jax.main --config=configs/<env>.py --config.mode=sft`` builds (or finds in
     ``sft.cache_dir``) the warm start; its build time is read from its ``sft_metrics.json``;
  2. for every seed, ``python -m ragen_jax.main --config=configs/<env>.py --config.seed=S`` trains with
     the config's defaults. The trainer validates before the first step (= the warm start, sampled
     with this seed) and every ``validation.every`` steps; the last validation is "after RL".
Each run is a separate process, one after the other (the machine has 2 cores); a run whose log in
``--out-dir`` already ends with the trainer's summary is not run again (an interrupted benchmark
resumes; its wall time is the trainer's ``wall_time_s``: warm-start load, validations and steps,
without the Python start-up and the config print). Prints a markdown
table (mean +- standard deviation over seeds, paired difference) and writes
benchmarks/results/learning.json.

    .venv/bin/python benchmarks/learning.py                                  # 3 envs x 3 seeds
    .venv/bin/python benchmarks/learning.py --envs frozen_lake --seeds 0 --set trainer.total_steps=10
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], log: Path) -> float:
    """Run the CLI with args, output to log; returns wall seconds; raises with the log tail on failure."""
    start = time.time()
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "ragen_jax.main", *args], cwd=ROOT, stdout=f,
                              stderr=subprocess.STDOUT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed (exit {proc.returncode}); log {log}:\n"
                           + log.read_text()[-3000:])
    return time.time() - start


def finished_summary(log: Path) -> dict | None:
    """The summary JSON a finished ``ragen_jax.main`` train run prints last, or None (not run or cut off):
    finished runs are kept, so an interrupted benchmark resumes where it stopped."""
    if not log.exists():
        return None
    text = log.read_text()
    start = text.rfind('{\n  "run_dir"')
    if start < 0:
        return None
    try:
        return json.loads(text[start:])
    except json.JSONDecodeError:
        return None


def _validations(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if "val/success" in r]


def _summary(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values) if len(values) > 1 else 0.0,
            "values": values}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--envs", nargs="+", default=["frozen_lake", "sokoban", "countdown"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="extra --config.KEY=VALUE overrides for every run (e.g. trainer.total_steps=10)")
    p.add_argument("--at-step", type=int, default=None,
                   help="read 'after RL' at this step's validation instead of the last one (runs that went on "
                        "longer, e.g. one seed of 40 steps in a table of 30)")
    p.add_argument("--out-dir", default="runs/learning")
    p.add_argument("--result", default=str(ROOT / "benchmarks" / "results" / "learning.json"))
    a = p.parse_args()
    out_dir = (ROOT / a.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    extra = [f"--config.{kv}" for kv in a.set]
    result = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "load_avg_start": os.getloadavg()[0],
              "overrides": a.set, "envs": {}}
    for env in a.envs:
        config = [f"--config=configs/{env}.py", *extra]
        sft_dir = out_dir / f"{env}-sft"
        sft_dir.mkdir(exist_ok=True)
        sft_wall = _run([*config, "--config.mode=sft", f"--config.run_dir={sft_dir}"], sft_dir / "log.txt")
        printed = (sft_dir / "log.txt").read_text()
        warm = json.loads(printed[printed.index('{\n  "warm_start"'):])
        sft_build_s = warm.get("demo_seconds", 0.0) + warm.get("train_seconds", 0.0) + warm.get("validation_seconds", 0.0)
        runs = []
        for seed in a.seeds:
            run_dir, log = out_dir / f"{env}-seed{seed}", out_dir / f"{env}-seed{seed}.log"
            finished = finished_summary(log)
            if finished is None:
                _run([*config, f"--config.seed={seed}", f"--config.run_dir={run_dir}",
                      "--config.trainer.progress=False"], log)
                finished = finished_summary(log)
            wall = finished["wall_time_s"]
            vals = _validations(run_dir)
            first, last = vals[0], vals[-1]
            if a.at_step is not None:
                at = [v for v in vals if v["step"] == a.at_step]
                if not at:
                    raise SystemExit(f"{run_dir} has no validation at step {a.at_step}: "
                                     f"{[v['step'] for v in vals]}")
                last = at[0]
            runs.append({"seed": seed, "wall_s": wall, "warm_start_success": first["val/success"],
                         "after_rl_success": last["val/success"], "after_rl_step": last["step"],
                         "val_episodes": last.get("val/num_episodes"),
                         "warm_start_valid_action_rate": first.get("val/valid_action_rate"),
                         "after_rl_valid_action_rate": last.get("val/valid_action_rate"),
                         "val_success_curve": [(v["step"], v["val/success"]) for v in vals]})
            print(f"{env} seed {seed}: warm start {first['val/success']:.3f} -> after RL (step {last['step']}) "
                  f"{last['val/success']:.3f}  ({wall:.0f}s)", flush=True)
        result["envs"][env] = {
            "overrides": a.set,
            "warm_start": {"path": warm["warm_start"], "build_s": sft_build_s, "cli_wall_s": sft_wall,
                           "sft_validation": warm.get("validation"), "demos": warm.get("demos")},
            "runs": runs,
            "warm_start_success": _summary([r["warm_start_success"] for r in runs]),
            "after_rl_success": _summary([r["after_rl_success"] for r in runs]),
            "improvement": _summary([r["after_rl_success"] - r["warm_start_success"] for r in runs]),
            "rl_wall_s": _summary([r["wall_s"] for r in runs]),
        }
        Path(a.result).write_text(json.dumps(result, indent=2) + "\n")
    result["load_avg_end"] = os.getloadavg()[0]
    Path(a.result).write_text(json.dumps(result, indent=2) + "\n")
    episodes = sorted({int(r["runs"][0]["val_episodes"]) for r in result["envs"].values()})
    print(f"\n{len(a.seeds)} seeds; validation success on {episodes} held-out episodes "
          f"(load average {result['load_avg_start']:.1f} -> {result['load_avg_end']:.1f})")
    print("| task | warm start | after RL | RL - warm start | warm start build | RL run (each) |")
    print("|---|---|---|---|---|---|")
    for env, r in result["envs"].items():
        f = lambda s: f"{s['mean']:.3f} +- {s['std']:.3f}"  # noqa: E731
        print(f"| {env} | {f(r['warm_start_success'])} | {f(r['after_rl_success'])} | {f(r['improvement'])} | "
              f"{r['warm_start']['build_s'] / 60:.1f} min | {r['rl_wall_s']['mean'] / 60:.1f} min |")


if __name__ == "__main__":
    main()
