"""Actor-update throughput: the fused jitted PPO update against the same update in PyTorch.

Both sides run one PPO actor update over the same batch (``--rows`` trajectories of ``--seq-len``
tokens, right-padded), split the same way into mini-batches (one AdamW step each, grad clip 1.0) and
micro-batches (gradient accumulation with the mini-batch's token count as the one denominator):
  jax:   ``ragen_jax.update.make_update_step`` (GRPO advantages, no filter, no critic), ``tiny`` preset;
  torch: ``transformers.Qwen2ForCausalLM`` loaded from the same weights (``save_hf_checkpoint`` then
         ``from_pretrained``), the same loss written out in torch (clip 0.2 / 0.28, dual clip 3,
         entropy bonus 0.001, token-mean), ``torch.set_num_threads(2)``.
Throughput = trained tokens (the valid tokens the update's forward + backward runs over) per second
of the whole update (forward, backward, AdamW), steady state (median of ``--repeats``; JAX's first
call, with compilation, is reported apart). The first update's pg_loss and grad norm of both sides are
printed as a parity check. tcmalloc is preloaded when present (re-exec). Writes
benchmarks/results/train_step.json.

    .venv/bin/python benchmarks/train_step.py
    .venv/bin/python benchmarks/train_step.py --rows 64 --seq-len 512 --mini-batch 32 --micro-batch 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
_CHILD_FLAG = "RAGEN_BENCH_TRAIN_STEP_CHILD"


def _reexec_with_tcmalloc() -> None:
    """Re-run this script once with tcmalloc preloaded (when the library exists)."""
    if os.environ.get(_CHILD_FLAG) or not os.path.exists(TCMALLOC):
        return
    env = dict(os.environ, **{_CHILD_FLAG: "1"})
    env["LD_PRELOAD"] = (TCMALLOC + " " + env.get("LD_PRELOAD", "")).strip()
    command = [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
    os.execvpe(command[0], command, env)


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=32, help="trajectories in the batch")
    parser.add_argument("--seq-len", type=int, default=256, help="static sequence length L")
    parser.add_argument("--mini-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--repeats", type=int, default=3, help="timed updates per side (median kept)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "train_step.json"))
    return parser.parse_args()


def synthetic_batch(rng, rows: int, length: int, vocab: int):
    """Right-padded rows: a prompt of L/4..L/2 tokens, then a response filling 50-100 % of the rest."""
    import numpy as np

    tokens = np.zeros((rows, length), np.int32)
    valid = np.zeros((rows, length), bool)
    loss_mask = np.zeros((rows, length), bool)
    for b in range(rows):
        prompt = int(rng.integers(length // 4, length // 2))
        response = int(rng.integers((length - prompt) // 2, length - prompt + 1))
        tokens[b, : prompt + response] = rng.integers(8, vocab, prompt + response)
        valid[b, : prompt + response] = True
        loss_mask[b, prompt : prompt + response] = True
    return tokens, valid, loss_mask


def torch_update(model, opt, tokens, valid, loss_mask, old_logp, adv, mini: int, micro: int):
    """The PPO actor update in torch; returns (pg_loss, pre-clip grad norm), each averaged over mini-batches."""
    import torch

    pg_losses, norms = [], []
    rows = tokens.shape[0]
    for start in range(0, rows, mini):
        sl = slice(start, start + mini)
        # target t is predicted at t - 1: shift everything by one
        n_tokens = float(loss_mask[sl, 1:].sum())
        pg_total = 0.0
        for m in range(start, start + mini, micro):
            ms = slice(m, m + micro)
            ids = tokens[ms]
            logits = model(input_ids=ids, attention_mask=valid[ms].long()).logits[:, :-1].float()
            logp_all = torch.log_softmax(logits, dim=-1)
            logp = logp_all.gather(-1, ids[:, 1:, None])[..., 0]
            entropy = -(logp_all.exp() * logp_all).sum(-1)
            mask = loss_mask[ms, 1:]
            a = adv[ms, 1:]
            log_ratio = torch.clamp(logp - old_logp[ms, 1:], -20.0, 20.0)
            ratio = torch.exp(log_ratio)
            l_clip = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 0.8, 1.28))
            pg = torch.where(a < 0, torch.minimum(l_clip, -a * 3.0), l_clip)
            pg_sum = (pg * mask).sum()
            loss = (pg_sum - 0.001 * (entropy * mask).sum()) / n_tokens
            loss.backward()
            pg_total += float(pg_sum.detach()) / n_tokens
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        pg_losses.append(pg_total)
    return sum(pg_losses) / len(pg_losses), sum(norms) / len(norms)


def main() -> None:
    _reexec_with_tcmalloc()
    args = _parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if args.rows % args.mini_batch or args.mini_batch % args.micro_batch or args.rows % args.group_size:
        raise SystemExit("--rows must be a multiple of --mini-batch and --group-size, "
                         "--mini-batch a multiple of --micro-batch.")

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from flax import nnx
    from transformers import Qwen2ForCausalLM

    from ragen_jax.models.config import get_preset
    from ragen_jax.models.hf_io import save_hf_checkpoint
    from ragen_jax.models.logprobs import sequence_logprobs
    from ragen_jax.models.transformer import Transformer
    from ragen_jax.optim import make_optimizer
    from ragen_jax.rl.advantages import grpo_advantages
    from ragen_jax.rl.losses import ActorLossConfig
    from ragen_jax.trajectories import finalize
    from ragen_jax.update import UpdateConfig, make_update_step

    tcmalloc = TCMALLOC in os.environ.get("LD_PRELOAD", "")
    torch.set_num_threads(2)
    cfg = get_preset("tiny")
    actor = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(actor)
    rng = np.random.default_rng(0)
    rows, length = args.rows, args.seq_len
    tokens, valid, loss_mask = synthetic_batch(rng, rows, length, cfg.vocab_size)
    old_logp = np.asarray(jax.jit(lambda p, t, v: sequence_logprobs(nnx.merge(graphdef, p), t, v)[0])(
        params, tokens, valid))
    old_logp = np.where(loss_mask, old_logp, 0.0).astype(np.float32)
    rewards = rng.normal(size=rows).astype(np.float32)
    groups = rows // args.group_size
    seq_adv = np.asarray(grpo_advantages(rewards.reshape(groups, args.group_size))).reshape(rows)
    trained_tokens = int(valid.sum())
    loss_tokens = int(loss_mask.sum())

    # ---- JAX: the fused update step -----------------------------------------------------------
    zeros = lambda dtype, *shape: np.zeros(shape, dtype)
    traj = finalize(
        tokens=tokens, valid=valid, loss_mask=loss_mask, logprobs=old_logp, entropy=zeros(np.float32, rows, length),
        turn_ids=zeros(np.int32, rows, length), reasoning_mask=zeros(bool, rows, length),
        prompt_spans=zeros(np.int32, rows, 1, 2), turn_active=np.ones((rows, 1), bool),
        turn_rewards=rewards[:, None], turn_penalties=zeros(np.float32, rows, 1),
        turn_format_ok=np.ones((rows, 1), bool), turn_valid_actions=zeros(np.int32, rows, 1),
        turn_executed=zeros(np.int32, rows, 1), response_lengths=loss_mask.sum(1, keepdims=True),
        success=zeros(bool, rows), group_ids=np.repeat(np.arange(groups), args.group_size),
        seeds=np.repeat(np.arange(groups), args.group_size), episode_ids=np.arange(rows),
        sample_turn=np.full(rows, -1), xp=np,
    )
    traj = jax.tree.map(jnp.asarray, traj)
    config = UpdateConfig(
        adv_estimator="grpo", actor_loss=ActorLossConfig(agg_mode="token-mean"), mini_batch_size=args.mini_batch,
        micro_batch_size=args.micro_batch, group_size=args.group_size,
    )
    tx = make_optimizer(args.lr)
    step = make_update_step(graphdef, None, config, tx, None)
    state = {"params": jax.tree.map(jnp.copy, params)}
    state["opt"] = tx.init(state["params"])

    def jax_update():
        out = step(state["params"], None, state["opt"], None, None, traj, jax.random.key(0))
        jax.block_until_ready(out.actor_params)
        state["params"], state["opt"] = out.actor_params, out.actor_opt_state
        return out

    start = time.perf_counter()
    first_out = jax_update()
    jax_first = time.perf_counter() - start
    jax_times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        jax_update()
        jax_times.append(time.perf_counter() - start)

    # ---- torch: the same update on the same weights ---------------------------------------------
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_checkpoint(actor, tmp)
        model = Qwen2ForCausalLM.from_pretrained(tmp, torch_dtype=torch.float32, attn_implementation="eager")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    t_args = (torch.tensor(tokens, dtype=torch.long), torch.tensor(valid), torch.tensor(loss_mask, dtype=torch.float32),
              torch.tensor(old_logp), torch.tensor(seq_adv[:, None] * loss_mask, dtype=torch.float32))
    start = time.perf_counter()
    torch_first_pg, torch_first_norm = torch_update(model, opt, *t_args, args.mini_batch, args.micro_batch)
    torch_first = time.perf_counter() - start
    torch_times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        torch_update(model, opt, *t_args, args.mini_batch, args.micro_batch)
        torch_times.append(time.perf_counter() - start)

    jax_s, torch_s = statistics.median(jax_times), statistics.median(torch_times)
    jax_tps, torch_tps = trained_tokens / jax_s, trained_tokens / torch_s
    n_mb = rows // args.mini_batch
    print(f"PPO actor update, tiny preset ({cfg.num_params() / 1e6:.1f}M params), {rows} rows x {length} tokens, "
          f"{n_mb} mini-batches of {args.mini_batch}, micro-batch {args.micro_batch}; CPU "
          f"({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}), tcmalloc {'on' if tcmalloc else 'off'}")
    print(f"trained tokens per update: {trained_tokens} ({loss_tokens} loss tokens)")
    print(f"{'side':<8}{'update (s)':>12}{'first (s)':>12}{'tokens/s':>12}")
    print(f"{'jax':<8}{jax_s:>12.3f}{jax_first:>12.3f}{jax_tps:>12.0f}")
    print(f"{'torch':<8}{torch_s:>12.3f}{torch_first:>12.3f}{torch_tps:>12.0f}")
    print(f"ratio (jax tokens/s / torch tokens/s): {jax_tps / torch_tps:.2f}x")
    jax_pg = float(first_out.metrics["actor/pg_loss"])
    jax_norm = float(first_out.metrics["actor/grad_norm"])
    print(f"parity (first update, means over mini-batches): pg_loss jax {jax_pg:.6g} torch {torch_first_pg:.6g}; "
          f"grad norm jax {jax_norm:.6g} torch {torch_first_norm:.6g}")

    result = {
        "benchmark": "train_step_actor_update",
        "preset": "tiny", "params": cfg.num_params(),
        "rows": rows, "seq_len": length, "mini_batch": args.mini_batch, "micro_batch": args.micro_batch,
        "trained_tokens_per_update": trained_tokens, "loss_tokens_per_update": loss_tokens,
        "jax": {"steady_s": jax_s, "first_call_s": jax_first, "runs_s": jax_times, "tokens_per_s": jax_tps},
        "torch": {"steady_s": torch_s, "first_call_s": torch_first, "runs_s": torch_times, "tokens_per_s": torch_tps,
                  "threads": torch.get_num_threads()},
        "ratio_jax_over_torch": jax_tps / torch_tps,
        "parity_first_update": {"jax_pg_loss": jax_pg, "torch_pg_loss": torch_first_pg,
                                "jax_grad_norm": jax_norm, "torch_grad_norm": torch_first_norm},
        "tcmalloc": tcmalloc, "backend": jax.default_backend(), "cpu_count": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0], "jax_version": jax.__version__, "torch_version": torch.__version__,
        "python": platform.python_version(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
