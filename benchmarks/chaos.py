"""Chaos: SIGKILL one training run at random moments; every restart must resume, and the result must equal
an uninterrupted run's bit for bit.

    .venv/bin/python benchmarks/chaos.py                      # 20 kills, 8 steps, warm start included
    .venv/bin/python benchmarks/chaos.py --kills 3 --no-warm-start --work /tmp/chaos_short

The run is ``tests/configs/small.py:frozen_lake`` with ``trainer.total_steps`` steps and a checkpoint
after every step; with ``--warm-start`` (default) it starts from a tiny supervised warm start
(``init=sft``, a few SFT steps) that the first restarts build, so kills also land in the warm-start
build. The peer is the same command run once without interruption (its own warm-start cache).

Each kill picks a target phase at random: ``startup`` (a random moment after launch: imports, build,
compilation, restore), ``warm_start`` (while the warm start is not yet cached), ``step`` (a random moment
inside a training step, 0-2 steps after the resume) or ``checkpoint_write`` (the moment an orbax
temporary directory appears under ``checkpoints/``, i.e. mid-save). The phase actually hit is read from
the file system at the moment of the kill. After the kills, the same command runs to the end.

Checks: the final checkpoint's whole state (parameters, optimizer moments, MI EMA) and every metrics
row except wall-time ones (``time``, ``timing/``, ``throughput/``) equal the peer's exactly;
``metrics.jsonl`` holds exactly one row per step (read raw); every restart after a checkpoint printed
"resuming from checkpoint step". Resumable: the state lives in ``<work>/chaos_state.json``; re-running
the same command continues where it stopped. Writes ``benchmarks/results/chaos.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = os.path.join(ROOT, "tests", "configs", "small.py")
WALL_KEYS = ("timing/", "throughput/")
PHASES = ("startup", "warm_start", "step", "checkpoint_write")


def command(run_dir: str, cache_dir: str, steps: int, warm_start: bool) -> list[str]:
    cmd = [sys.executable, "-m", "ragen_jax.main", f"--config={SMALL}:frozen_lake", f"--config.run_dir={run_dir}",
           f"--config.trainer.total_steps={steps}", "--config.trainer.checkpoint_every=1",
           "--config.trainer.progress=True"]
    if warm_start:
        # the demonstrations answer in up to ~85 tokens, more than small.py's 16 per turn
        cmd += ["--config.init=sft", "--config.rollout.max_new_tokens=96", "--config.sft.steps=4",
                "--config.sft.demos=32", "--config.sft.batch_size=8", "--config.sft.val_episodes=0",
                f"--config.sft.cache_dir={cache_dir}"]
    return cmd


def environment() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(ROOT, ".jax_cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    return env


def checkpoint_steps(run_dir: str) -> list[int]:
    d = os.path.join(run_dir, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def temporaries(run_dir: str) -> set[str]:
    """Orbax's temporary directories under checkpoints/ (a save in progress)."""
    d = os.path.join(run_dir, "checkpoints")
    return {n for n in os.listdir(d) if "tmp" in n} if os.path.isdir(d) else set()


def saving(run_dir: str, old: set[str] = frozenset()) -> bool:
    return bool(temporaries(run_dir) - old)


def warm_start_done(cache_dir: str) -> bool:
    if not os.path.isdir(cache_dir):
        return False
    return any(os.path.exists(os.path.join(cache_dir, n, "COMPLETE")) for n in os.listdir(cache_dir))


def observed_phase(run_dir: str, cache_dir: str, warm: bool, old: set[str]) -> str:
    if saving(run_dir, old):
        return "checkpoint_write"
    if warm and not warm_start_done(cache_dir):
        return "warm_start"
    if not os.path.exists(os.path.join(run_dir, "config.json")):
        return "startup"
    return "step"


def refine_phase(phase: str, log_text: str) -> str:
    """"step" before the process printed its resume line or a progress line is still start-up (imports,
    build, compilation, restore): the file system alone cannot tell them apart once config.json exists."""
    started = "resuming from checkpoint step" in log_text or re.search(r"^step \d+/\d+ \|", log_text, re.M)
    return "startup" if phase == "step" and not started else phase


def wait_for(pred, proc, timeout: float, poll: float = 0.002) -> bool:
    """Poll ``pred`` until true (True) or the process ends / the timeout passes (False)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(poll)
    return False


def one_kill(cmd, env, run_dir, cache_dir, warm, steps, rng, log_path) -> dict:
    """Start the run, SIGKILL it at a moment chosen by a random target phase; returns what happened."""
    before = checkpoint_steps(run_dir)
    resumed_from = before[-1] if before else None
    targets = ["startup", "step", "checkpoint_write"]
    if warm and not warm_start_done(cache_dir):
        targets += ["warm_start"] * 2
    target = rng.choice(targets)
    if target in ("step", "checkpoint_write") and resumed_from is not None and resumed_from >= steps - 1:
        target = "startup"  # the next save is the run's last: the final run is the one that finishes
    with open(log_path, "w") as log:
        t0 = time.time()
        old = temporaries(run_dir)  # left by an earlier kill until orbax cleans them up
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        if target == "startup":
            at = rng.uniform(1.0, 20.0)
            ok = wait_for(lambda: time.time() - t0 > at, proc, 600, poll=0.05)
        elif target == "warm_start":
            at = rng.uniform(5.0, 40.0)
            ok = wait_for(lambda: time.time() - t0 > at or warm_start_done(cache_dir), proc, 600, poll=0.05)
        elif target == "step":
            # a random moment 0-2 steps past the resume, read from the progress lines of this process
            # ("step N/T | ..."), never reaching the last step: the final run finishes the run
            last_done = resumed_from or 0
            ahead = rng.randint(0, min(2, max(steps - last_done - 2, 0)))
            line = re.compile(rf"^step {last_done + 1 + ahead}/", re.M)

            def reached():
                with open(log_path) as f:
                    return bool(line.search(f.read()))

            ok = wait_for(reached, proc, 900, poll=0.05)
            if ok:
                time.sleep(rng.uniform(0.0, 2.0))
        else:  # checkpoint_write: the first save of this process, caught while its temporary directory exists
            ok = wait_for(lambda: saving(run_dir, old), proc, 900, poll=0.001)  # kill at once: a save takes ms
        phase = observed_phase(run_dir, cache_dir, warm, old)
        killed = proc.poll() is None
        if killed:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        elapsed = time.time() - t0
    with open(log_path) as f:
        out = f.read()
    phase = refine_phase(phase, out)
    return {"target": target, "phase": phase if killed else "finished", "killed": killed, "seconds": round(elapsed, 2),
            "resumed_from": resumed_from, "said_resuming": "resuming from checkpoint step" in out,
            "checkpoints_after": checkpoint_steps(run_dir), "exit": proc.returncode}


def run_to_end(cmd, env, log_path) -> tuple[int, float, str]:
    t0 = time.time()
    with open(log_path, "w") as log:
        rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    with open(log_path) as f:
        return rc, time.time() - t0, f.read()


def compare(run_a: str, run_b: str, steps: int, warm: bool, cache_a: str) -> dict:
    """Exact equality of the final checkpoints' state and of the deterministic metrics."""
    import jax
    import numpy as np

    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "configs")]
    from small import get_config

    from ragen_jax.train.checkpoint import Checkpointer
    from ragen_jax.train.loop import build_run

    config = get_config("frozen_lake")
    config.trainer.total_steps = steps
    config.init = "random"  # the template's shapes only; the values come from the checkpoints
    _, state = build_run(config)
    trees = []
    for run_dir in (run_a, run_b):
        ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"))
        tree, _, step = ckpt.restore(state.tree())
        ckpt.close()
        trees.append((tree, step))
    leaves_a, leaves_b = (jax.tree.leaves(t) for t, _ in trees)
    params_equal = trees[0][1] == trees[1][1] == steps and all(
        np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(leaves_a, leaves_b))

    def rows(run_dir):
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            raw = [json.loads(line) for line in f]
        return [{k: v for k, v in r.items() if k != "time" and not k.startswith(WALL_KEYS)} for r in raw]

    rows_a, rows_b = rows(run_a), rows(run_b)
    differing = sorted({k for ra, rb in zip(rows_a, rows_b) for k in set(ra) | set(rb) if ra.get(k) != rb.get(k)})
    return {"final_step": trees[1][1], "state_equal": bool(params_equal), "state_leaves": len(leaves_a),
            "metrics_equal": rows_a == rows_b, "metrics_differing_keys": differing[:10],
            "rows_one_per_step": [r["step"] for r in rows_b] == list(range(steps + 1)),
            "reference_rows_one_per_step": [r["step"] for r in rows_a] == list(range(steps + 1))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="/tmp/ragen_chaos")
    p.add_argument("--no-warm-start", dest="warm", action="store_false")
    p.add_argument("--fresh", action="store_true", help="delete the work directory first")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "chaos.json"))
    args = p.parse_args(argv)
    if args.fresh:
        shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work, exist_ok=True)
    state_file = os.path.join(args.work, "chaos_state.json")
    state = {"kills": [], "reference": None, "chaos_started": None}
    if os.path.exists(state_file):
        with open(state_file) as f:
            state = json.load(f)

    def persist():
        with open(state_file + ".tmp", "w") as f:
            json.dump(state, f, indent=2)
        os.replace(state_file + ".tmp", state_file)

    env = environment()
    ref_dir, ref_cache = os.path.join(args.work, "reference"), os.path.join(args.work, "reference_warm")
    run_dir, cache_dir = os.path.join(args.work, "chaos"), os.path.join(args.work, "chaos_warm")
    if state["reference"] is None:
        shutil.rmtree(ref_dir, ignore_errors=True)
        shutil.rmtree(ref_cache, ignore_errors=True)
        rc, wall, out = run_to_end(command(ref_dir, ref_cache, args.steps, args.warm), env,
                                   os.path.join(args.work, "reference.log"))
        if rc != 0:
            print(out[-3000:], file=sys.stderr)
            return 1
        state["reference"] = {"wall_s": round(wall, 1)}
        persist()
        print(f"reference: {args.steps} steps uninterrupted in {wall:.0f}s", flush=True)

    rng = random.Random(args.seed * 1000 + len(state["kills"]))
    cmd = command(run_dir, cache_dir, args.steps, args.warm)
    if state["chaos_started"] is None:
        state["chaos_started"] = time.time()
    attempts = 0
    while sum(k["killed"] for k in state["kills"]) < args.kills and attempts < 4 * args.kills:
        attempts += 1
        if checkpoint_steps(run_dir)[-1:] == [args.steps]:
            break  # the run finished before all kills: stop killing (reported)
        rec = one_kill(cmd, env, run_dir, cache_dir, args.warm, args.steps, rng,
                       os.path.join(args.work, f"restart_{len(state['kills']):02d}.log"))
        state["kills"].append(rec)
        persist()
        print(f"kill {sum(k['killed'] for k in state['kills']):2d}: target {rec['target']:16s} hit {rec['phase']:16s} "
              f"after {rec['seconds']:6.1f}s; resumed from {rec['resumed_from']}, checkpoints now "
              f"{rec['checkpoints_after']}", flush=True)

    rc, wall, out = run_to_end(cmd, env, os.path.join(args.work, "final.log"))
    if rc == 0 and "chaos_wall_s" not in state:  # a re-run after the end only re-checks
        state["chaos_wall_s"] = time.time() - state["chaos_started"]
        persist()
    chaos_wall = state.get("chaos_wall_s", time.time() - state["chaos_started"])
    result = compare(ref_dir, run_dir, args.steps, args.warm, ref_cache)
    for i, k in enumerate(state["kills"]):  # records of an earlier version of this script
        log = os.path.join(args.work, f"restart_{i:02d}.log")
        if k["killed"] and os.path.exists(log):
            with open(log) as f:
                k["phase"] = refine_phase(k["phase"], f.read())
    kills = [k for k in state["kills"] if k["killed"]]
    # restarts that got past start-up (a kill during imports or compilation precedes the resume line)
    restarts_after_checkpoint = [k for k in state["kills"]
                                 if k["resumed_from"] is not None and k["phase"] in ("step", "checkpoint_write")]
    phases = {ph: sum(k["phase"] == ph for k in kills) for ph in PHASES}
    summary = {
        "config": f"tests/configs/small.py:frozen_lake, {args.steps} steps, checkpoint every step"
                  + (", init=sft (4 SFT steps)" if args.warm else ""),
        "kills": len(kills), "kills_by_phase": phases, "restarts": len(state["kills"]) + 1,
        "every_restart_resumed": all(k["said_resuming"] for k in restarts_after_checkpoint)
                                 and ("resuming from checkpoint step" in out or not checkpoint_steps(run_dir)),
        "final_exit": rc, **result,
        "chaos_wall_s": round(chaos_wall, 1), "reference_wall_s": state["reference"]["wall_s"],
        "wall_ratio": round(chaos_wall / state["reference"]["wall_s"], 2),
        "kill_log": state["kills"],
    }
    print()
    print("| phase | kills |")
    print("|---|---|")
    for ph in PHASES:
        print(f"| {ph} | {phases[ph]} |")
    print()
    print("| check | result |")
    print("|---|---|")
    for key in ("kills", "restarts", "every_restart_resumed", "final_exit", "state_equal", "metrics_equal",
                "rows_one_per_step", "chaos_wall_s", "reference_wall_s", "wall_ratio"):
        print(f"| {key} | {summary[key]} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)
    ok = rc == 0 and result["state_equal"] and result["metrics_equal"] and result["rows_one_per_step"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
