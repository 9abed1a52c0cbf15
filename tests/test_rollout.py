"""Rollout engine: fused == host-stepped, RAGEN conversation text, masks, rewards, log-probs, compiles.

Policies are scripted through a test-only wrapper around the tiny random model: the logits of the next
token get ``table[current token]`` added (a bigram bias), so the weights of one compiled program give
  - garbage (table = 0: the random model),
  - a deterministic answer ("<think>" -> "ab</think><answer>Down</answer>", strength 30),
  - a noisy version of it (strength 8 or 9: many responses valid, some not),
  - a policy that never closes its answer ("a" <-> "b" forever).
The bias table is part of the parameters, so switching policies never recompiles.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from envs.bandit import Bandit
from envs.countdown import Countdown
from envs.frozen_lake import FrozenLake
from envs.sokoban import SokobanEnv
from envs.text import Parsed
from ragen_jax.rollout.host_envs import HostStep, parse_response
from ragen_jax.rollout.host_stepped import HostRollout
from ragen_jax.models.config import get_preset
from ragen_jax.models.logprobs import sequence_logprobs
from ragen_jax.models.tokenizers import CharTokenizer
from ragen_jax.models.transformer import Transformer
from ragen_jax.rollout.fused import Rollout
from ragen_jax.rollout.layout import RolloutConfig, env_keys

TOK = CharTokenizer()
V = TOK.vocab_size
ANSWER = "ab</think><answer>Down</answer>"
CFG = get_preset("tiny", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
SEEDS = np.array([3, 11], np.int32)


class Scripted(nnx.Module):
    """base logits + bias[current token]; hidden states carry the token one-hot so that the
    sampler's and the trainer's ``lm_logits(hidden)`` see the same bias."""

    def __init__(self, base: Transformer):
        self.base = base
        self.cfg = base.cfg
        self.bias = nnx.Param(jnp.zeros((V, V), jnp.float32))

    def __call__(self, tokens, valid, cache=None, *, return_hidden=False, kv_len=None, remat=False):
        hidden, cache = self.base(tokens, valid, cache, return_hidden=True, kv_len=kv_len, remat=remat)
        h = jnp.concatenate([hidden, jax.nn.one_hot(tokens, V, dtype=hidden.dtype)], axis=-1)
        return (h, cache) if return_hidden else (self.lm_logits(h), cache)

    def lm_logits(self, h):
        d = self.cfg.hidden_size
        return self.base.lm_logits(h[..., :d]) + h[..., d:] @ self.bias[...]


def bigram_table(chain: list[int], strength: float, cycle: bool = False) -> np.ndarray:
    table = np.zeros((V, V), np.float32)
    for a, b in zip(chain, chain[1:]):
        table[a, b] = strength
    if cycle:
        table[chain[-1], chain[1]] = strength
    return table


THINK = TOK.special_id("<think>")
ANSWER_CHAIN = [THINK] + TOK.encode(ANSWER)
LOOP_CHAIN = [THINK] + TOK.encode("ab")


@pytest.fixture(scope="module")
def model():
    return Scripted(Transformer(CFG, rngs=nnx.Rngs(0)))


def policy(model, table: np.ndarray | None) -> nnx.State:
    _, params = nnx.split(model)
    params = jax.tree.map(lambda x: x, params)
    params["bias"] = nnx.Param(jnp.asarray(np.zeros((V, V), np.float32) if table is None else table))
    return params


def config(**kw) -> RolloutConfig:
    base = dict(n_groups=2, group_size=2, max_turns=2, max_new_tokens=24, prompt_style="compact", kv_block=64)
    base.update(kw)
    return RolloutConfig(**base)


@pytest.fixture(scope="module")
def lake(model):
    return Rollout(model, TOK, FrozenLake(), config())


def assert_same(a, b):
    a, b = a.to_numpy(), b.to_numpy()
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        assert x.shape == y.shape, field.name
        if x.dtype.kind == "f":
            np.testing.assert_allclose(x, y, atol=1e-5, rtol=0, err_msg=field.name)
        else:
            np.testing.assert_array_equal(x, y, err_msg=field.name)


@pytest.fixture(scope="module")
def noisy_runs(lake, model):
    params = policy(model, bigram_table(ANSWER_CHAIN, 8.0))
    key = jax.random.key(7)
    return params, lake.run(params, key, SEEDS), lake.run(params, key, SEEDS, mode="host")


def test_fused_equals_host_frozen_lake(noisy_runs):
    _, fused, host = noisy_runs
    assert_same(fused, host)
    # The noisy policy exercises both valid and invalid turns and early-finishing rows.
    ok = np.asarray(fused.turn_format_ok)[np.asarray(fused.turn_active)]
    assert ok.any() and (~ok).any()


@pytest.mark.slow
@pytest.mark.parametrize("make_env", [SokobanEnv, Bandit, Countdown], ids=["sokoban", "bandit", "countdown"])
def test_fused_equals_host_other_envs(model, make_env):
    rollout = Rollout(model, TOK, make_env(), config(max_turns=2, max_new_tokens=24))
    for table in (bigram_table(ANSWER_CHAIN, 9.0), None):
        params = policy(model, table)
        key = jax.random.key(1)
        assert_same(rollout.run(params, key, SEEDS), rollout.run(params, key, SEEDS, mode="host"))


def test_sampler_logprobs_equal_teacher_forced(noisy_runs, model):
    params, traj, _ = noisy_runs
    merged = nnx.merge(nnx.split(model)[0], params)
    logp, _ = sequence_logprobs(merged, traj.tokens, traj.valid, 1.0)
    mask = np.asarray(traj.loss_mask)
    assert mask.sum() > 0
    np.testing.assert_allclose(np.asarray(traj.logprobs)[mask], np.asarray(logp)[mask], atol=1e-5, rtol=0)
    assert np.all(np.asarray(traj.logprobs)[~mask] == 0)


def expected_conversation(layer, seed: int, max_turns: int) -> tuple[str, float, int]:
    """The RAGEN-style ChatML text of one row answering "Down" every turn, built from the env's own
    state texts; returns (text, episode reward, turns played)."""
    env, params = layer.env, layer.params
    reset_key, _ = env_keys(jnp.int32(seed))
    _, state = env.reset_env(reset_key, params)
    text = ("<|im_start|>system\n" + layer.system_text() + "<|im_end|>\n<|im_start|>user\n"
            + layer.turn_text(state, 1) + "<|im_end|>\n<|im_start|>assistant\n<think>")
    total = 0.0
    down = Parsed(actions=jnp.array([2, 0], jnp.int32), n_valid=jnp.int32(1), n_parsed=jnp.int32(1),
                  matched=jnp.bool_(True), format_ok=jnp.bool_(True))
    for turn in range(1, max_turns + 1):
        text += ANSWER
        # FrozenLake with success_rate 1 is deterministic: the step key does not matter.
        state, reward, done, _ = env.step_turn(jax.random.key(0), state, down, params)
        total += float(reward)
        if bool(done) or turn == max_turns:
            return text, total, turn
        text += ("<|im_end|>\n<|im_start|>user\n" + layer.reward_text(float(reward)) + layer.turn_text(state, turn + 1)
                 + "<|im_end|>\n<|im_start|>assistant\n<think>")
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def scripted_run(lake, model):
    return lake.run(policy(model, bigram_table(ANSWER_CHAIN, 30.0)), jax.random.key(0), SEEDS).to_numpy()


def test_conversation_text_masks_and_reward(lake, scripted_run):
    traj = scripted_run
    for i in range(4):
        text, reward, turns = expected_conversation(lake.layer, int(SEEDS[i // 2]), lake.config.max_turns)
        assert traj.to_text(i, TOK) == text
        assert traj.num_turns[i] == turns
        for t in range(turns):
            assert traj.response_text(i, t, TOK) == ANSWER
            reasoning = traj.tokens[i][traj.reasoning_mask[i] & (traj.turn_ids[i] == t)]
            assert TOK.decode(list(reasoning)) == "ab"
        # loss_mask = exactly the generated tokens: every turn's answer and nothing else.
        assert traj.loss_mask[i].sum() == turns * len(TOK.encode(ANSWER))
        np.testing.assert_allclose(traj.episode_reward[i], reward, atol=1e-6)
        last = np.flatnonzero(traj.loss_mask[i])[-1]
        assert traj.last_token[i] == last
        assert traj.reward_tokens[i, last] == pytest.approx(reward)
        assert np.count_nonzero(traj.reward_tokens[i]) == (reward != 0)
        assert traj.tokens[i, last] == TOK.special_id("</answer>")
        # Prompt spans: turn 1 opens the sequence; each span ends with the assistant header + <think>.
        assert traj.prompt_spans[i, 0, 0] == 0
        for t in range(turns):
            start, end = traj.prompt_spans[i, t]
            assert TOK.decode(list(traj.tokens[i, start:end])).endswith("<|im_start|>assistant\n<think>")
            assert not traj.loss_mask[i, start:end].any() and traj.loss_mask[i, end]
        assert traj.group_ids[i] == i // 2 and traj.seeds[i] == SEEDS[i // 2]
    assert (traj.turn_penalties == 0).all() and traj.turn_format_ok[traj.turn_active].all()


def test_garbage_policy_is_invalid_and_leaves_state(lake, model):
    traj = lake.run(policy(model, None), jax.random.key(3), SEEDS).to_numpy()
    active = traj.turn_active
    assert active.all()  # nothing valid -> no episode can end before max_turns
    assert not traj.turn_format_ok.any() and (traj.num_actions == 0).all()
    np.testing.assert_allclose(traj.turn_penalties, -0.1 * active, atol=1e-7)
    np.testing.assert_allclose(traj.episode_reward, -0.1 * lake.config.max_turns, atol=1e-6)
    layer = lake.layer
    for i in range(4):
        _, state = layer.env.reset_env(env_keys(jnp.int32(SEEDS[i // 2]))[0], layer.params)
        for t in range(1, lake.config.max_turns):
            start, end = traj.prompt_spans[i, t]
            prompt = TOK.decode(list(traj.tokens[i, start:end]))
            # Same state as turn 1, with RAGEN's warning, reward 0.
            assert layer.reward_text(0.0) + layer.turn_text(state, t + 1, warning=True) in prompt


def test_never_closing_answer_is_cut_at_max_new_tokens(lake, model):
    traj = lake.run(policy(model, bigram_table(LOOP_CHAIN, 30.0, cycle=True)), jax.random.key(4), SEEDS).to_numpy()
    n = lake.config.max_new_tokens
    assert (traj.response_lengths == n).all()
    assert not traj.turn_format_ok.any() and not traj.reasoning_mask.any()
    assert traj.response_text(0, 0, TOK) == ("ab" * n)[:n]
    assert (traj.loss_mask.sum(axis=1) == n * lake.config.max_turns).all()


def test_fused_compiles_once(lake, model, noisy_runs, scripted_run):
    # The fixtures already ran the fused program; new weights, keys, seeds and temperatures reuse it.
    lake.run(policy(model, bigram_table(ANSWER_CHAIN, 5.0)), jax.random.key(9), SEEDS + 100, temperature=0.7)
    lake.run(policy(model, None), jax.random.key(10), SEEDS + 7, temperature=1.3)
    assert lake.trace_count == 1


def test_memory_bounded_by_static_cache(lake, noisy_runs):
    layout = lake.layout
    s = layout.first_prompt + layout.response + (layout.max_turns - 1) * (layout.later_prompt + layout.response)
    assert lake.cache_len == s and noisy_runs[1].tokens.shape == (4, s)
    kv = 2 * CFG.num_layers * 4 * CFG.num_kv_heads * s * CFG.head_dim * 4 + 4 * s
    assert lake.memory_bytes() == kv
    stats = lake.compiled(False).memory_analysis()
    if stats is None:
        pytest.skip("this backend reports no memory analysis")
    assert stats.temp_size_in_bytes + stats.output_size_in_bytes <= lake.memory_bound_bytes()


def test_limited_window_host(model):
    rollout = Rollout(model, TOK, FrozenLake(), config(mode="host", context_mode="limited", context_window=2, max_turns=3))
    traj = rollout.run(policy(model, bigram_table(ANSWER_CHAIN, 30.0)), jax.random.key(0), SEEDS).to_numpy()
    turns = rollout.config.max_turns
    assert traj.tokens.shape[0] == 4 * turns
    for row in range(4 * turns):
        episode, t = divmod(row, turns)
        assert traj.episode_ids[row] == episode and traj.sample_turn[row] == t
        if not traj.turn_active[row, t]:
            assert traj.lengths[row] == 0
            continue
        text = traj.to_text(row, TOK)
        assert text.startswith("<|im_start|>system\n")
        kept = [k for k in range(1, turns + 1) if f"Turn {k}:" in text]
        assert kept == list(range(max(1, t), t + 2))  # the last two turns, current included
        assert TOK.decode(list(traj.tokens[row][traj.loss_mask[row]])) == ANSWER  # only this turn trains
        assert traj.reward_tokens[row, traj.last_token[row]] == pytest.approx(traj.episode_reward[row])


class EchoSeed:
    """A plain-Python env: answer the seed; reward 1 when right; two turns."""

    def system_text(self) -> str:
        return "Repeat the number."

    def reset(self, seed: int) -> str:
        self.seed, self.turn = seed, 1
        return f"\nTurn 1:\nNumber {seed}\n"

    def step(self, response_text: str) -> HostStep:
        parsed = parse_response(response_text, 1)
        right = parsed.pieces == (str(self.seed),)
        self.turn += 1
        return HostStep(reward=float(right), done=right or self.turn > 2, success=right,
                        format_ok=parsed.matched and bool(parsed.pieces), n_valid=len(parsed.pieces),
                        n_executed=len(parsed.pieces), next_user_text=f"Reward:\n{float(right)}\n\nTurn {self.turn}:\nNumber {self.seed}\n")


def test_host_env_protocol(model):
    rollout = HostRollout(model, TOK, EchoSeed, config(mode="host", max_turns=2, max_user_tokens=48))
    traj = rollout.run(policy(model, bigram_table(ANSWER_CHAIN, 30.0)), jax.random.key(0), SEEDS).to_numpy()
    for i in range(4):
        seed = SEEDS[i // 2]
        expected = ("<|im_start|>system\nRepeat the number.<|im_end|>\n<|im_start|>user\n"
                    f"\nTurn 1:\nNumber {seed}\n<|im_end|>\n<|im_start|>assistant\n<think>{ANSWER}<|im_end|>\n"
                    f"<|im_start|>user\nReward:\n0.0\n\nTurn 2:\nNumber {seed}\n<|im_end|>\n<|im_start|>assistant\n"
                    f"<think>{ANSWER}")
        assert traj.to_text(i, TOK) == expected
    assert (traj.turn_format_ok).all() and not traj.success.any()
    assert traj.tokens.shape[1] == rollout.layout.cache_len


def test_qwen_template_matches_chat_module():
    chat = pytest.importorskip("ragen_jax.models.chat")
    from ragen_jax.rollout.layout import get_chat_template

    template = get_chat_template("qwen")
    first = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"}]
    assert template.first_prompt("S", "U1") == chat.rollout_prompt(first, "qwen")
    # The assistant message is "<think>" (end of the prompt) + the generated text.
    history = first + [{"role": "assistant", "content": "<think>R"}, {"role": "user", "content": "U2"}]
    assert template.first_prompt("S", "U1") + "R" + template.later_prompt("U2", False) == chat.rollout_prompt(history, "qwen")
    ended = template.first_prompt("S", "U1") + "R<|im_end|>" + template.later_prompt("U2", True)
    assert ended == chat.rollout_prompt(history, "qwen")


def test_config_errors(model):
    with pytest.raises(ValueError, match="context_window"):
        RolloutConfig(context_mode="limited")
    with pytest.raises(ValueError, match="host path only"):
        Rollout(model, TOK, FrozenLake(), config(context_mode="limited", context_window=1)).run(
            policy(model, None), jax.random.key(0), SEEDS)
