"""Supervised warm start: train a policy on solver demonstrations, cache it, reuse it.

RL from random weights cannot discover a text format, so the embedded default (the ``tiny`` preset
with the character tokenizer) starts RL from a policy trained by supervised learning on
demonstrations (``ragen_jax.sft.demos``): solver actions with reasoning that states the facts they depend
on, plus a share ``sft.noisy_fraction`` of episodes with one random suboptimal turn, so the warm start
is good but not perfect and RL has room to improve (and a share ``sft.no_reasoning_fraction`` whose
responses leave the reasoning out: a second way of answering, for RL to choose between the two).

Training (``train_sft``): ``sft.demos`` demonstration episodes in the rollout's exact token layout;
``sft.steps`` AdamW steps (global-norm clip 1.0, weight decay 0.01, linear warm-up over the first 10%
of the steps, cosine decay to 10% of ``sft.lr``) of ``sft.batch_size`` whole episodes each, whose
gradient is summed over micro-batches of ``sft.micro_batch_size`` episodes (a ``lax.scan``: the working
memory of one micro-batch, not of the batch). The loss is the cross-entropy of the response tokens given
everything before them:

    loss = - sum_{b,t} mask[b,t] * log p(tokens[b,t] | tokens[b,<t]) / sum_{b,t} mask[b,t]

(mask = the tokens the rollout's loss_mask covers). A batch is drawn from one length bucket (episode
lengths rounded up to a multiple of ``sft.bucket`` tokens), so the jitted step (parameters are arguments)
compiles once per bucket and short episodes do not pay for long ones.

Cache (``build_warm_start``): ``sft.cache_dir/<env>-<hash>/`` where the hash covers everything that
changes the result (env name, params and demonstration format (``TextEnv.demo_format``), prompt style, max actions per turn, max turns and response
width, chat template, model preset, overrides and dtype, tokenizer, every ``sft.*`` setting but the cache dir
and the micro-batch size, which changes the result only by float rounding: sft.seed included, the RL seed
not). It holds ``checkpoint/`` (orbax, the parameters), ``sft_metrics.json`` (training curve,
demo statistics, validation success greedy and at the validation temperature) and ``COMPLETE``. It is
written into a temporary sibling directory and renamed into place, so an interrupted build is never
picked up; a directory without ``COMPLETE`` is rebuilt. A complete one whose contents do not load
(a truncated array file, unreadable metrics, a key or format mismatch, non-finite parameters) is
reported in one line on stderr, moved aside, deleted and rebuilt once. The directory gets the
process's umask-based permissions, like any directory the user creates.

Over 400 lines: training, validation and the atomic, self-healing cache of one artifact (the warm
start) share its key and layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from envs.registry import REGISTRY
from ragen_jax.models.logprobs import sequence_logprobs
from ragen_jax.models.transformer import Transformer
from ragen_jax.parallel.distributed import nonfinite_leaves
from ragen_jax.rl.losses import Weighted, accumulate, weighted_mean
from ragen_jax.rl.optim import in_float32
from ragen_jax.rollout.layout import rollout_config
from ragen_jax.rollout.validation import run_validation
from ragen_jax.setup.build import build_env, build_preset_model, build_tokenizer, model_overrides
from ragen_jax.setup.compile_memory import release_after_compiles
from ragen_jax.sft.demos import DemoEpisode, DemoWriter, demo_seeds, demo_stats
from ragen_jax.train.checkpoint import Checkpointer, one_line

FORMAT_VERSION = 2  # bump when demos or training change in a way the settings do not capture
BUCKET = 256  # default sft.bucket: lengths are padded up to a multiple of it (one compile per length)
LOG_EVERY = 25
WARMUP_FRACTION = 0.1
FINAL_LR_FRACTION = 0.1
WEIGHT_DECAY = 0.01
GRAD_CLIP = 1.0
# Episodes per forward / backward pass of a step. At FrozenLake's longest bucket (16 x 1,024 tokens, the
# tiny preset) the whole batch needs 1.99 GB of XLA temp memory, micro-batches of 4 about a quarter.
DEFAULT_MICRO_BATCH = 4
DEFAULT_VAL_EPISODES = 64
COMPLETE_MARKER = "COMPLETE"
METRICS_FILE = "sft_metrics.json"


@dataclasses.dataclass(frozen=True)
class SFTSettings:
    """The ``sft.*`` settings (configs/base.py documents each). val_episodes: held-out validation
    episodes per decoding mode (0: skip); seed: model init, demo noise and batch order."""

    demos: int = 1024
    noisy_fraction: float = 0.3
    steps: int = 120
    batch_size: int = 16
    lr: float = 1e-3
    val_episodes: int = DEFAULT_VAL_EPISODES
    seed: int = 0
    bucket: int = BUCKET
    micro_batch_size: int = DEFAULT_MICRO_BATCH
    no_reasoning_fraction: float = 0.0

    @classmethod
    def from_config(cls, config: Any) -> "SFTSettings":
        s = config.sft
        out = cls(int(s.demos), float(s.noisy_fraction), int(s.steps), int(s.batch_size), float(s.lr),
                  int(s.get("val_episodes", DEFAULT_VAL_EPISODES)), int(s.get("seed", 0)),
                  int(s.get("bucket", BUCKET)), int(s.get("micro_batch_size", DEFAULT_MICRO_BATCH)),
                  float(s.get("no_reasoning_fraction", 0.0)))
        for name in ("demos", "steps", "batch_size", "bucket", "micro_batch_size"):
            if getattr(out, name) < 1:
                raise ValueError(f"sft.{name} must be >= 1, got {getattr(out, name)}")
        if out.batch_size % min(out.micro_batch_size, out.batch_size):
            raise ValueError(f"sft.micro_batch_size ({out.micro_batch_size}) must divide sft.batch_size "
                             f"({out.batch_size})")
        if not out.lr > 0:
            raise ValueError(f"sft.lr must be > 0, got {out.lr}")
        for name in ("noisy_fraction", "no_reasoning_fraction"):
            if not 0.0 <= getattr(out, name) <= 1.0:
                raise ValueError(f"sft.{name} must be in [0, 1], got {getattr(out, name)}")
        if out.val_episodes < 0:
            raise ValueError(f"sft.val_episodes must be >= 0 (0 skips validation), got {out.val_episodes}")
        return out


# ----------------------------------------------------------------------------------------------------
# What the warm start is built from
# ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Parts:
    """The pieces of a run the warm start needs (built like the trainer builds them)."""

    tokenizer: Any
    env: Any
    env_params: Any
    rollout: Any  # RolloutConfig
    model: Transformer


def build_parts(config: Any) -> Parts:
    """Tokenizer, env, rollout settings and a freshly initialised model (seed ``config.sft.seed``)."""
    if config.model.hf_path or config.model.get("gguf_path", ""):
        raise ValueError(
            "the supervised warm start trains a preset model from scratch (the embedded default); with "
            "model.hf_path the pretrained checkpoint is the starting point: set config.init='random'"
        )
    tokenizer = build_tokenizer(config)
    env, env_params = build_env(config)
    model = build_preset_model(config, tokenizer, SFTSettings.from_config(config).seed)
    return Parts(tokenizer, env, env_params, rollout_config(config), model)


def write_demos(parts: Parts, settings: SFTSettings, seed: int) -> list[DemoEpisode]:
    writer = DemoWriter(parts.env, parts.env_params, parts.tokenizer, parts.rollout)
    return writer.write(demo_seeds(settings.demos), settings.noisy_fraction, rng_seed=seed,
                        no_reasoning_fraction=settings.no_reasoning_fraction)


# ----------------------------------------------------------------------------------------------------
# Batches, loss, step
# ----------------------------------------------------------------------------------------------------
def bucket_length(length: int, bucket: int = BUCKET) -> int:
    return -(-length // bucket) * bucket


class DemoBatches:
    """Random batches of whole episodes from one length bucket at a time.

    A bucket is drawn with probability proportional to its number of episodes, then ``batch_size``
    of its episodes (without replacement when it has enough). Returns (tokens int32[B, Lb],
    valid bool[B, Lb], loss_mask bool[B, Lb]) with Lb the bucket's length, rows right-padded.
    """

    def __init__(self, episodes: Sequence[DemoEpisode], batch_size: int, pad_id: int, seed: int,
                 bucket: int = BUCKET) -> None:
        if not episodes:
            raise ValueError("no demonstration episodes to train on; set sft.demos >= 1")
        self.episodes, self.batch_size, self.pad_id = list(episodes), batch_size, pad_id
        self.rng = np.random.default_rng(seed)
        groups: dict[int, list[int]] = {}
        for i, e in enumerate(self.episodes):
            groups.setdefault(bucket_length(e.length, bucket), []).append(i)
        self.lengths = sorted(groups)
        self.members = [groups[n] for n in self.lengths]
        counts = np.array([len(m) for m in self.members], np.float64)
        self.weights = counts / counts.sum()

    def next(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        k = int(self.rng.choice(len(self.lengths), p=self.weights))
        members, width = self.members[k], self.lengths[k]
        pick = self.rng.choice(members, self.batch_size, replace=len(members) < self.batch_size)
        tokens = np.full((self.batch_size, width), self.pad_id, np.int32)
        valid = np.zeros((self.batch_size, width), bool)
        mask = np.zeros((self.batch_size, width), bool)
        for row, i in enumerate(pick):
            e = self.episodes[int(i)]
            tokens[row, : e.length] = e.tokens
            valid[row, : e.length] = True
            mask[row, : e.length] = e.loss_mask
        return tokens, valid, mask


def sft_loss_sum(model: Transformer, tokens: jax.Array, valid: jax.Array, loss_mask: jax.Array) -> Weighted:
    """Weighted(sum of the loss-mask tokens' cross-entropies f32[], number of those tokens f32[]).

    tokens: int32[B, L]; valid, loss_mask: bool[B, L] (see the module docstring for the formula).
    """
    logp, _ = sequence_logprobs(model, tokens, valid)
    mask = (loss_mask & valid).astype(jnp.float32)
    return Weighted(-jnp.sum(logp * mask), jnp.sum(mask))


def sft_loss(model: Transformer, tokens: jax.Array, valid: jax.Array, loss_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(mean cross-entropy over the loss-mask tokens f32[], number of those tokens int32[])."""
    w = sft_loss_sum(model, tokens, valid, loss_mask)
    return weighted_mean(w), w.count.astype(jnp.int32)


def make_optimizer(lr: float, steps: int) -> optax.GradientTransformation:
    """clip_by_global_norm(1.0) then AdamW(weight decay 0.01) with warm-up + cosine decay, in float32."""
    warmup = max(1, int(WARMUP_FRACTION * steps))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, warmup_steps=warmup, decay_steps=max(steps, warmup + 1), end_value=lr * FINAL_LR_FRACTION)
    return in_float32(optax.chain(optax.clip_by_global_norm(GRAD_CLIP),
                                  optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=WEIGHT_DECAY)))


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                    micro_batch_size: int = DEFAULT_MICRO_BATCH) -> Callable:
    """jitted (params, opt_state, tokens, valid, loss_mask) -> (params, opt_state, loss, grad_norm).

    The batch's rows are split into micro-batches of ``micro_batch_size`` (it must divide B; B itself
    when larger); a ``lax.scan`` sums each one's Weighted(sum, count) loss and its gradient, and the step
    divides both by the batch's token count, so loss and gradient are the batch's mean up to rounding.
    Parameters and optimizer state are arguments (donated), so a new batch never recompiles; only a
    new bucket length does. ``step.trace_count`` counts traces.
    """

    def step(params, opt_state, tokens, valid, loss_mask):
        step.trace_count += 1
        micro = min(micro_batch_size, tokens.shape[0])
        split = lambda x: x.reshape((-1, micro) + x.shape[1:])  # noqa: E731  [B, L] -> [B / micro, micro, L]

        def micro_step(total, batch):
            def loss_sum(p):
                w = sft_loss_sum(nnx.merge(graphdef, p), *batch)
                return w.sum, w.count

            (loss, count), grads = jax.value_and_grad(loss_sum, has_aux=True)(params)
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
            return accumulate(total, (Weighted(loss, count), grads)), None

        # gradients sum in float32 whatever the parameter dtype (bf16 sums over micro-batches would drift)
        zero = (Weighted(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)),
                jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params))
        (total, grad_sum), _ = jax.lax.scan(micro_step, zero, (split(tokens), split(valid), split(loss_mask)))
        loss = weighted_mean(total)
        grads = jax.tree.map(lambda g: g / jnp.maximum(total.count, 1.0), grad_sum)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss, optax.tree.norm(grads)

    step.trace_count = 0
    jitted = jax.jit(step, donate_argnums=(0, 1))
    jitted.trace_count = lambda: step.trace_count  # type: ignore[attr-defined]
    return jitted


def train_on_demos(
    model: Transformer,
    episodes: Sequence[DemoEpisode],
    settings: SFTSettings,
    pad_id: int,
    seed: int = 0,
    log: Callable[[str], None] | None = print,
) -> tuple[nnx.State, dict[str, Any]]:
    """``settings.steps`` SFT steps on ``episodes`` from ``model``'s weights -> (params, metrics).

    Batch lengths are rounded up to a multiple of ``settings.bucket`` (one compile per distinct length)."""
    longest = max(e.length for e in episodes)
    if longest > model.cfg.max_position_embeddings:
        raise ValueError(
            f"a demonstration has {longest} tokens, more than the model's max_position_embeddings "
            f"{model.cfg.max_position_embeddings}; lower rollout.max_turns or use the compact prompt style"
        )
    graphdef, params = nnx.split(model)
    params = jax.tree.map(jnp.copy, params)  # the step donates its parameters; keep the caller's model intact
    tx = make_optimizer(settings.lr, settings.steps)
    opt_state = tx.init(params)
    step = make_train_step(graphdef, tx, settings.micro_batch_size)
    batches = DemoBatches(episodes, settings.batch_size, pad_id, seed, settings.bucket)
    losses, norms, tokens_seen = [], [], 0
    start = time.time()
    for i in range(1, settings.steps + 1):
        tokens, valid, mask = batches.next()
        params, opt_state, loss, norm = step(params, opt_state, tokens, valid, mask)
        losses.append(float(loss))
        norms.append(float(norm))
        tokens_seen += int(valid.sum())
        if not np.isfinite(losses[-1]):
            raise FloatingPointError(f"SFT loss became {losses[-1]} at step {i}; lower sft.lr (now {settings.lr})")
        if log is not None and (i % LOG_EVERY == 0 or i == settings.steps):
            elapsed = time.time() - start
            log(f"sft step {i}/{settings.steps}  loss {np.mean(losses[-LOG_EVERY:]):.4f}  "
                f"grad_norm {norms[-1]:.3f}  {tokens_seen / max(elapsed, 1e-9):.0f} tok/s  {elapsed:.0f}s")
    tail = max(1, min(10, len(losses)))
    metrics = {
        "loss_first": losses[0], "loss_last": float(np.mean(losses[-tail:])), "loss_curve": losses,
        "grad_norm_last": norms[-1], "train_seconds": time.time() - start, "tokens": tokens_seen,
        "buckets": batches.lengths, "compiles": step.trace_count(),
    }
    return params, metrics


def train_sft(
    config: Any, log: Callable[[str], None] | None = print, parts: Parts | None = None
) -> tuple[nnx.State, dict[str, Any]]:
    """Write the demonstrations and train the configured model on them -> (params, metrics).

    parts: ``build_parts(config)`` when the caller already has them."""
    settings = SFTSettings.from_config(config)
    parts = build_parts(config) if parts is None else parts
    t0 = time.time()
    episodes = write_demos(parts, settings, settings.seed)
    demo_seconds = time.time() - t0
    stats = demo_stats(episodes)
    if log is not None:
        log(f"sft: {len(episodes)} demonstrations in {demo_seconds:.0f}s; mean {stats['sequence_tokens']:.0f} "
            f"tokens (max {stats['max_sequence_tokens']:.0f}), {stats['turns']:.2f} turns, demo success "
            f"{stats['success']:.2f}")
    params, metrics = train_on_demos(parts.model, episodes, settings, parts.tokenizer.pad_id, settings.seed, log)
    metrics.update(demo_seconds=demo_seconds, demos=stats)
    return params, metrics


# ----------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------
def validate_params(parts: Parts, params: nnx.State, episodes: int, temperature: float, seed: int = 0,
                    seeds_per_batch: int = 64) -> dict[str, dict[str, float]]:
    """Validation rollouts on the held-out seeds ``rollout.val_seed + i``: greedy and at ``temperature``.

    Returns {"greedy": metrics, "temperature": metrics} (``ragen_jax.rollout.validation.validation_metrics``).
    """
    model = nnx.merge(nnx.split(parts.model)[0], params)
    out = {}
    for name, greedy in (("greedy", True), ("temperature", False)):
        metrics, _ = run_validation(
            model, parts.tokenizer, parts.env, parts.rollout, params, jax.random.key(seed),
            n_seeds=episodes, seeds_per_batch=min(seeds_per_batch, episodes), greedy=greedy,
            temperature=temperature, env_params=parts.env_params)
        out[name] = dict(metrics, temperature=0.0 if greedy else float(temperature))
    return out


# ----------------------------------------------------------------------------------------------------
# Cache
# ----------------------------------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    return value.to_dict() if hasattr(value, "to_dict") else value


def warm_start_key(config: Any) -> str:
    """"<env>-<16 hex digits>": a hash of every setting that changes the warm start."""
    sft = {k: v for k, v in _plain(config.sft).items() if k not in ("cache_dir", "micro_batch_size")}
    # At 0 it writes the demonstrations it wrote before it existed: warm starts built then keep their key.
    if not sft.get("no_reasoning_fraction"):
        sft.pop("no_reasoning_fraction", None)
    material = {
        "version": FORMAT_VERSION,
        "env": {"name": config.env.name, "prompt_style": config.env.prompt_style,
                "max_actions_per_turn": config.env.max_actions_per_turn, "params": _plain(config.env.params)},
        "rollout": {"max_turns": config.rollout.max_turns, "max_new_tokens": config.rollout.max_new_tokens},
        "model": {k: config.model.get(k) for k in ("preset", "dtype", "tokenizer", "chat_style", "hf_path")},
        "model_overrides": model_overrides(config),
        "sft": sft,  # includes sft.seed; the RL seed does not change the warm start
    }
    demo_format = getattr(REGISTRY.get(config.env.name), "demo_format", 1)
    if demo_format != 1:
        material["demo_format"] = demo_format
    digest = hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"{config.env.name}-{digest}"


def warm_start_path(config: Any) -> str:
    return os.path.join(os.path.abspath(config.sft.cache_dir), warm_start_key(config))


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE_MARKER))


def build_warm_start(config: Any, log: Callable[[str], None] | None = print) -> str:
    """The warm start's directory; trains, validates and writes it only when it is not cached yet
    (or when the cached one's metrics do not load: see ``_cached``)."""
    path, _ = _cached(config, log, lambda path: check_metrics(path, config))
    return path


def load_warm_start(config: Any, model: nnx.Module, log: Callable[[str], None] | None = print) -> nnx.State:
    """The warm-start parameters for ``model`` (built and cached first when missing, rebuilt when the
    cached parameters or metrics do not load)."""

    def load(path: str) -> nnx.State:
        check_metrics(path, config)
        return restore_params(path, model, key=warm_start_key(config))

    path, params = _cached(config, log, load)
    if log is not None:
        log(f"sft: warm start from {path}")
    return params


def _cached(config: Any, log: Callable[[str], None] | None, load: Callable[[str], Any]) -> tuple[str, Any]:
    """(path, load(path)) for the warm start of ``config``.

    A complete cached directory is loaded; if ``load`` raises anything, the directory is reported as
    damaged (one line on stderr: orbax / tensorstore tracebacks run to hundreds of lines), moved aside
    and rebuilt, and loaded again. A second failure is raised: a fresh build that does not load is a
    bug, not damage.
    """
    final = warm_start_path(config)
    if is_complete(final):
        identity = _identity(final)
        try:
            return final, load(final)
        except Exception as err:  # noqa: BLE001 - any failure to read the cache means: rebuild it
            print(f"warm start cache at {final} is damaged ({one_line(err)}); rebuilding",
                  file=sys.stderr, flush=True)
            _discard(final, identity)
    _build(config, log, final)
    return final, load(final)


def _identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of ``path``, or None when it is gone: tells a directory from its replacement."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _discard(final: str, identity: tuple[int, int] | None) -> None:
    """Move the damaged ``final`` aside (one atomic rename) and delete it.

    Only the directory that failed to load is moved: if a concurrent process already replaced it by a
    fresh build (another inode), that build is left in place and reused. A process still reading the
    damaged one keeps its open files (POSIX unlink semantics); its next open fails and it rebuilds too.
    """
    aside = os.path.join(os.path.dirname(final), f".damaged-{os.path.basename(final)}-{uuid.uuid4().hex}")
    if identity is None or _identity(final) != identity:
        return
    try:
        os.rename(final, aside)
    except FileNotFoundError:  # another process moved it first
        return
    shutil.rmtree(aside, ignore_errors=True)


def _build(config: Any, log: Callable[[str], None] | None, final: str) -> None:
    """Train, validate and write the warm start to ``final`` (unless a concurrent build finished it)."""
    if is_complete(final):
        return
    if os.path.exists(final):  # not written by this module's atomic rename: never trust it
        if log is not None:
            log(f"sft: {final} is incomplete; rebuilding it")
        shutil.rmtree(final)
    settings = SFTSettings.from_config(config)
    parts = build_parts(config)
    release_after_compiles()
    params, metrics = train_sft(config, log, parts)
    if settings.val_episodes:
        t0 = time.time()
        metrics["validation"] = validate_params(parts, params, settings.val_episodes,
                                                float(config.validation.temperature), settings.seed)
        metrics["validation_seconds"] = time.time() - t0
        if log is not None:
            v = metrics["validation"]
            log(f"sft validation on {settings.val_episodes} held-out episodes: success greedy "
                f"{v['greedy']['success']:.3f}, T={config.validation.temperature} {v['temperature']['success']:.3f}; "
                f"valid-format rate {v['greedy']['valid_action_rate']:.3f} / {v['temperature']['valid_action_rate']:.3f}")
    metrics["key"] = warm_start_key(config)
    _write_atomically(final, params, metrics)


def _write_atomically(final: str, params: nnx.State, metrics: dict) -> None:
    """Write into a temporary sibling, mark it COMPLETE, rename it into place (atomic on one filesystem)."""
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    # os.mkdir with 0o777 applies the umask (tempfile.mkdtemp would force 0700 onto the cache).
    tmp = os.path.join(parent, f".tmp-{os.path.basename(final)}-{uuid.uuid4().hex}")
    os.mkdir(tmp, 0o777)
    try:
        ckpt = Checkpointer(os.path.join(tmp, "checkpoint"), keep=1)
        ckpt.save(0, nnx.to_pure_dict(params), {"key": metrics["key"], "format_version": FORMAT_VERSION})
        ckpt.close()
        with open(os.path.join(tmp, METRICS_FILE), "w") as f:
            json.dump(metrics, f, indent=2, default=float)
        with open(os.path.join(tmp, COMPLETE_MARKER), "w") as f:
            f.write("ok\n")
        try:
            os.rename(tmp, final)
        except OSError:
            if not is_complete(final):  # a concurrent builder won the race only if it finished
                raise
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)


def check_metrics(path: str, config: Any) -> dict:
    """The warm start's metrics, checked to belong to ``config`` (raises ValueError otherwise)."""
    metrics = read_metrics(path)
    if not isinstance(metrics, dict) or metrics.get("key") != warm_start_key(config):
        raise ValueError(f"{METRICS_FILE} does not belong to warm start {warm_start_key(config)}")
    return metrics


def restore_params(path: str, model: nnx.Module, key: str | None = None) -> nnx.State:
    """The parameters saved under ``path`` (a warm-start directory), shaped like ``model``'s.

    Raises when the directory is not complete, its checkpoint does not restore, its meta does not
    match ``key`` (when given) or ``FORMAT_VERSION``, or a parameter is NaN / infinite.
    """
    if not is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete warm start; build it with build_warm_start(config)")
    _, template = nnx.split(model)
    ckpt = Checkpointer(os.path.join(path, "checkpoint"), keep=1)
    try:
        pure, meta, _ = ckpt.restore(nnx.to_pure_dict(template))
    finally:
        ckpt.close()
    if meta.get("format_version") != FORMAT_VERSION or (key is not None and meta.get("key") != key):
        raise ValueError(f"checkpoint meta {meta} does not match warm start {key} (format {FORMAT_VERSION})")
    bad = nonfinite_leaves(pure)
    if bad:
        raise ValueError(f"non-finite parameters: {', '.join(bad[:3])}")
    nnx.replace_by_pure_dict(template, pure)
    return template


def read_metrics(path: str) -> dict:
    with open(os.path.join(path, METRICS_FILE)) as f:
        return json.load(f)
