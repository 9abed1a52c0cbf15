"""Mesh and partition rules (ragen_jax.parallel.sharding).

Fast tests compute specs on abstract meshes (no devices needed) for the real Qwen2.5 shapes, against
specs written out by hand from the rules table. Placement and numerics run in a subprocess with 8 forced
CPU devices (tests/_subprocess.py): the pytest process has already initialised JAX with one device.
"""

from __future__ import annotations

import functools
import logging

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec as P

from ragen_jax.parallel import sharding
from ragen_jax.models.critic import Critic
from ragen_jax.models.config import get_preset
from ragen_jax.models.kv_cache import init_cache
from ragen_jax.models.transformer import Transformer
from ragen_jax.rl.optim import make_optimizer
from tests._subprocess import run_script


def abstract_mesh(data: int, fsdp: int, tensor: int) -> AbstractMesh:
    return AbstractMesh((data, fsdp, tensor), sharding.MESH_AXES)


@functools.lru_cache(maxsize=None)
def abstract_params(preset: str, critic: bool = False):
    cfg = get_preset(preset)
    if critic:
        model = nnx.eval_shape(lambda: Critic(cfg, nnx.Rngs(0)))
    else:
        model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    return cfg, nnx.split(model)[1]


def specs(tree) -> dict[str, P]:
    return {sharding.path_string(p): s.spec for p, s in jax.tree_util.tree_leaves_with_path(tree)}


# ------------------------------------------------------------------------------------------------- mesh
@pytest.mark.parametrize("sizes, devices, expected", [
    ((-1, 1, 1), 8, (8, 1, 1)), ((2, -1, 1), 8, (2, 4, 1)), ((2, 2, -1), 8, (2, 2, 2)), ((1, 1, 1), 1, (1, 1, 1)),
    ((-1, 4, 2), 64, (8, 4, 2)),
])
def test_mesh_shape_fills_the_rest(sizes, devices, expected):
    assert sharding.mesh_shape(sizes, devices) == expected


@pytest.mark.parametrize("sizes, devices, message", [
    ((-1, -1, 1), 8, "at most one"), ((3, -1, 1), 8, "does not divide"), ((2, 2, 1), 8, "set one of"),
    ((0, 1, 1), 8, "positive or -1"), ((1, 1), 8, "(data, fsdp, tensor)"),
])
def test_mesh_shape_errors_name_the_fix(sizes, devices, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        sharding.mesh_shape(sizes, devices)


def test_make_mesh_reads_the_config_on_one_device():
    from configs.base import get_config

    mesh = sharding.make_mesh(get_config())
    assert mesh.axis_names == sharding.MESH_AXES and tuple(mesh.shape.values()) == (1, 1, 1)


# ------------------------------------------------------------------------------------------------ rules
QWEN05_TRAIN_2x4x2 = {  # hand-written from the table: embed -> fsdp, heads/kv_heads/mlp/vocab -> tensor
    "embed/embedding": P("tensor", "fsdp"),            # [151936, 896]
    "layers/0/attn/q_proj/kernel": P("fsdp", "tensor"),  # [896, 14 * 64]
    "layers/0/attn/q_proj/bias": P("tensor"),
    "layers/0/attn/k_proj/kernel": P("fsdp", "tensor"),  # [896, 2 * 64]
    "layers/0/attn/v_proj/bias": P("tensor"),
    "layers/0/attn/o_proj/kernel": P("tensor", "fsdp"),
    "layers/0/mlp/gate_proj/kernel": P("fsdp", "tensor"),  # [896, 4864]
    "layers/0/mlp/up_proj/kernel": P("fsdp", "tensor"),
    "layers/0/mlp/down_proj/kernel": P("tensor", "fsdp"),
    "layers/0/input_norm/weight": P(None),
    "layers/23/post_attn_norm/weight": P(None),
    "final_norm/weight": P(None),
}


def test_qwen05_train_layout_matches_the_table():
    cfg, params = abstract_params("qwen2.5-0.5b")
    got = specs(sharding.param_shardings(params, abstract_mesh(2, 4, 2), "train", cfg))
    for path, spec in QWEN05_TRAIN_2x4x2.items():
        assert got[path] == spec, path
    assert len(got) == 2 + 24 * 12  # embedding, final norm; per layer q/k/v kernel + bias, o, 3 MLP, 2 norms
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):  # every parameter has a rule
        assert sharding.logical_axes_of(sharding.path_string(path), len(leaf.shape)) is not None, path


def test_sample_layout_drops_fsdp_and_keeps_tensor():
    cfg, params = abstract_params("qwen2.5-0.5b")
    got = specs(sharding.param_shardings(params, abstract_mesh(2, 4, 2), "sample", cfg))
    assert got["embed/embedding"] == P("tensor", None)
    assert got["layers/5/attn/q_proj/kernel"] == P(None, "tensor")
    assert got["layers/5/mlp/down_proj/kernel"] == P("tensor", None)


def test_heads_split_only_on_whole_heads(caplog):
    # tensor = 4: 14 query heads and 2 KV heads do not split in 4 (896 columns would, mid-head): replicated.
    cfg, params = abstract_params("qwen2.5-0.5b")
    with caplog.at_level(logging.INFO, logger="ragen_jax.parallel.sharding"):
        got = specs(sharding.param_shardings(params, abstract_mesh(1, 2, 4), "train", cfg))
    assert got["layers/0/attn/q_proj/kernel"] == P("fsdp", None)
    assert got["layers/0/attn/k_proj/kernel"] == P("fsdp", None)
    assert got["layers/0/mlp/gate_proj/kernel"] == P("fsdp", "tensor")  # 4864 / 4
    assert got["embed/embedding"] == P("tensor", "fsdp")  # 151936 / 4
    assert any("q_proj" in r.getMessage() and "replicated" in r.getMessage() for r in caplog.records)
    # Without the model config only the array size is checked: 896 columns split in 4.
    plain = specs(sharding.param_shardings(params, abstract_mesh(1, 2, 4), "train"))
    assert plain["layers/0/attn/q_proj/kernel"] == P("fsdp", "tensor")


def test_untied_head_and_critic():
    cfg, params = abstract_params("qwen2.5-7b")
    got = specs(sharding.param_shardings(params, abstract_mesh(1, 4, 2), "train", cfg))
    assert got["lm_head/kernel"] == P("fsdp", "tensor")  # [3584, 152064]
    _, critic = abstract_params("qwen2.5-7b", critic=True)
    got = specs(sharding.param_shardings(critic, abstract_mesh(1, 4, 2), "train", cfg))
    assert got["backbone/layers/3/attn/q_proj/kernel"] == P("fsdp", "tensor")
    assert got["value_head/kernel"] == P("fsdp", None)
    assert got["value_head/bias"] == P(None)
    assert not any("lm_head" in k for k in got)


def test_optimizer_state_follows_its_parameter():
    cfg, params = abstract_params("qwen2.5-0.5b")
    mesh = abstract_mesh(2, 2, 2)
    opt = jax.eval_shape(make_optimizer(1e-6).init, params)
    param_specs = specs(sharding.param_shardings(params, mesh, "train", cfg))
    opt_specs = specs(sharding.param_shardings(opt, mesh, "train", cfg))
    moments = {k: v for k, v in opt_specs.items() if "/mu/" in k or "/nu/" in k}
    assert len(moments) == 2 * len(param_specs)
    for path, spec in moments.items():
        assert spec == param_specs[path.split("/mu/")[-1].split("/nu/")[-1]], path
    scalars = {k: v for k, v in opt_specs.items() if k not in moments}
    assert scalars and all(v == P() for v in scalars.values())  # step counters and hyperparameters
    assert any(k.endswith("count") for k in scalars) and any("learning_rate" in k for k in scalars)


def test_kv_cache_rows_and_heads(caplog):
    cfg = get_preset("qwen2.5-0.5b")
    cache = jax.eval_shape(functools.partial(init_cache, cfg, 16, 128))
    got = sharding.cache_shardings(cache, abstract_mesh(2, 2, 2))
    assert got.k.spec == P(None, ("data", "fsdp"), "tensor", None, None)
    assert got.slot_valid.spec == P(("data", "fsdp"), None)
    assert got.next_pos.spec == P(("data", "fsdp")) and got.end.spec == P()
    with caplog.at_level(logging.INFO, logger="ragen_jax.parallel.sharding"):
        narrow = sharding.cache_shardings(cache, abstract_mesh(2, 1, 4))  # 2 KV heads on tensor = 4
    assert narrow.k.spec == P(None, "data", None, None, None)
    assert any("KV cache" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="not a multiple of mesh data"):
        sharding.cache_shardings(jax.eval_shape(functools.partial(init_cache, cfg, 6, 8)), abstract_mesh(4, 1, 1))


def test_batch_and_activation_shardings():
    mesh = abstract_mesh(2, 2, 2)
    batch = {"tokens": jax.ShapeDtypeStruct((8, 5), np.int32), "reward": jax.ShapeDtypeStruct((8,), np.float32),
             "step": jax.ShapeDtypeStruct((), np.int32)}
    got = specs(sharding.batch_shardings(batch, mesh))
    assert got == {"tokens": P(("data", "fsdp")), "reward": P(("data", "fsdp")), "step": P()}
    with pytest.raises(ValueError, match="rollout.n_groups"):
        sharding.batch_shardings({"tokens": jax.ShapeDtypeStruct((6, 5), np.int32)}, mesh)
    assert sharding.activation_sharding("logits", (8, 4, 152064), mesh).spec == P(("data", "fsdp"), None, "tensor")
    assert sharding.activation_sharding("hidden", (8, 4, 896), mesh).spec == P(("data", "fsdp"), None, None)
    assert sharding.activation_sharding("q", (8, 14, 4, 64), mesh).spec == P(("data", "fsdp"), "tensor", None, None)
    assert sharding.batch_spec(abstract_mesh(8, 1, 1)) == "data"


def test_unknown_logical_axis_is_an_error():
    with pytest.raises(ValueError, match="unknown logical axis"):
        sharding.logical_to_spec((4,), ("sequence",), abstract_mesh(1, 1, 1))


# ------------------------------------------------------------------------- 8 forced devices (subprocess)
PLACEMENT_SCRIPT = """
import json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from ragen_jax.parallel import sharding
from ragen_jax.models.config import get_preset
from ragen_jax.models.transformer import Transformer
from ragen_jax.rl.optim import make_optimizer
from ragen_jax.rl import filtering

out = {"devices": jax.device_count()}
cfg = get_preset("tiny", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, tie_embeddings=False)
_, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
opt = make_optimizer(1e-3).init(params)
mesh = sharding.make_mesh((2, 2, 2))
placed = sharding.shard_state(params, sharding.param_shardings(params, mesh, "train", cfg))
placed_opt = sharding.shard_state(opt, sharding.param_shardings(opt, mesh, "train", cfg))
q = placed["layers"][0]["attn"]["q_proj"]["kernel"][...]
out["q_spec"] = str(q.sharding.spec)
out["q_shard_shape"] = list(q.addressable_shards[0].data.shape)
out["q_devices"] = len(q.sharding.device_set)
out["values_equal"] = bool(all(np.array_equal(np.asarray(a), np.asarray(b))
                               for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(placed))))
count = placed_opt.count
out["count_devices"] = len(count.sharding.device_set)
out["mu_q_spec"] = str(placed_opt.inner_state[1][0].mu["layers"][0]["attn"]["q_proj"]["kernel"][...].sharding.spec)

# Per-group filtering statistics as a sharded reduction: rewards split over rows (data x fsdp = 4 shards).
rng = np.random.default_rng(0)
rewards = rng.normal(size=(8 * 4,)).astype(np.float32)
rows = sharding.shard_state(jnp.asarray(rewards), sharding.batch_sharding(mesh))
stats = jax.jit(lambda r: filtering.group_scores(r.reshape(8, 4), "reward_std"),
                out_shardings=sharding.replicated(mesh))(rows)
out["rewards_spec"] = str(rows.sharding.spec)
out["group_std"] = np.asarray(stats).tolist()
out["group_std_numpy"] = rewards.reshape(8, 4).std(axis=1, ddof=1).tolist()  # torch.std (unbiased), as RAGEN

# host_local_to_global with one process is a plain placement with rows over ('data', 'fsdp').
from ragen_jax.parallel.distributed import host_local_to_global
glob = host_local_to_global({"x": np.arange(16).reshape(8, 2)}, mesh)
out["host_global_spec"] = str(glob["x"].sharding.spec)
out["host_global_sum"] = int(jnp.sum(glob["x"]))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def placement():
    return run_script(PLACEMENT_SCRIPT, num_devices=8, timeout=300)


def test_placement_on_eight_devices(placement):
    assert placement["devices"] == 8
    assert placement["q_spec"] == "P('fsdp', 'tensor')"
    assert placement["q_shard_shape"] == [32, 32]  # [64, 4 heads * 16] split 2 x 2
    assert placement["q_devices"] == 8 and placement["values_equal"]
    assert placement["mu_q_spec"] == placement["q_spec"]
    assert placement["count_devices"] == 8  # the optimizer's step counter lives on the mesh too


def test_group_statistics_reduce_over_sharded_rows(placement):
    assert placement["rewards_spec"] == "P(('data', 'fsdp'),)"
    np.testing.assert_allclose(placement["group_std"], placement["group_std_numpy"], rtol=1e-5, atol=1e-6)
    assert placement["host_global_spec"] == "P(('data', 'fsdp'),)"
    assert placement["host_global_sum"] == sum(range(16))


# --------------------------------------------------- 2 training steps on 3 meshes vs 1 device (slow)
TRAINING_SCRIPT = """
import json, re
import jax, numpy as np
from ragen_jax.parallel import sharding
from ragen_jax.models.config import PRESETS, ModelConfig
PRESETS["sharding-test"] = ModelConfig(vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, tie_embeddings=False, max_position_embeddings=4096)
from configs.bandit import get_config
from ragen_jax.train.loop import build_run

c = get_config("ppo")
c.init = "random"  # no supervised warm start for this test model
c.model.preset = "sharding-test"
c.rollout.n_groups, c.rollout.group_size, c.rollout.max_new_tokens = 2, 4, 8   # 8 rows
c.algorithm.mini_batch_size, c.algorithm.micro_batch_size = 8, 4
c.algorithm.use_kl_loss = True                                                 # PPO + critic + reference

def train_two_steps(run, state):
    base, metrics, first = jax.random.key(c.seed), [], None
    for step in (1, 2):
        k_roll, _, k_upd = jax.random.split(jax.random.fold_in(base, step), 3)
        traj = run.rollout.run(state.actor, k_roll, run.rollout_cfg.train_seeds(step - 1))
        res = run.update_step(state, traj, k_upd)
        if first is None:
            first = (jax.tree.map(np.asarray, traj), k_upd, host(res.state.actor))
        state = res.state
        row = {k: float(v) for k, v in res.metrics.items()}
        row["train/episode_reward"] = float(np.asarray(traj.episode_reward).mean())
        metrics.append(row)
    return metrics, state, first

def host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]

def max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))

def metric_diff(m, ref):
    return max(abs(m[i][k] - ref[i][k]) / max(1.0, abs(ref[i][k])) for i in range(2) for k in ref[i])

run, state = build_run(c)
base_metrics, base_state, (traj1, key1, first_actor) = train_two_steps(run, state)
base_actor, base_critic = host(base_state.actor), host(base_state.critic)
out = {"rows": int(traj1.tokens.shape[0]), "meshes": {}}
spec = lambda x: str(x.sharding.spec)
for shape in [(8, 1, 1), (2, 4, 1), (2, 2, 2)]:
    mesh = sharding.make_mesh(shape)
    run, state = sharding.shard_run(*build_run(c), mesh)
    metrics, state, _ = train_two_steps(run, state)
    layer = state.actor["layers"][0]
    out["meshes"][str(shape)] = {
        "actor_diff": max_diff(host(state.actor), base_actor),
        "critic_diff": max_diff(host(state.critic), base_critic),
        "metric_diff": metric_diff(metrics, base_metrics),
        "q_spec": spec(layer["attn"]["q_proj"]["kernel"][...]),
        "down_spec": spec(layer["mlp"]["down_proj"]["kernel"][...]),
        "critic_q_spec": spec(state.critic["backbone"]["layers"][0]["attn"]["q_proj"]["kernel"][...]),
        "mu_q_spec": spec(state.actor_opt.inner_state[1][0].mu["layers"][0]["attn"]["q_proj"]["kernel"][...]),
        "count_devices": len(state.actor_opt.count.sharding.device_set),
        "traj_spec": str(run.update_step._traj_shardings.tokens.spec),
        "update_traces": run.update_step.traces, "rollout_traces": run.rollout.trace_count,
        "state_as_declared": all(
            x.sharding.is_equivalent_to(s, x.ndim)
            for tree, declared in ((state.actor, run.update_step.shardings.actor),
                                   (state.critic, run.update_step.shardings.critic),
                                   (state.actor_opt, run.update_step.shardings.actor_opt),
                                   (state.critic_opt, run.update_step.shardings.critic_opt))
            for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(declared))),
        # per-device K/V cache buffers [layers, rows, kv_heads, S, head_dim] of the compiled rollout
        "cache_shapes": sorted(set(re.findall(rf"f32\\[2,(\\d+),(\\d+),{run.rollout.cache_len},16\\]",
                                              run.rollout.compiled(False).as_text()))),
    }

# The lead's unwrapped jitted step, called with sharded inputs (no declared shardings).
mesh = sharding.make_mesh((2, 2, 2))
run, state = build_run(c)
raw_step = run.update_step
_, state = sharding.shard_run(run, state, mesh)
traj = sharding.shard_state(traj1, sharding.batch_shardings(traj1, mesh))
declared = sharding.param_shardings(state.actor, mesh, "train", run.rollout.model_cfg)
res = raw_step(state, traj, key1)
out["raw"] = {
    "metric_diff": max(abs(float(v) - base_metrics[0][k]) / max(1.0, abs(base_metrics[0][k]))
                       for k, v in res.metrics.items()),
    "actor_diff": max_diff(host(res.state.actor), host(first_actor)),
    # leaves whose output sharding XLA chose differently from the input's (why ShardedUpdateStep declares them)
    "changed_shardings": [sharding.path_string(p) for (p, x), s in zip(
        jax.tree_util.tree_leaves_with_path(res.state.actor), jax.tree.leaves(declared))
        if not x.sharding.is_equivalent_to(s, x.ndim)],
}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def mesh_training():
    return run_script(TRAINING_SCRIPT, num_devices=8, timeout=1500)


@pytest.mark.slow
@pytest.mark.parametrize("shape, q_spec, down_spec, traj_spec, cache_rows_heads", [
    ("(8, 1, 1)", "P(None, None)", "P(None, None)", "P('data',)", ["1", "2"]),
    ("(2, 4, 1)", "P('fsdp', None)", "P(None, 'fsdp')", "P(('data', 'fsdp'),)", ["1", "2"]),
    ("(2, 2, 2)", "P('fsdp', 'tensor')", "P('tensor', 'fsdp')", "P(('data', 'fsdp'),)", ["2", "1"]),
])
def test_two_training_steps_match_one_device(mesh_training, shape, q_spec, down_spec, traj_spec,
                                             cache_rows_heads):
    r = mesh_training["meshes"][shape]
    assert mesh_training["rows"] == 8
    assert r["actor_diff"] <= 1e-5 and r["critic_diff"] <= 1e-5, r
    assert r["metric_diff"] <= 1e-5, r
    assert r["q_spec"] == q_spec and r["down_spec"] == down_spec  # the mesh axes are really used
    assert r["critic_q_spec"] == q_spec and r["mu_q_spec"] == q_spec
    assert r["traj_spec"] == traj_spec and r["count_devices"] == 8
    assert r["update_traces"] == 1 and r["rollout_traces"] == 1  # compiled once for both steps
    assert r["state_as_declared"]  # every parameter and optimizer leaf keeps its declared sharding
    # The sampler runs in the sample layout: each device holds its rows (8 / (data * fsdp)) and its KV
    # heads (2 / tensor) of the cache, never the whole batch.
    assert cache_rows_heads in r["cache_shapes"] and not any(rows == "8" for rows, _ in r["cache_shapes"])


@pytest.mark.slow
def test_unwrapped_update_step_on_sharded_inputs(mesh_training):
    # The lead's jitted step, called as it is with sharded inputs, computes the same update; without
    # declared out_shardings XLA may hand back some leaves in another layout (seen: the RMSNorm weights
    # come back split over 'fsdp'), which is why ShardedUpdateStep declares them.
    raw = mesh_training["raw"]
    assert raw["metric_diff"] <= 1e-5 and raw["actor_diff"] <= 1e-5, raw
