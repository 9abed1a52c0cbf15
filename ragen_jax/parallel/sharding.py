"""Mesh, logical partition rules and sharded wrappers of the rollout and the update.

One mesh over all devices (of all hosts) with axes ``('data', 'fsdp', 'tensor')``; sizes from
``config.mesh`` (-1 = the rest). Arrays are placed by *logical* axes, mapped to mesh axes by a rules table:

    logical axis   train layout          sample layout       what carries it
    batch          ('data', 'fsdp')      ('data', 'fsdp')    trajectory rows, KV-cache rows, activations
    embed          'fsdp'                (replicated)        the hidden dimension d of every weight
    vocab          'tensor'              'tensor'            embedding rows, LM-head columns, logits
    heads          'tensor'              'tensor'            q / o projections (H * head_dim)
    kv_heads       'tensor'              'tensor'            k / v projections, KV-cache heads
    mlp            'tensor'              'tensor'            SwiGLU width
    (others)       replicated            replicated          norms, scalars, cache slots, head_dim

Why the sampler uses a different layout: decoding is memory-bound and runs ``max_new_tokens``
sequential steps per turn. With FSDP every step would all-gather every weight (params bytes of
traffic per token); replicating over 'fsdp' for the rollout costs one all-gather per policy update
instead (``ShardedRollout`` reshards the actor once per step). 'tensor' stays in both layouts: it
splits the weights' memory and the per-step weight reads without any regathering.

A dimension that the mapped mesh axes do not divide is replicated instead (with a logged note), e.g.
Qwen2.5-0.5B's 14 heads on tensor=4. Optimizer-state leaves follow their parameter because the rules
match the *end* of a leaf's path (AdamW's ``mu/layers/0/attn/q_proj/kernel`` is sharded like
``layers/0/attn/q_proj/kernel``); scalars (step counters, hyperparameters) are replicated on the mesh,
which matters: an optimizer count left on one device makes the jitted step fail on a mesh.

Entry points: ``make_mesh``, ``param_shardings``, ``batch_shardings``, ``cache_shardings``,
``shard_state``, ``state_shardings``; ``ShardedUpdateStep`` / ``ShardedRollout`` (jitted with declared in/out
shardings) and ``shard_run(run, state, mesh)``, which puts a ``train.loop.Run`` and its ``rl.state.TrainState``
on a mesh.

Over 400 lines: the mesh and rules table, then the sharded wrappers of the rollout and the update
(docs/architecture.md notes moving the wrappers into train/).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ragen_jax.models.kv_cache import KVCache
from ragen_jax.rl.state import TrainState
from ragen_jax.rl.update import UpdateResult

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# logical axis -> mesh axes (None = replicated).
TRAIN_RULES: dict[str, Any] = {
    "batch": BATCH_AXES, "embed": "fsdp", "vocab": "tensor", "heads": "tensor", "kv_heads": "tensor",
    "mlp": "tensor", "norm": None, "layers": None, "seq": None, "head_dim": None, "cache_slots": None,
}
SAMPLE_RULES: dict[str, Any] = {**TRAIN_RULES, "embed": None}
LAYOUTS = {"train": TRAIN_RULES, "sample": SAMPLE_RULES}

# Parameter path (``a/b/0/c``, matched at its end) -> logical axes of the array's dimensions.
# Qwen2 / Llama (ragen_jax.models.transformer) and the critic (ragen_jax.models.critic).
PARAM_PATTERNS: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"(^|/)embed/embedding$", ("vocab", "embed")),          # [V, d]
    (r"attn/q_proj/kernel$", ("embed", "heads")),            # [d, H * hd]
    (r"attn/q_proj/bias$", ("heads",)),                      # [H * hd]
    (r"attn/[kv]_proj/kernel$", ("embed", "kv_heads")),      # [d, Hkv * hd]
    (r"attn/[kv]_proj/bias$", ("kv_heads",)),                # [Hkv * hd]
    (r"attn/o_proj/kernel$", ("heads", "embed")),            # [H * hd, d]
    (r"mlp/(gate|up)_proj/kernel$", ("embed", "mlp")),       # [d, I]
    (r"mlp/down_proj/kernel$", ("mlp", "embed")),            # [I, d]
    (r"lm_head/kernel$", ("embed", "vocab")),                # [d, V]
    (r"value_head/kernel$", ("embed", None)),                # [d, 1]
    (r"value_head/bias$", (None,)),                          # [1]
    (r"norm/weight$", ("norm",)),                            # [d]
)

# Activations and caches (logical axes per dimension), for with_sharding_constraint in kernels and for
# the KV cache placement below.
ACTIVATION_AXES: dict[str, tuple[str | None, ...]] = {
    "tokens": ("batch", "seq"),                          # int32[B, L] (and every per-token buffer)
    "rows": ("batch",),                                  # per-row scalars [B]
    "hidden": ("batch", "seq", None),                    # [B, T, d]: d gathered (fsdp shards weights only)
    "q": ("batch", "heads", "seq", "head_dim"),          # [B, H, T, hd]
    "kv": ("batch", "kv_heads", "seq", "head_dim"),      # [B, Hkv, T, hd]
    "mlp": ("batch", "seq", "mlp"),                      # [B, T, I]
    "logits": ("batch", "seq", "vocab"),                 # [B, T, V]
    "cache_kv": ("layers", "batch", "kv_heads", "cache_slots", "head_dim"),  # [layers, B, Hkv, S, hd]
    "cache_slot_valid": ("batch", "cache_slots"),        # bool[B, S]
}


# ------------------------------------------------------------------------------------------------ mesh
def mesh_shape(sizes: Sequence[int], num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) with at most one -1 replaced by the rest; the product must be num_devices."""
    sizes = [int(s) for s in sizes]
    if len(sizes) != 3:
        raise ValueError(f"mesh sizes are (data, fsdp, tensor); got {sizes}")
    free = [i for i, s in enumerate(sizes) if s == -1]
    if len(free) > 1:
        raise ValueError(f"at most one of config.mesh.data/fsdp/tensor may be -1 (the rest); got {sizes}")
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"config.mesh sizes must be positive or -1; got {sizes}")
    fixed = int(np.prod([s for s in sizes if s != -1]))
    if free:
        if num_devices % fixed:
            raise ValueError(
                f"config.mesh {dict(zip(MESH_AXES, sizes))}: the fixed sizes multiply to {fixed}, which does not "
                f"divide the {num_devices} devices; choose sizes whose product divides {num_devices}")
        sizes[free[0]] = num_devices // fixed
    if int(np.prod(sizes)) != num_devices:
        raise ValueError(
            f"config.mesh {dict(zip(MESH_AXES, sizes))} needs {int(np.prod(sizes))} devices but there are "
            f"{num_devices}; set one of config.mesh.data/fsdp/tensor to -1 to use the rest")
    return tuple(sizes)  # type: ignore[return-value]


def _sizes_from(config_or_sizes: Any) -> tuple[int, int, int]:
    if config_or_sizes is None:
        return (-1, 1, 1)
    if isinstance(config_or_sizes, (tuple, list)):
        return tuple(config_or_sizes)  # type: ignore[return-value]
    node = config_or_sizes.mesh if hasattr(config_or_sizes, "mesh") else config_or_sizes
    get = node.get if isinstance(node, Mapping) or hasattr(node, "get") else lambda k, d: getattr(node, k, d)
    return (get("data", -1), get("fsdp", 1), get("tensor", 1))


def make_mesh(config_or_sizes: Any = None, devices: Sequence[Any] | None = None) -> Mesh:
    """The ('data', 'fsdp', 'tensor') mesh over ``devices`` (default: all devices of all processes).

    config_or_sizes: the run config (reads ``config.mesh.data/fsdp/tensor``), its ``mesh`` node, a dict,
    or a (data, fsdp, tensor) tuple; -1 = the rest; None = all devices on 'data'.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(_sizes_from(config_or_sizes), len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_spec(mesh: Mesh) -> str | tuple[str, ...] | None:
    """The mesh axes rows are split over: ('data', 'fsdp') without the axes of size 1."""
    return _axes_entry(BATCH_AXES, mesh)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows over ('data', 'fsdp'), every other dimension replicated."""
    return NamedSharding(mesh, PartitionSpec(batch_spec(mesh)))


def batch_shards(mesh: Mesh) -> int:
    return int(mesh.shape["data"] * mesh.shape["fsdp"])


# ----------------------------------------------------------------------------------- logical -> spec
def _axes_entry(axes: Any, mesh: Mesh) -> str | tuple[str, ...] | None:
    """Mesh axes of one dimension with the size-1 axes dropped (None when nothing splits)."""
    if axes is None:
        return None
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    kept = tuple(a for a in axes if mesh.shape[a] > 1)
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else kept


def logical_to_spec(
    shape: Sequence[int], logical: Sequence[str | None], mesh: Mesh, rules: Mapping[str, Any] = TRAIN_RULES,
    *, what: str = "array", units: Mapping[str, int] | None = None,
) -> PartitionSpec:
    """PartitionSpec of an array whose dimensions carry ``logical`` axes.

    A dimension the mapped mesh axes do not divide is replicated (logged), as is a mesh axis already
    used by an earlier dimension. units: logical axis -> the number of whole units along it that a split
    must not cut (``{"heads": H, "kv_heads": Hkv}``: q_proj's H * head_dim columns split on head
    boundaries only, so attention needs no regathering).
    """
    if len(logical) != len(shape):
        raise ValueError(f"{what}: {len(logical)} logical axes {tuple(logical)} for shape {tuple(shape)}")
    used: set[str] = set()
    entries = []
    for size, name in zip(shape, logical):
        if name is not None and name not in rules:
            raise ValueError(f"{what}: unknown logical axis {name!r}; known: {sorted(rules)}")
        entry = _axes_entry(rules.get(name) if name else None, mesh)
        axes = () if entry is None else ((entry,) if isinstance(entry, str) else entry)
        split = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        unit = (units or {}).get(name, size) if name else size
        if axes and (size % split or unit % split or used & set(axes)):
            log.info("%s: dimension %s (size %d, %d units) not split over %s of size %d (does not divide it); "
                     "replicated", what, name, size, unit, axes, split)
            entry, axes = None, ()
        used |= set(axes)
        entries.append(entry)
    return PartitionSpec(*entries)


def path_string(path: Sequence[Any]) -> str:
    """'layers/0/attn/q_proj/kernel' from a pytree key path (nnx ``.value`` attributes dropped)."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            if key.name != "value":
                parts.append(key.name)
        else:
            parts.append(str(getattr(key, "key", key)))
    return "/".join(parts)


def logical_axes_of(path: str, ndim: int) -> tuple[str | None, ...] | None:
    """The logical axes of the parameter (or optimizer-state leaf) at ``path``; None when no rule matches."""
    for pattern, axes in PARAM_PATTERNS:
        if re.search(pattern, path) and len(axes) == ndim:
            return axes
    return None


def head_units(model_cfg: Any) -> dict[str, int] | None:
    """{"heads": H, "kv_heads": Hkv} of a ``ModelConfig`` (None when not given)."""
    if model_cfg is None:
        return None
    return {"heads": int(model_cfg.num_heads), "kv_heads": int(model_cfg.num_kv_heads)}


def param_shardings(tree: Any, mesh: Mesh, layout: str = "train", model_cfg: Any = None) -> Any:
    """A pytree of NamedSharding, one per leaf of ``tree`` (params, optimizer state, any nnx State).

    layout: "train" (fsdp shards the embed dimension) or "sample" (replicated over fsdp; see the module
    docstring). model_cfg (a ``ModelConfig``, optional): head projections split over 'tensor' only on
    whole heads (num_heads / num_kv_heads divisible by the tensor size), otherwise replicated. Leaves no
    rule matches (scalars, counters, hyperparameters, unknown arrays) are replicated; an unknown array
    of rank >= 1 is logged.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}; got {layout!r}")
    rules = LAYOUTS[layout]
    units = head_units(model_cfg)

    def one(path, leaf):
        shape = np.shape(leaf)
        name = path_string(path)
        axes = logical_axes_of(name, len(shape))
        if axes is None:
            if len(shape) >= 1 and int(np.prod(shape)) > 1:
                log.info("no sharding rule for %s %s; replicated", name, shape)
            return replicated(mesh)
        return NamedSharding(mesh, logical_to_spec(shape, axes, mesh, rules, what=name, units=units))

    return jax.tree_util.tree_map_with_path(one, tree)


def check_rows(rows: int, mesh: Mesh, what: str = "the batch") -> None:
    shards = batch_shards(mesh)
    if rows % shards:
        raise ValueError(
            f"{what} has {rows} rows, not a multiple of mesh data * fsdp = {shards}; change "
            f"rollout.n_groups * rollout.group_size or config.mesh so that the rows split evenly")


def batch_shardings(tree: Any, mesh: Mesh) -> Any:
    """NamedSharding per leaf of a batch pytree (e.g. ``Trajectories``): rows (dim 0) over ('data', 'fsdp').

    Scalars are replicated. Raises when a leaf's row count does not split over the batch axes.
    """
    def one(path, leaf):
        shape = np.shape(leaf)
        if not shape:
            return replicated(mesh)
        check_rows(shape[0], mesh, f"batch leaf {path_string(path) or 'array'}")
        return batch_sharding(mesh)

    return jax.tree_util.tree_map_with_path(one, tree)


def cache_shardings(cache: Any, mesh: Mesh, layout: str = "sample") -> Any:
    """Shardings of a ``KVCache`` (or ``SamplerState``'s cache): rows over ('data', 'fsdp'), KV heads over
    'tensor' when it divides them (else replicated, logged); ``end`` replicated.

    k, v: [layers, B, Hkv, S, hd]; slot_valid: bool[B, S]; next_pos: int32[B]; end: int32[].
    """
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache_shardings takes a KVCache; got {type(cache).__name__}")
    check_rows(cache.k.shape[1], mesh, "the KV cache")
    rules = LAYOUTS[layout]
    kv = NamedSharding(mesh, logical_to_spec(cache.k.shape, ACTIVATION_AXES["cache_kv"], mesh, rules,
                                             what="KV cache"))
    return KVCache(
        k=kv, v=kv,
        slot_valid=NamedSharding(mesh, logical_to_spec(cache.slot_valid.shape, ACTIVATION_AXES["cache_slot_valid"],
                                                       mesh, rules, what="KV cache slot_valid")),
        end=replicated(mesh),
        next_pos=batch_sharding(mesh),
    )


def activation_sharding(name: str, shape: Sequence[int], mesh: Mesh, layout: str = "train") -> NamedSharding:
    """NamedSharding of the activation ``name`` (a key of ACTIVATION_AXES) of the given shape."""
    if name not in ACTIVATION_AXES:
        raise ValueError(f"unknown activation {name!r}; known: {sorted(ACTIVATION_AXES)}")
    return NamedSharding(mesh, logical_to_spec(shape, ACTIVATION_AXES[name], mesh, LAYOUTS[layout], what=name))


# ------------------------------------------------------------------------------------------ placement
def _global_array(x: Any, sharding: NamedSharding) -> jax.Array:
    """Place one host value (the same on every process) on a possibly multi-process sharding."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(x)
        return jax.random.wrap_key_data(_global_array(jax.random.key_data(x), sharding), impl=impl)
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, sharding)  # global -> global reshard
    value = np.asarray(x)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def shard_state(tree: Any, shardings: Any) -> Any:
    """Place every leaf of ``tree`` with the matching leaf of ``shardings`` (a pytree prefix works).

    Single process: ``jax.device_put``. Several processes: each process must hold the same full value
    (as after a seeded init); each then builds its own shards of the global array.
    """
    return jax.tree.map(lambda s, x: _global_array(x, s), shardings, tree,
                        is_leaf=lambda s: isinstance(s, NamedSharding))


def shardings_of(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.sharding, tree)


def describe(tree: Any) -> dict[str, str]:
    """{path: str(PartitionSpec)} of a placed pytree (logs, tests)."""
    return {path_string(p): str(getattr(x.sharding, "spec", x.sharding))
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}


# ------------------------------------------------------------------------------------- sharded steps
def state_shardings(state: TrainState, mesh: Mesh, model_cfg: Any = None) -> TrainState:
    """A ``TrainState`` of NamedSharding: actor, critic, optimizer states and ref in the train layout
    (``param_shardings``), the MI EMA state replicated; None where the state has None."""
    sh = lambda tree: param_shardings(tree, mesh, "train", model_cfg)  # noqa: E731
    return state.replace(actor=sh(state.actor), critic=sh(state.critic), actor_opt=sh(state.actor_opt),
                         critic_opt=sh(state.critic_opt), ref=sh(state.ref),
                         mi_ema=jax.tree.map(lambda _: replicated(mesh), state.mi_ema))


class ShardedUpdateStep:
    """The update step (``update.make_update_step``) jitted with declared shardings on a mesh.

    Jits the inner ``program(trained, ref, traj, key, horizon)`` (horizon static) with in: the trained part (actor, critic, optimizer
    states) and ref in ``shardings`` (``state_shardings``: the train layout), trajectories with rows over
    ('data', 'fsdp'), the key replicated;  out: the trained part in the same shardings, metrics replicated.
    The trained part is donated, as in the unsharded step. The batch is cropped to its bucket width first
    (``UpdateStep.fit_width``; the row shardings do not depend on the width). The inner step's body is
    traced inside this jit, so its ``traces`` counter still counts compiles. Same call signature and result:
    ``step(state, traj, key) -> UpdateResult(state, metrics)``.
    """

    def __init__(self, update_step: Any, mesh: Mesh, shardings: TrainState):
        self.inner, self.mesh, self.shardings = update_step, mesh, shardings
        self._jitted = None
        self._traj_shardings = None

    @property
    def traces(self) -> int:
        return self.inner.traces

    def _build(self, traj):
        self._traj_shardings = batch_shardings(traj, self.mesh)
        s, rep = self.shardings, replicated(self.mesh)
        self._jitted = jax.jit(self.inner.program, in_shardings=(s.trained(), s.ref, self._traj_shardings, rep),
                               out_shardings=(s.trained(), rep), donate_argnums=0, static_argnums=4)

    def __call__(self, state: TrainState, traj, key) -> UpdateResult:
        horizon, traj = traj.seq_len, self.inner.fit_width(traj)
        if self._jitted is None:
            self._build(traj)
        traj = shard_state(traj, self._traj_shardings)
        key = _global_array(key, replicated(self.mesh))
        trained, metrics = self._jitted(state.trained(), state.ref, traj, key, horizon)
        return UpdateResult(state.replace(**trained), metrics)


class ShardedRollout:
    """A ``rollout.Rollout`` whose fused program runs on the mesh in the sample layout.

    ``run(params, key, seeds, ...)`` takes train-layout (or any) params, reshards them once to the
    sample layout, and runs the fused rollout jitted with those input shardings, the trajectory rows
    constrained to ('data', 'fsdp') inside (each device decodes its rows) and the output replicated,
    so host code (metrics, sample texts) reads it on every process; the update step slices its rows.
    Host-mode rollouts delegate to the wrapped rollout. Other attributes are the wrapped rollout's.
    """

    def __init__(self, rollout: Any, mesh: Mesh):
        self.inner, self.mesh = rollout, mesh
        self._executables: dict[bool, Any] = {}
        self._param_shardings = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def sample_params(self, params: Any) -> Any:
        """``params`` placed in the sample layout (a no-op when they already are)."""
        if self._param_shardings is None:
            self._param_shardings = param_shardings(params, self.mesh, "sample", self.inner.model_cfg)
        return shard_state(params, self._param_shardings)

    def _build(self, greedy: bool, params_sh, env_params):
        rollout, rep = self.inner, replicated(self.mesh)
        check_rows(rollout.config.batch, self.mesh, "the rollout batch (n_groups * group_size)")
        rows = batch_sharding(self.mesh)

        def body(params, env_params, key, seeds, temperature):
            traj = rollout._fused_rollout(params, env_params, key, seeds, temperature, greedy)
            return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, rows if x.ndim else rep), traj)

        env_sh = jax.tree.map(lambda _: rep, env_params)
        return jax.jit(body, in_shardings=(params_sh, env_sh, rep, rep, rep), out_shardings=rep)

    def run(self, params, key, seeds, temperature=None, env_params=None, greedy: bool = False,
            mode: str | None = None, timer: dict[str, float] | None = None):
        rollout = self.inner
        mode = rollout.config.mode if mode is None else mode
        params = self.sample_params(params)
        if mode != "fused" or rollout.config.context_mode == "limited":
            return rollout.run(params, key, seeds, temperature, env_params, greedy, mode, timer)
        seeds = np.asarray(seeds, np.int32)
        if seeds.shape != (rollout.config.n_groups,):
            raise ValueError(f"seeds must have shape ({rollout.config.n_groups},) (one per group), got {seeds.shape}")
        temperature = rollout.config.temperature if temperature is None else temperature
        env_params = rollout.env_params if env_params is None else env_params
        rep = replicated(self.mesh)
        put = lambda x: _global_array(x, rep)  # noqa: E731
        args = (params, jax.tree.map(put, env_params), put(key), put(seeds), put(np.float32(temperature)))
        return self.compiled(greedy, *args)(*args)

    def compiled(self, greedy: bool, *args: Any) -> Any:
        """The compiled sharded program (ahead of time on first use; ``.as_text()`` shows the per-device
        shapes, ``.memory_analysis()`` the memory). args: (params, env_params, key, seeds, temperature)."""
        if greedy not in self._executables:
            self._executables[greedy] = self._build(greedy, self._param_shardings, args[1]).lower(*args).compile()
        return self._executables[greedy]


def shard_run(run: Any, state: TrainState, mesh: Mesh) -> tuple[Any, TrainState]:
    """Put a ``train.loop.Run`` and its ``TrainState`` on ``mesh``.

    Returns (run', state'): run' has ``rollout`` = ShardedRollout and ``update_step`` = ShardedUpdateStep;
    state' holds the same values placed in the train layout (actor, critic, optimizer states, ref; the
    MI EMA state replicated). Checkpoints restored with ``state'.tree()`` as the template come back
    with these shardings.
    """
    shardings = state_shardings(state, mesh, getattr(run.rollout, "model_cfg", None))
    new_run = dataclasses.replace(run, rollout=ShardedRollout(run.rollout, mesh),
                                  update_step=ShardedUpdateStep(run.update_step, mesh, shardings))
    return new_run, shard_state(state, shardings)


__all__ = [
    "MESH_AXES", "BATCH_AXES", "TRAIN_RULES", "SAMPLE_RULES", "PARAM_PATTERNS", "ACTIVATION_AXES", "mesh_shape",
    "make_mesh", "replicated", "batch_spec", "batch_sharding", "batch_shards", "logical_to_spec", "path_string",
    "logical_axes_of", "head_units", "param_shardings", "check_rows", "batch_shardings", "cache_shardings",
    "activation_sharding", "shard_state", "shardings_of", "describe", "state_shardings", "ShardedUpdateStep",
    "ShardedRollout", "shard_run",
]
