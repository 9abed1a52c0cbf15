"""One training step of a task config: where the time goes, and the update against PyTorch on the same batch.

Part 1, phase breakdown. The trainer's objects (``trainer.build_run`` on the mesh the trainer uses) run
the step's phases one after another for ``--steps`` steps, each phase timed apart; the first step
(compilation included) is reported apart from the steady state (median of the other steps):
  rollout  ``Rollout.run``: the multi-turn episodes (generation + env steps + prompt assembly)
  mi       the MI diagnostics (first-turn and trajectory cross-scoring; the trainer runs them at step 1
           and every ``mi.every`` steps)
  scoring  one forward of the actor over the batch in micro-batches (``sequence_logprobs``), which is
           what each of recomputed old log-probs, reference log-probs (KL) and critic values costs;
           the default GRPO configs need none of them (the sampler's log-probs are the old log-probs)
  update   the fused update step exactly as the trainer calls it (filter, the scoring the config asks
           for, advantages, mini-batch updates with gradient accumulation, AdamW)

Part 2, the update against PyTorch on the same batch and the same weights. One more rollout of the
trained actor gives a batch whose stored log-probs are both sides' old log-probs; the fused update step
(the same batch each time) and the same PPO actor update written in PyTorch
(``transformers.Qwen2ForCausalLM`` loaded from the same weights via ``save_hf_checkpoint``; clip 0.2 /
0.28, dual clip 3, entropy 0.001, token-mean, the config's mini-batch and micro-batch sizes, AdamW,
grad clip 1.0, ``torch.set_num_threads(2)``) alternate ``--repeats`` times after one PyTorch warm-up.
PyTorch gets each row compacted and right-padded to the batch's longest row (what a PyTorch trainer
feeds its model); ours gets the rollout's rows as the trainer does and crops them to the longest row
rounded up to a bucket width (``UpdateStep.fit_width``, ``algorithm.width_buckets``) and packs each
mini-batch's rows (``algorithm.pack_rows``); with packing on, the same update over one episode per row
(``pack_rows=False``) alternates too. Throughput = valid tokens of the batch (the same number on every
side) per second of update, median. Parity: PyTorch's log-probs of the batch before any update against
the log-probs the sampler stored.

tcmalloc is preloaded when present and ``OMP_WAIT_POLICY=PASSIVE`` is set (the script re-executes
itself): PyTorch's OpenMP threads otherwise spin and slow everything when other processes share the
cores. Writes benchmarks/results/train_step_<env>.json.

    .venv/bin/python benchmarks/train_step.py                          # frozen_lake, random weights
    .venv/bin/python benchmarks/train_step.py --config configs/countdown.py \\
        --set init=sft sft.cache_dir=runs/warm_starts                # from the warm start (built if missing)
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
_CHILD_FLAG = "RAGEN_BENCH_TRAIN_STEP_CHILD"


def _reexec_with_runtime_env() -> None:
    """Re-run this script once with tcmalloc preloaded (when present) and passive OpenMP waiting."""
    if os.environ.get(_CHILD_FLAG):
        return
    env = dict(os.environ, **{_CHILD_FLAG: "1", "OMP_WAIT_POLICY": "PASSIVE"})
    if os.path.exists(TCMALLOC):
        env["LD_PRELOAD"] = (TCMALLOC + " " + env.get("LD_PRELOAD", "")).strip()
    command = [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
    os.execvpe(command[0], command, env)


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/frozen_lake.py", help="a configs/*.py file (file.py:preset)")
    parser.add_argument("--set", nargs="*", default=["init=random"], metavar="KEY=VALUE",
                        help="config overrides (default: init=random, so that nothing is built first)")
    parser.add_argument("--steps", type=int, default=3, help="training steps timed (the first compiles)")
    parser.add_argument("--repeats", type=int, default=5, help="timed updates per side on the fixed batch")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/train_step_<env>.json")
    return parser.parse_args()


def apply_overrides(config, overrides: list[str]) -> None:
    """``a.b=value`` strings onto an ml_collections config; values parse as Python literals, else strings.
    Unknown keys fail as the CLI's do (``config_check.check_override_keys``: one line, nearest key)."""
    from ragen_jax.setup.config_check import ConfigError, check_override_keys

    pairs = [item.partition("=") for item in overrides]
    if any(not sep for _, sep, _ in pairs):
        raise SystemExit(f"--set expects KEY=VALUE, got {overrides}")
    try:
        check_override_keys([f"--config.{item}" for item in overrides], config)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    for key, _, text in pairs:
        *parents, leaf = key.split(".")
        node = config
        for name in parents:
            node = node[name]
        try:
            node[leaf] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            node[leaf] = text


def compacted_batch(traj, advantages):
    """The rollout's rows (holes between turns) as contiguous, right-padded numpy arrays
    (``rollout_layout.compact_rows``), cut to the longest row.

    advantages: f32[B] per episode. Returns tokens int64[B, Lc], valid bool[B, Lc], loss_mask f32[B, Lc],
    old_logp f32[B, Lc] (the sampler's log-prob of each generated token), adv f32[B, Lc] (the episode's
    advantage on its generated tokens); Lc = the longest row's number of valid tokens.
    """
    import jax.numpy as jnp
    import numpy as np

    from ragen_jax.rollout.layout import compact_rows

    loss = traj.loss_mask.astype(jnp.float32)
    tokens, loss_mask, old_logp, adv, counts = compact_rows(
        traj.valid, traj.tokens, loss, jnp.where(traj.loss_mask, traj.logprobs, 0.0),
        jnp.asarray(advantages, jnp.float32)[:, None] * loss)
    width = int(counts.max())
    valid = np.arange(width)[None, :] < np.asarray(counts)[:, None]
    cut = lambda x, dtype: np.asarray(x[:, :width]).astype(dtype)  # noqa: E731
    return {"tokens": cut(tokens, np.int64), "valid": valid, "loss_mask": cut(loss_mask, np.float32),
            "old_logp": cut(old_logp, np.float32), "adv": cut(adv, np.float32)}


def torch_token_logprobs(model, tokens, valid, temperature: float):
    """log p(tokens[:, t] | tokens[:, :t]) at the sampling temperature, t >= 1, right-padded rows: f32[B, L - 1]."""
    import torch

    logits = model(input_ids=tokens, attention_mask=valid.long()).logits[:, :-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]


def torch_update(model, opt, batch, mini: int, micro: int, temperature: float):
    """The PPO actor update in PyTorch over right-padded rows; returns the mean pg_loss over mini-batches.

    Per mini-batch: loss = sum over its loss tokens of (clipped pg - 0.001 entropy) / its loss-token count,
    accumulated over micro-batches, then grad clip 1.0 and one AdamW step.
    """
    import torch

    tokens, valid, loss_mask, old_logp, adv = (batch[k] for k in ("tokens", "valid", "loss_mask", "old_logp", "adv"))
    pg_losses = []
    for start in range(0, tokens.shape[0], mini):
        # target t is predicted at t - 1: masks and old log-probs are indexed by target
        n_tokens = float(loss_mask[start:start + mini, 1:].sum())
        pg_total = 0.0
        for m in range(start, start + mini, micro):
            ms = slice(m, m + micro)
            ids = tokens[ms]
            logits = model(input_ids=ids, attention_mask=valid[ms].long()).logits[:, :-1].float() / temperature
            logp_all = torch.log_softmax(logits, dim=-1)
            logp = logp_all.gather(-1, ids[:, 1:, None])[..., 0]
            entropy = -(logp_all.exp() * logp_all).sum(-1)
            mask, a = loss_mask[ms, 1:], adv[ms, 1:]
            # ratio r = exp(logp - old);  L = max(-A r, -A clip(r, 1 - 0.2, 1 + 0.28)), dual clip min(L, -3A) for A < 0
            ratio = torch.exp(torch.clamp(logp - old_logp[ms, 1:], -20.0, 20.0))
            l_clip = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 0.8, 1.28))
            pg = torch.where(a < 0, torch.minimum(l_clip, -a * 3.0), l_clip)
            pg_sum = (pg * mask).sum()
            ((pg_sum - 0.001 * (entropy * mask).sum()) / n_tokens).backward()
            pg_total += float(pg_sum.detach()) / n_tokens
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        pg_losses.append(pg_total)
    return sum(pg_losses) / len(pg_losses)


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _split_first(times: list[float]) -> dict:
    return {"first_s": times[0], "steady_s": statistics.median(times[1:]) if len(times) > 1 else None,
            "runs_s": times}


def main() -> None:
    _reexec_with_runtime_env()
    args = _parse_args()
    if args.steps < 2 or args.repeats < 1:
        raise SystemExit("--steps must be >= 2 (the first compiles) and --repeats >= 1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)

    import jax
    import numpy as np
    import torch
    from flax import nnx
    from transformers import Qwen2ForCausalLM

    from ragen_jax.parallel import sharding
    from ragen_jax.setup.config_file import load_config_file
    from ragen_jax.models.hf_io import save_hf_checkpoint
    from ragen_jax.models.logprobs import sequence_logprobs
    from ragen_jax.rl.advantages import grpo_advantages
    from ragen_jax.train.loop import build_run, mi_diagnostics

    torch.set_num_threads(2)
    config = load_config_file(args.config)
    apply_overrides(config, args.set)
    run, state = build_run(config)
    run, state = sharding.shard_run(run, state, sharding.make_mesh(config))
    rows_step = None  # the same update over one episode per row, when the config packs
    if config.algorithm.get("pack_rows", True):
        rows_config = load_config_file(args.config)
        apply_overrides(rows_config, [*args.set, "algorithm.pack_rows=False"])
        rows_step = sharding.shard_run(*build_run(rows_config), sharding.make_mesh(rows_config))[0].update_step
    alg, r = config.algorithm, run.rollout_cfg
    micro = alg.micro_batch_size
    chunk = int(alg.get("logprob_chunk", 128))
    recompute = bool(alg.get("recompute_old_logprobs", False))

    @jax.jit
    def score(params, tokens, valid):
        """One actor forward over the batch, micro-batch by micro-batch: f32[B, S] log-probs."""
        model = nnx.merge(run.actor_graphdef, params)
        split = lambda x: x.reshape(-1, micro, *x.shape[1:])
        logp = jax.lax.map(lambda tv: sequence_logprobs(model, tv[0], tv[1], r.temperature, chunk)[0],
                           (split(tokens), split(valid)))
        return logp.reshape(tokens.shape)

    # ---- part 1: phases ------------------------------------------------------------------------
    times = {"rollout": [], "mi": [], "scoring": [], "update": []}
    generated = []
    for step in range(1, args.steps + 1):
        key = jax.random.fold_in(jax.random.key(config.seed), step)
        k_roll, k_mi, k_upd = jax.random.split(key, 3)
        traj, dt = _timed(lambda: jax.block_until_ready(
            run.rollout.run(state.actor, k_roll, r.train_seeds(step - 1))))
        times["rollout"].append(dt)
        generated.append(int(np.asarray(traj.loss_mask).sum()))
        (_, mi_ema), dt = _timed(lambda: jax.block_until_ready(mi_diagnostics(run, state, traj, k_mi)))
        state = state.replace(mi_ema=mi_ema)
        times["mi"].append(dt)
        _, dt = _timed(lambda: jax.block_until_ready(score(state.actor, traj.tokens, traj.valid)))
        times["scoring"].append(dt)
        result, dt = _timed(lambda: jax.block_until_ready(run.update_step(state, traj, k_upd)))
        times["update"].append(dt)
        state = result.state
        print(f"step {step}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in times.items()), flush=True)
    phases = {k: _split_first(v) for k, v in times.items()}

    # ---- part 2: the update on the last batch, ours vs PyTorch -------------------------------------
    # A fresh batch from the current actor, so that the sampler's log-probs are the old log-probs
    # of both updates; the export comes before our updates, which donate (free) the parameters.
    traj = jax.block_until_ready(run.rollout.run(state.actor, jax.random.key(config.seed + 1),
                                                 r.train_seeds(args.steps)))
    sequence_slots, valid_tokens = int(np.prod(traj.tokens.shape)), int(np.asarray(traj.valid).sum())
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_checkpoint(nnx.merge(run.actor_graphdef, state.actor), tmp)
        model = Qwen2ForCausalLM.from_pretrained(tmp, torch_dtype=torch.float32, attn_implementation="eager")
    rewards = np.asarray(traj.episode_reward).reshape(r.n_groups, r.group_size)
    adv = np.asarray(grpo_advantages(rewards)).reshape(-1)
    batch_np = compacted_batch(traj, adv)
    batch = {k: torch.from_numpy(v) for k, v in batch_np.items()}
    with torch.no_grad():
        torch_logp = torch_token_logprobs(model, batch["tokens"], batch["valid"], r.temperature).numpy()
    mask = batch_np["loss_mask"][:, 1:] > 0
    logp_gap = float(np.abs(torch_logp - batch_np["old_logp"][:, 1:])[mask].max())
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=config.optim.actor_lr, betas=(config.optim.b1, config.optim.b2),
                            eps=1e-8, weight_decay=config.optim.weight_decay)
    torch_update(model, opt, batch, alg.mini_batch_size, micro, r.temperature)  # warm-up
    # The two sides alternate, so that a change of load on the shared machine hits both alike.
    jax_times, torch_times, rows_times = [], [], []
    if rows_step is not None:  # its compile
        state = jax.block_until_ready(rows_step(state, traj, jax.random.key(0))).state
    for i in range(args.repeats):
        result, dt = _timed(lambda: jax.block_until_ready(run.update_step(state, traj, jax.random.key(i))))
        state = result.state
        jax_times.append(dt)
        rows_run = float(result.metrics["update/rows_run"])
        _, dt = _timed(lambda: torch_update(model, opt, batch, alg.mini_batch_size, micro, r.temperature))
        torch_times.append(dt)
        if rows_step is not None:
            result, dt = _timed(lambda: jax.block_until_ready(rows_step(state, traj, jax.random.key(i))))
            state = result.state
            rows_times.append(dt)

    jax_s, torch_s = statistics.median(jax_times), statistics.median(torch_times)
    jax_tps, torch_tps = valid_tokens / jax_s, valid_tokens / torch_s
    steady = {k: v["steady_s"] for k, v in phases.items()}
    step_s = steady["rollout"] + steady["update"]
    print(f"\n{args.config} {' '.join(args.set)}: {r.n_groups} x {r.group_size} episodes, {r.max_turns} turns of "
          f"<= {r.max_new_tokens} tokens, {alg.name}; CPU ({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})")
    print(f"last step's batch: {generated[-1]} generated tokens; the update comparison's batch: "
          f"{traj.tokens.shape[0]} rows x {traj.tokens.shape[1]} slots, {valid_tokens} valid tokens "
          f"({valid_tokens / sequence_slots:.0%} of the slots)")
    print(f"{'phase':<10}{'steady (s)':>12}{'first (s)':>12}")
    for name, v in phases.items():
        print(f"{name:<10}{v['steady_s']:>12.2f}{v['first_s']:>12.2f}")
    print(f"a step without MI = rollout + update = {step_s:.1f} s; MI adds {steady['mi']:.1f} s on its steps; "
          f"the scoring forward is {'part of update' if recompute else 'not run'} "
          f"in this config")
    with_critic = run.critic_graphdef is not None
    print(f"\nupdate of the same batch ({valid_tokens} valid tokens), steady state"
          + (" (ours includes the critic's update, PyTorch's does not):" if with_critic else ":"))
    print(f"{'side':<8}{'width':>8}{'update (s)':>12}{'tokens/s':>12}")
    ours_width = getattr(run.update_step, "inner", run.update_step).fit_width(traj).seq_len
    print(f"{'ours':<8}{ours_width:>8}{jax_s:>12.2f}{jax_tps:>12.0f}")
    print(f"{'torch':<8}{batch_np['tokens'].shape[1]:>8}{torch_s:>12.2f}{torch_tps:>12.0f}")
    print(f"ratio (ours / torch tokens/s): {jax_tps / torch_tps:.2f}x; parity: max |torch log-prob - sampler "
          f"log-prob| on the {int(mask.sum())} generated tokens = {logp_gap:.2e}")
    rows_side = None
    if rows_step is not None:
        rows_s = statistics.median(rows_times)
        rows_side = {"width": int(ours_width), "steady_s": rows_s, "runs_s": rows_times,
                     "tokens_per_s": valid_tokens / rows_s, "packed_over_rows": rows_s / jax_s}
        print(f"packed: {rows_run:.0f} of {traj.tokens.shape[0]} rows run; the update over one episode per row "
              f"takes {rows_s:.2f} s ({rows_s / jax_s:.2f}x the packed update's time)")

    result = {
        "benchmark": "train_step",
        "config": args.config, "overrides": args.set, "algorithm": alg.name,
        "episodes": r.n_groups * r.group_size, "max_turns": r.max_turns, "max_new_tokens": r.max_new_tokens,
        "batch_rows": int(traj.tokens.shape[0]), "batch_slots": int(traj.tokens.shape[1]),
        "valid_tokens": valid_tokens, "generated_tokens": generated,
        "phases": phases, "step_without_mi_s": step_s,
        "update_vs_torch": {
            "ours": {"width": int(ours_width), "steady_s": jax_s, "runs_s": jax_times, "tokens_per_s": jax_tps},
            "torch": {"width": int(batch_np["tokens"].shape[1]), "steady_s": torch_s, "runs_s": torch_times,
                      "tokens_per_s": torch_tps, "threads": torch.get_num_threads()},
            "ratio_ours_over_torch": jax_tps / torch_tps,
            "ours_rows": rows_side, "ours_rows_run": rows_run,
            "parity_max_logprob_diff": logp_gap, "ours_includes_critic_update": with_critic,
        },
        "tcmalloc": TCMALLOC in os.environ.get("LD_PRELOAD", ""), "backend": jax.default_backend(),
        "cpu_count": os.cpu_count(), "load_average_1min": os.getloadavg()[0], "jax_version": jax.__version__,
        "torch_version": torch.__version__, "python": platform.python_version(),
    }
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"train_step_{config.env.name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
