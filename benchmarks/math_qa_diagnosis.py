"""Does a MathQA policy's success come from its reasoning? Success split by whether the worked steps are true.

For each run directory, the newest checkpoint (the warm start when the directory has none) samples
``--groups`` validation items x ``--group-size`` responses at ``--temperature``, ``--batches`` times with
different keys. Every ``a op b = c`` step in a response's reasoning is checked with integer arithmetic.

    .venv/bin/python benchmarks/math_qa_diagnosis.py runs/math_qa_ws runs/math_qa_seed0 [--set KEY=VALUE ...]

Per run directory it prints and writes to benchmarks/results/math_qa_diagnosis.json, as fractions of
all samples:
  success             the env's success flag
  steps_true          the response has worked steps and every one is arithmetically true
  success_steps_true  / success_steps_false: success with all steps true / with a false step (or none)
  consistent          the answer equals the result of the last worked step
  no_steps            the reasoning has no worked step (e.g. a warm start with sft.no_reasoning_fraction
                      answering without it); success_no_steps: such a response that succeeds
  with_unit           the answer is a number followed by a word ("17 stickers", the noisy demonstrations'
                      form, which the exact-match check counts as wrong)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ragen_jax import api  # noqa: E402
from train_step import apply_overrides  # noqa: E402

STEP = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")
WITH_UNIT = re.compile(r"^-?\d+ [A-Za-z]+$")
RESPONSE = re.compile(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.S)


def step_is_true(left: str, op: str, right: str, result: str) -> bool:
    a, b = int(left), int(right)
    value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b and a % b == 0 else None}[op]
    return value == int(result)


def diagnose(policy: api.Policy, batches: int) -> dict[str, float]:
    counts = dict(success=0, steps_true=0, success_steps_true=0, success_steps_false=0, consistent=0, no_steps=0,
                  success_no_steps=0, with_unit=0)
    n = 0
    for key in range(batches):
        traj = api.rollout(policy, key)
        for i in range(traj.num_rows):
            n += 1
            ok = bool(traj.success[i])
            counts["success"] += ok
            match = RESPONSE.search(traj.to_text(i, policy.run.tokenizer))
            steps = STEP.findall(match.group(1)) if match else []
            true = bool(steps) and all(step_is_true(*s) for s in steps)
            counts["steps_true"] += true
            counts["success_steps_true"] += ok and true
            counts["success_steps_false"] += ok and not true
            counts["consistent"] += bool(steps) and steps[-1][3] == match.group(2).strip()
            counts["no_steps"] += not steps
            counts["success_no_steps"] += ok and not steps
            counts["with_unit"] += bool(match and WITH_UNIT.match(match.group(2).strip()))
    return {"samples": n, **{k: v / n for k, v in counts.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+")
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.5)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides of the runs")
    p.add_argument("--result", default=str(ROOT / "benchmarks" / "results" / "math_qa_diagnosis.json"))
    args = p.parse_args()
    results = []
    for run_dir in args.run_dirs:
        config = api.load_config("math_qa", {"run_dir": run_dir, "rollout.n_groups": args.groups,
                                             "rollout.group_size": args.group_size,
                                             "rollout.temperature": args.temperature})
        apply_overrides(config, args.set)
        policy = api.load_policy(config)
        row = {"run_dir": run_dir, "step": policy.step, "overrides": args.set, "temperature": args.temperature,
               **diagnose(policy, args.batches)}
        print(json.dumps(row), flush=True)
        results.append(row)
    Path(args.result).write_text(json.dumps({"backend": jax.default_backend(), "runs": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
