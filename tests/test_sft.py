"""Supervised warm start: the loss, training, batching and the cache.

The loss is checked against a plain numpy cross-entropy over the model's full logits; training on a
small model (d=64, 2 layers) must lower it; the cache must be reused, keyed by the settings, and never
taken from a half-written directory.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from configs.frozen_lake import get_config
from envs.frozen_lake import FrozenLake
from ragen_jax.sft import warm_start as sft
from ragen_jax.sft.demos import DemoWriter, demo_seeds
from ragen_jax.models.config import get_preset
from ragen_jax.models.tokenizers import CharTokenizer
from ragen_jax.models.transformer import Transformer
from ragen_jax.rollout.layout import RolloutConfig

TOK = CharTokenizer()
SMALL_OVERRIDES = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
SMALL = get_preset("tiny", **SMALL_OVERRIDES)


@pytest.fixture(scope="module")
def episodes():
    config = RolloutConfig(max_turns=2, max_new_tokens=96, prompt_style="compact")
    return DemoWriter(FrozenLake(), None, TOK, config).write(demo_seeds(6), noisy_fraction=0.3)


def small_model(seed: int = 0) -> Transformer:
    return Transformer(SMALL, rngs=nnx.Rngs(seed))


def numpy_cross_entropy(model, tokens, valid, mask) -> float:
    """-mean over masked positions t of log softmax(logits[t-1])[tokens[t]] (rows are right-padded)."""
    logits = np.asarray(model(jnp.asarray(tokens), jnp.asarray(valid))[0], np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logsoft = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    total, count = 0.0, 0
    for b in range(tokens.shape[0]):
        for t in range(1, tokens.shape[1]):
            if mask[b, t] and valid[b, t]:
                total -= logsoft[b, t - 1, tokens[b, t]]
                count += 1
    return total / count


def test_batches_hold_whole_episodes_in_their_bucket(episodes):
    batches = sft.DemoBatches(episodes, batch_size=3, pad_id=TOK.pad_id, seed=0, bucket=128)
    for _ in range(4):
        tokens, valid, mask = batches.next()
        assert tokens.shape[1] % 128 == 0 and tokens.shape[1] in batches.lengths
        for row in range(3):
            n = int(valid[row].sum())
            match = [e for e in episodes if e.length == n and np.array_equal(e.tokens, tokens[row, :n])]
            assert match and np.array_equal(mask[row, :n], match[0].loss_mask)
            assert not valid[row, n:].any() and (tokens[row, n:] == TOK.pad_id).all()
            assert tokens.shape[1] - 128 < n <= tokens.shape[1]


def test_sft_loss_is_the_response_cross_entropy(episodes):
    model = small_model()
    batches = sft.DemoBatches(episodes, batch_size=2, pad_id=TOK.pad_id, seed=1)
    tokens, valid, mask = batches.next()
    loss, count = sft.sft_loss(model, jnp.asarray(tokens), jnp.asarray(valid), jnp.asarray(mask))
    assert int(count) == int(mask.sum())
    np.testing.assert_allclose(float(loss), numpy_cross_entropy(model, tokens, valid, mask), rtol=1e-5)


def test_micro_batches_give_the_whole_batch_step_up_to_rounding(episodes):
    """The step sums (loss sum, token count, gradient) over micro-batches and divides once: loss and
    gradient norm equal the whole batch's within float32 summation round-off (a few ulps of the
    per-token terms, far below 1e-5 relative), and so do the parameters after one AdamW step except
    where a gradient component is itself at round-off level (Adam's first step moves every weight by
    about lr, its sign the gradient's), hence the comparison through the loss after the step."""
    model = small_model()
    graphdef, params = nnx.split(model)
    tx = sft.make_optimizer(1e-3, 10)
    batch = tuple(map(jnp.asarray, sft.DemoBatches(episodes, batch_size=4, pad_id=TOK.pad_id, seed=2).next()))
    results = {}
    for micro in (4, 2, 1):
        step = sft.make_train_step(graphdef, tx, micro)
        p, _, loss, norm = step(jax.tree.map(jnp.copy, params), tx.init(params), *batch)
        results[micro] = (float(loss), float(norm), float(sft.sft_loss(nnx.merge(graphdef, p), *batch)[0]))
    np.testing.assert_allclose(results[4][0], numpy_cross_entropy(model, *map(np.asarray, batch)), rtol=1e-5)
    for micro in (2, 1):
        np.testing.assert_allclose(results[micro], results[4], rtol=1e-5)


def test_a_few_steps_lower_the_loss_and_compile_once_per_bucket(episodes):
    model = small_model()
    settings = sft.SFTSettings(demos=len(episodes), steps=12, batch_size=4, lr=3e-3, bucket=16)
    fixed = sft.DemoBatches(episodes, batch_size=4, pad_id=TOK.pad_id, seed=5).next()
    before = float(sft.sft_loss(model, *map(jnp.asarray, fixed))[0])
    params, metrics = sft.train_on_demos(model, episodes, settings, TOK.pad_id, seed=0, log=None)
    after = float(sft.sft_loss(nnx.merge(nnx.split(model)[0], params), *map(jnp.asarray, fixed))[0])
    assert after < before - 0.5, (before, after)
    assert metrics["loss_last"] < metrics["loss_first"]
    assert metrics["compiles"] <= len(metrics["buckets"])
    assert all(length % 16 == 0 for length in metrics["buckets"])
    # The caller's model is untouched (the step donates a copy).
    assert float(sft.sft_loss(model, *map(jnp.asarray, fixed))[0]) == pytest.approx(before)


def test_bad_settings_raise_clear_errors():
    config = get_config()
    config.sft.steps = 0
    with pytest.raises(ValueError, match="sft.steps"):
        sft.SFTSettings.from_config(config)
    config = get_config()
    config.sft.bucket = 0
    with pytest.raises(ValueError, match="sft.bucket"):
        sft.SFTSettings.from_config(config)
    config = get_config()
    config.sft.lr = 0.0
    with pytest.raises(ValueError, match="sft.lr"):
        sft.SFTSettings.from_config(config)
    config = get_config()
    config.sft.micro_batch_size = 3
    with pytest.raises(ValueError, match="sft.micro_batch_size .3. must divide sft.batch_size .16."):
        sft.SFTSettings.from_config(config)
    with pytest.raises(ValueError, match="noisy_fraction"):
        DemoWriter(FrozenLake(), None, TOK, RolloutConfig(max_new_tokens=96, prompt_style="compact")).write(
            demo_seeds(1), noisy_fraction=1.5)
    config = get_config()
    config.sft.no_reasoning_fraction = -0.1
    with pytest.raises(ValueError, match=r"sft.no_reasoning_fraction must be in \[0, 1\]"):
        sft.SFTSettings.from_config(config)


# ------------------------------------------------------------------------------------------------------
# The cache
# ------------------------------------------------------------------------------------------------------
def cache_config(tmp_path) -> ml_collections.ConfigDict:
    c = get_config()
    c.model.overrides = ml_collections.ConfigDict(SMALL_OVERRIDES)
    c.rollout.max_turns = 2
    c.rollout.max_new_tokens = 96
    c.sft.demos, c.sft.steps, c.sft.batch_size = 3, 2, 2
    c.sft.val_episodes = 0
    c.sft.cache_dir = str(tmp_path / "sft_cache")
    return c


def test_key_covers_the_settings_that_change_the_warm_start(tmp_path, monkeypatch):
    base = cache_config(tmp_path)
    key = sft.warm_start_key(base)
    assert key.startswith("frozen_lake-")
    changes = [("sft", "steps", 3), ("sft", "noisy_fraction", 0.5), ("env", "prompt_style", "ragen"),
               ("model", "preset", "qwen2.5-0.5b"), ("rollout", "max_new_tokens", 128), ("sft", "seed", 1),
               ("sft", "bucket", 64), ("sft", "no_reasoning_fraction", 0.5)]
    for group, name, value in changes:
        other = cache_config(tmp_path)
        setattr(other if group is None else other[group], name, value)
        assert sft.warm_start_key(other) != key, (group, name)
    other = cache_config(tmp_path)
    other.env.params = {"max_actions": 10, "success_rate": 0.8}
    assert sft.warm_start_key(other) != key
    other = cache_config(tmp_path)
    other.model.overrides.hidden_size = 128
    assert sft.warm_start_key(other) != key
    monkeypatch.setattr(FrozenLake, "demo_format", 2)  # the env's demonstrations changed
    assert sft.warm_start_key(cache_config(tmp_path)) != key
    monkeypatch.undo()
    other = cache_config(tmp_path)
    other.sft.cache_dir = str(tmp_path / "elsewhere")
    other.seed = 7  # the RL seed: every RL seed starts from the same warm start
    other.sft.micro_batch_size = 2  # the same gradient up to rounding
    assert sft.warm_start_key(other) == key
    # At 0 the setting writes what was written before it existed: older warm starts keep their key.
    del other.sft["no_reasoning_fraction"]
    assert sft.warm_start_key(other) == key


def test_cache_is_built_once_reused_and_never_taken_half_written(tmp_path, monkeypatch):
    config = cache_config(tmp_path)
    calls = []
    real_train = sft.train_sft

    def counting_train(*args, **kwargs):
        out = real_train(*args, **kwargs)
        calls.append(out[0])
        return out

    monkeypatch.setattr(sft, "train_sft", counting_train)
    final = sft.warm_start_path(config)
    # A leftover temporary directory of an interrupted build and a final directory without the
    # COMPLETE marker are both ignored: the warm start is (re)built.
    os.makedirs(os.path.join(os.path.dirname(final), f".tmp-{os.path.basename(final)}-dead"))
    os.makedirs(os.path.join(final, "checkpoint"))
    path = sft.build_warm_start(config, log=None)
    assert path == final and sft.is_complete(path) and len(calls) == 1
    assert os.path.isfile(os.path.join(path, sft.METRICS_FILE))
    metrics = sft.read_metrics(path)
    assert metrics["key"] == sft.warm_start_key(config)
    assert "loss_last" in metrics and np.isfinite(metrics["loss_last"])
    # Second call: cached, no training.
    assert sft.build_warm_start(config, log=None) == path and len(calls) == 1
    # load_warm_start restores exactly the trained parameters into a model of the same structure.
    model = Transformer(get_preset("tiny", **SMALL_OVERRIDES), rngs=nnx.Rngs(123))
    restored = sft.load_warm_start(config, model, log=None)
    assert len(calls) == 1
    trained = jax.tree.leaves(calls[0])
    loaded = jax.tree.leaves(restored)
    assert len(trained) == len(loaded)
    for a, b in zip(trained, loaded):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    nnx.update(model, restored)  # fits the model it was loaded for
    # Only the finished directory and the dead temporary one (untouched) are in the cache dir.
    assert sorted(os.listdir(os.path.dirname(final)))[-1] == os.path.basename(final)


def _array_files(path):
    """The checkpoint's array data files (orbax OCDBT ``d/`` chunks), largest first."""
    files = []
    for root, _, names in os.walk(os.path.join(path, "checkpoint")):
        if os.path.basename(root) == "d":
            files += [os.path.join(root, n) for n in names]
    return sorted(files, key=os.path.getsize, reverse=True)


def test_damaged_cache_is_rebuilt_bit_for_bit_with_umask_permissions(tmp_path, monkeypatch, capfd):
    config = cache_config(tmp_path)
    calls = []
    real_train = sft.train_sft
    monkeypatch.setattr(sft, "train_sft", lambda *a, **k: calls.append(1) or real_train(*a, **k))
    fresh_model = lambda: Transformer(get_preset("tiny", **SMALL_OVERRIDES), rngs=nnx.Rngs(123))
    old_umask = os.umask(0o027)  # neither mkdtemp's 0700 nor the common 0755: the mode must follow it
    try:
        first = sft.load_warm_start(config, fresh_model(), log=None)
    finally:
        os.umask(old_umask)
    final = sft.warm_start_path(config)
    assert len(calls) == 1 and os.stat(final).st_mode & 0o777 == 0o750
    capfd.readouterr()

    # Truncate the largest array file; COMPLETE stays. Loading reports it in one line and rebuilds.
    victim = _array_files(final)[0]
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    second = sft.load_warm_start(config, fresh_model(), log=None)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "warm start cache" in line]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"warm start cache at {final} is damaged (") and lines[0].endswith("); rebuilding")
    assert len(calls) == 2 and sft.is_complete(final)
    # Builds are deterministic by sft.seed: the rebuilt warm start equals the first bit for bit.
    first_leaves, second_leaves = jax.tree.leaves(first), jax.tree.leaves(second)
    assert len(first_leaves) == len(second_leaves)
    for a, b in zip(first_leaves, second_leaves):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Nothing is left beside it (the damaged copy was moved aside and deleted).
    assert os.listdir(os.path.dirname(final)) == [os.path.basename(final)]

    # Damaged metrics are caught by build_warm_start alone (the `sft` command), too.
    with open(os.path.join(final, sft.METRICS_FILE), "w") as f:
        f.write("{ trunc")
    assert sft.build_warm_start(config, log=None) == final and len(calls) == 3
    assert "is damaged (JSONDecodeError" in capfd.readouterr().err
    assert sft.read_metrics(final)["key"] == sft.warm_start_key(config)
    # A healthy cache is reused without a word.
    sft.load_warm_start(config, fresh_model(), log=None)
    assert len(calls) == 3 and "damaged" not in capfd.readouterr().err


def test_hf_models_are_refused_with_a_clear_message(tmp_path):
    config = cache_config(tmp_path)
    config.model.hf_path = "/nonexistent/qwen"
    with pytest.raises(ValueError, match="init='random'"):
        sft.build_parts(config)


def test_init_sft_starts_actor_and_critic_from_the_cached_warm_start(tmp_path):
    from ragen_jax.setup.build import build_policy, build_tokenizer

    config = cache_config(tmp_path)
    config.init = "sft"
    config.algorithm.adv_estimator = "gae"  # with a critic, which copies the actor's backbone
    model = Transformer(get_preset("tiny", **SMALL_OVERRIDES), rngs=nnx.Rngs(0))
    warm = sft.load_warm_start(config, model, log=None)  # builds the cache
    actor, critic = build_policy(config, build_tokenizer(config), warm_start=sft.load_warm_start)
    for a, b in zip(jax.tree.leaves(nnx.state(actor)), jax.tree.leaves(warm)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    critic_embed = np.asarray(critic.backbone.embed.embedding[...])
    np.testing.assert_array_equal(critic_embed, np.asarray(warm["embed"]["embedding"][...]))
