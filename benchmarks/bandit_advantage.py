"""Which arm do group-relative advantages favour on RAGEN's bandit? (expected advantage per arm)

RAGEN's bandit pays the safe arm 0.1 and the risky arm 1.0 with probability 0.25 (expected 0.25), so
an unbiased policy gradient moves toward the risky arm. For a group of S samples that each pick the
risky arm with probability p, this estimates E[A | risky] and E[A | safe] under the library's own
estimators (``ragen_jax.rl.advantages``): GRPO (A = (r - mean) / (std + eps)), Dr.GRPO (A = r - mean)
and RLOO (leave-one-out mean). A positive gap E[A | risky] - E[A | safe] pushes toward the risky arm.

GRPO's division by the group's std weighs most heavily the groups where no risky sample won (small
std, all risky samples at 0 < 0.1), so its gap is negative at every p: GRPO moves the policy toward the
*safe* arm, which is why RAGEN's bandit check needs an unnormalised estimator (Dr.GRPO, RLOO or GAE).

    .venv/bin/python benchmarks/bandit_advantage.py [--groups 200000] [--group-size 8]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ragen_jax.rl.advantages import grpo_advantages, rloo_advantages

ESTIMATORS = {
    "grpo": lambda r: grpo_advantages(r, norm_by_std=True),
    "drgrpo": lambda r: grpo_advantages(r, norm_by_std=False),
    "rloo": rloo_advantages,
}


def arm_advantages(p_risky: float, groups: int, group_size: int, seed: int = 0) -> dict[str, dict[str, float]]:
    """{estimator: {"risky": E[A | risky], "safe": E[A | safe], "gap": risky - safe}} by Monte Carlo."""
    k_arm, k_win = jax.random.split(jax.random.key(seed))
    risky = jax.random.bernoulli(k_arm, p_risky, (groups, group_size))
    won = jax.random.bernoulli(k_win, 0.25, (groups, group_size))
    rewards = jnp.where(risky, won.astype(jnp.float32), 0.1)
    out = {}
    for name, estimator in ESTIMATORS.items():
        adv = np.asarray(estimator(rewards))
        r = np.asarray(risky)
        a_risky, a_safe = float(adv[r].mean()), float(adv[~r].mean())
        out[name] = {"risky": a_risky, "safe": a_safe, "gap": a_risky - a_safe}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=200_000)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--result", default=str(Path(__file__).parent / "results" / "bandit_advantage.json"))
    args = p.parse_args()
    table = {}
    print(f"| P(risky) | {' | '.join(f'{e} gap' for e in ESTIMATORS)} |")
    print(f"|---|{'---|' * len(ESTIMATORS)}")
    for p_risky in (0.3, 0.5, 0.7, 0.9):
        row = arm_advantages(p_risky, args.groups, args.group_size)
        table[str(p_risky)] = row
        gaps = " | ".join(f"{row[e]['gap']:+.3f}" for e in ESTIMATORS)
        print(f"| {p_risky} | {gaps} |")
    Path(args.result).write_text(json.dumps({"groups": args.groups, "group_size": args.group_size,
                                             "arm_advantages": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
