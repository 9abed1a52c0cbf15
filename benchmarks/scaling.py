"""Scaling of the sharded update step over a mesh, and (on a GPU) MFU of the update and the sampler's
HBM-bandwidth share.

CPU mode (default without a GPU): the fused update step (``ragen_jax.rl.update``, GRPO, no filter)
wrapped by ``ragen_jax.parallel.sharding.ShardedUpdateStep`` on 1, 2, 4 and 8 forced CPU devices (a data
mesh (N, 1, 1), plus (2, 2, 2) on 8), each in its own process (the device count is fixed at start-up).
The peer is the 1-device run of the same batch: the table gives each mesh's throughput ratio to it and
the largest relative difference of its metrics (pg_loss, grad norm, entropy, ...) from it. On a 2-core
machine the forced devices share the same cores, so this is a correctness smoke of the sharded program
more than a speed figure.

GPU mode (``--mode gpu``, the default when JAX sees a GPU): ``qwen2.5-0.5b`` with random weights,
bfloat16 compute, on one GPU:
  update MFU   = trained tokens/s x (6 P + 6 n_layers L d) / peak bf16 FLOP/s
                 (P parameters with the LM head counted once; the attention term is the causal half of
                 12 n_layers L d per token; forward + backward, GRPO actor update, AdamW included in time)
  sampler HBM  = bytes read per decode step / step time / peak HBM bandwidth, bytes per step =
                 parameter bytes + K/V cache bytes of the attended slots (2 n_layers B Hkv S hd x 2 B)
Peaks come from a small table of device kinds (``--peak-tflops`` / ``--peak-hbm-gbs`` override).

    .venv/bin/python benchmarks/scaling.py                 # CPU table
    .venv/bin/python benchmarks/scaling.py --mode gpu      # on a GPU machine
Writes benchmarks/results/scaling.json (the "cpu" or "gpu" entry; the other entry is kept).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU_PRESET = "qwen2.5-0.5b"
GPU_UPDATE = (64, 1024, 8)      # rows, sequence length, group size
GPU_SAMPLER = (64, 256, 256)    # batch, prompt length, new tokens
CPU_MESHES = [(1, 1, 1), (2, 1, 1), (4, 1, 1), (8, 1, 1), (2, 2, 2)]
# bf16 dense peak FLOP/s and HBM bytes/s by device kind (vendor data sheets, SXM parts).
PEAKS = {"H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12), "A100": (312e12, 2.0e12), "L4": (121e12, 0.3e12),
         "A10": (125e12, 0.6e12)}


def _parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("auto", "cpu", "gpu"), default="auto")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child-mesh", default="", help=argparse.SUPPRESS)
    p.add_argument("--peak-tflops", type=float, default=0.0)
    p.add_argument("--peak-hbm-gbs", type=float, default=0.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "scaling.json"))
    return p.parse_args()


def synthetic_traj(rows: int, length: int, vocab: int, group_size: int, seed: int = 0):
    """A one-turn Trajectories batch: prompt L/4..L/2 tokens, then a response; rewards vary within groups."""
    import jax.numpy as jnp
    import numpy as np

    from ragen_jax.rollout.trajectories import finalize

    rng = np.random.default_rng(seed)
    tokens = np.zeros((rows, length), np.int32)
    valid = np.zeros((rows, length), bool)
    loss = np.zeros((rows, length), bool)
    for b in range(rows):
        prompt = int(rng.integers(length // 4, length // 2))
        response = int(rng.integers((length - prompt) // 2, length - prompt + 1))
        tokens[b, : prompt + response] = rng.integers(8, vocab, prompt + response)
        valid[b, : prompt + response] = True
        loss[b, prompt: prompt + response] = True
    logp = np.where(loss, -rng.uniform(0.5, 6.0, (rows, length)), 0.0).astype(np.float32)
    reward = rng.integers(0, 2, rows).astype(np.float32)
    one = lambda dtype, value=0: np.full((rows, 1), value, dtype)  # noqa: E731
    return finalize(
        tokens=jnp.asarray(tokens), valid=jnp.asarray(valid), loss_mask=jnp.asarray(loss), logprobs=jnp.asarray(logp),
        entropy=jnp.zeros((rows, length)), turn_ids=jnp.zeros((rows, length), jnp.int32),
        reasoning_mask=jnp.zeros((rows, length), bool), prompt_spans=jnp.zeros((rows, 1, 2), jnp.int32),
        turn_active=jnp.ones((rows, 1), bool), turn_rewards=jnp.asarray(reward[:, None]),
        turn_penalties=jnp.asarray(one(np.float32)), turn_format_ok=jnp.ones((rows, 1), bool),
        turn_valid_actions=jnp.asarray(one(np.int32, 1)), turn_executed=jnp.asarray(one(np.int32, 1)),
        response_lengths=jnp.asarray(loss.sum(1, keepdims=True).astype(np.int32)),
        success=jnp.asarray(reward > 0), group_ids=jnp.arange(rows) // group_size, seeds=jnp.arange(rows) // group_size,
        episode_ids=jnp.arange(rows), sample_turn=jnp.full((rows,), -1, jnp.int32),
    )


def build_update(cfg, rows: int, mini: int, micro: int, group_size: int, lr: float = 1e-5):
    """(update_step, params, opt_state) of a GRPO actor update on ``cfg`` (random weights)."""
    from flax import nnx

    from ragen_jax.models.transformer import Transformer
    from ragen_jax.rl.optim import make_optimizer
    from ragen_jax.rl.update import UpdateConfig, make_update_step

    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tx = make_optimizer(lr)
    ucfg = UpdateConfig(adv_estimator="grpo", mini_batch_size=mini, micro_batch_size=micro, group_size=group_size)
    return make_update_step(graphdef, None, ucfg, tx, None), params, tx.init(params)


# ----------------------------------------------------------------------------------------------- CPU
def cpu_child(mesh_shape: tuple[int, int, int], rows: int, seq_len: int, repeats: int) -> dict:
    import jax
    import numpy as np

    jax.config.update("jax_default_matmul_precision", "highest")
    from ragen_jax.parallel import sharding
    from ragen_jax.models.config import get_preset
    from ragen_jax.rl.state import TrainState

    cfg = get_preset("tiny", hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=32)
    group = 8
    step, params, opt = build_update(cfg, rows, mini=rows // 2, micro=rows // 4, group_size=group)
    traj = synthetic_traj(rows, seq_len, cfg.vocab_size, group)
    mesh = sharding.make_mesh(mesh_shape)
    shardings = sharding.state_shardings(TrainState(actor=params, actor_opt=opt), mesh, cfg)
    sharded = sharding.ShardedUpdateStep(step, mesh, shardings)
    host_state = TrainState(actor=jax.tree.map(np.asarray, params), actor_opt=jax.tree.map(np.asarray, opt))

    def fresh():  # the step donates its state: place new buffers for every call
        return sharding.shard_state(host_state, shardings)

    key = jax.random.key(1)
    state = fresh()
    t0 = time.perf_counter()
    first = sharded(state, traj, key)
    jax.block_until_ready(first.metrics)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        state = fresh()
        t0 = time.perf_counter()
        res = sharded(state, traj, key)
        jax.block_until_ready(res.metrics)
        times.append(time.perf_counter() - t0)
    metrics = {k: float(v) for k, v in first.metrics.items()}
    seconds = statistics.median(times)
    return {"mesh": list(mesh_shape), "devices": int(np.prod(mesh_shape)), "compile_and_first_s": compile_s,
            "update_s": seconds, "tokens_per_s": metrics["update/tokens"] / seconds, "metrics": metrics,
            "traces": sharded.traces}


def run_cpu(args) -> dict:
    results = []
    for shape in CPU_MESHES:
        n = shape[0] * shape[1] * shape[2]
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")
        cmd = [sys.executable, __file__, "--child-mesh", ",".join(map(str, shape)), "--rows", str(args.rows),
               "--seq-len", str(args.seq_len), "--repeats", str(args.repeats)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            raise SystemExit(f"mesh {shape} failed:\n{proc.stderr[-4000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    base = results[0]
    keys = [k for k in base["metrics"] if k.startswith(("actor/", "critic/advantages"))]
    print(f"{'mesh':>10} {'devices':>7} {'compile+1st s':>13} {'update s':>9} {'tokens/s':>9} {'vs 1 dev':>8} "
          f"{'max rel metric diff':>20}")
    for r in results:
        r["speedup_vs_1"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["max_rel_metric_diff_vs_1"] = max(
            abs(r["metrics"][k] - base["metrics"][k]) / max(1.0, abs(base["metrics"][k])) for k in keys)
        print(f"{str(tuple(r['mesh'])):>10} {r['devices']:>7} {r['compile_and_first_s']:>13.1f} {r['update_s']:>9.3f} "
              f"{r['tokens_per_s']:>9.0f} {r['speedup_vs_1']:>7.2f}x {r['max_rel_metric_diff_vs_1']:>20.2e}")
    return {"rows": args.rows, "seq_len": args.seq_len, "cpu_count": os.cpu_count(),
            "model": "tiny (d 128, 2 layers, 4 heads / 2 KV, MLP 384, vocab 264), float32, GRPO actor update",
            "results": results}


# ----------------------------------------------------------------------------------------------- GPU
def _peaks(device_kind: str, args) -> tuple[float, float]:
    flops, hbm = next((v for k, v in PEAKS.items() if k in device_kind), (0.0, 0.0))
    flops = args.peak_tflops * 1e12 if args.peak_tflops else flops
    hbm = args.peak_hbm_gbs * 1e9 if args.peak_hbm_gbs else hbm
    if not flops or not hbm:
        raise SystemExit(f"no peak numbers for device {device_kind!r}: pass --peak-tflops and --peak-hbm-gbs")
    return flops, hbm


def run_gpu(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from ragen_jax.models.config import get_preset
    from ragen_jax.models.transformer import Transformer
    from ragen_jax.sampling.sampler import Sampler, SamplingConfig, init_sampler_state

    device = jax.devices()[0]
    peak_flops, peak_hbm = _peaks(device.device_kind, args)
    cfg = get_preset(GPU_PRESET, dtype="bfloat16")
    n_params = cfg.num_params()

    # Update MFU.
    rows, length, group = GPU_UPDATE
    step, params, opt = build_update(cfg, rows, mini=rows // 2, micro=rows // 8, group_size=group)
    traj = synthetic_traj(rows, length, cfg.vocab_size, group)
    key = jax.random.key(0)
    copy = lambda t: jax.tree.map(jnp.copy, t)  # noqa: E731 - the step donates its state
    res = step(copy(params), None, copy(opt), None, None, traj, key)
    jax.block_until_ready(res.metrics)
    times = []
    for _ in range(args.repeats):
        p, o = copy(params), copy(opt)
        jax.block_until_ready((p, o))
        t0 = time.perf_counter()
        res = step(p, None, o, None, None, traj, key)
        jax.block_until_ready(res.metrics)
        times.append(time.perf_counter() - t0)
    tokens = float(res.metrics["update/tokens"])
    flops_per_token = 6 * n_params + 6 * cfg.num_layers * length * cfg.hidden_size
    update_s = statistics.median(times)
    mfu = tokens * flops_per_token / update_s / peak_flops

    # Sampler: prefill a prompt, then time the decode of N tokens (all rows run to N: no stops).
    batch, prompt, new = GPU_SAMPLER
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    graphdef, sparams = nnx.split(model)
    sampler = Sampler(graphdef, SamplingConfig(max_new_tokens=new, early_exit=False))
    prompt_tokens = np.random.default_rng(0).integers(8, cfg.vocab_size, (batch, prompt)).astype(np.int32)

    def decode_once():
        state = sampler.append(sparams, init_sampler_state(cfg, batch, prompt + new), prompt_tokens)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        out, state = sampler.generate(sparams, state, jax.random.key(2), 1.0)
        jax.block_until_ready(out)
        return time.perf_counter() - t0

    decode_once()
    decode_s = statistics.median(decode_once() for _ in range(args.repeats))
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(sparams))
    itemsize = cfg.compute_dtype.itemsize
    kv_bytes_per_slot = 2 * cfg.num_layers * batch * cfg.num_kv_heads * cfg.head_dim * itemsize
    attended = prompt + new / 2  # mean filled length over the decode
    bytes_per_step = param_bytes + kv_bytes_per_slot * attended
    step_s = decode_s / new
    hbm_share = bytes_per_step / step_s / peak_hbm
    print(f"device {device.device_kind}: update {tokens / update_s:,.0f} tokens/s, MFU {mfu:.1%}; "
          f"decode {batch * new / decode_s:,.0f} tokens/s, {step_s * 1e3:.2f} ms/step, HBM share {hbm_share:.1%}")
    return {"device": device.device_kind, "model": f"{GPU_PRESET} random weights, bf16 compute, f32 params",
            "peak_flops": peak_flops, "peak_hbm_bytes_per_s": peak_hbm,
            "update": {"rows": rows, "seq_len": length, "tokens": tokens, "seconds": update_s,
                       "tokens_per_s": tokens / update_s, "flops_per_token": flops_per_token, "mfu": mfu},
            "sampler": {"batch": batch, "prompt": prompt, "new_tokens": new, "decode_s": decode_s,
                        "step_ms": step_s * 1e3, "bytes_per_step": bytes_per_step, "hbm_share": hbm_share,
                        "tokens_per_s": batch * new / decode_s}}


def main() -> None:
    args = _parse_args()
    if args.child_mesh:
        shape = tuple(int(x) for x in args.child_mesh.split(","))
        print(json.dumps(cpu_child(shape, args.rows, args.seq_len, args.repeats)))
        return
    mode = args.mode
    if mode == "auto":
        import jax

        mode = "gpu" if jax.default_backend() == "gpu" else "cpu"
    result = run_cpu(args) if mode == "cpu" else run_gpu(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(out.read_text()) if out.exists() else {}
    previous[mode] = result
    out.write_text(json.dumps(previous, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
