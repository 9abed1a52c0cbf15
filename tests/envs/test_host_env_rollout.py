"""code_exec and search_qa through ``HostRollout`` with the tiny model: the HostEnv protocol fits the rollout.

The policy is the tiny random transformer plus a bigram bias (as in tests/test_rollout.py): with the
bias at 0 it writes garbage (no format: reward 0, the format penalty); with a chain of distinct tokens
it writes one fixed response, so the rewards of a whole rollout are known by hand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from envs.code_data import load_code_problems
from envs.registry import make_host
from envs.sandbox import Sandbox, SandboxUnavailable
from ragen_jax.models.config import get_preset
from ragen_jax.models.tokenizers import CharTokenizer
from ragen_jax.models.transformer import Transformer
from ragen_jax.rollout.host_stepped import HostRollout
from ragen_jax.rollout.layout import RolloutConfig

TOK = CharTokenizer()
V = TOK.vocab_size
CFG = get_preset("tiny", hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)


class Scripted(nnx.Module):
    """base logits + bias[current token]."""

    def __init__(self, base: Transformer):
        self.base, self.cfg = base, base.cfg
        self.bias = nnx.Param(jnp.zeros((V, V), jnp.float32))

    def __call__(self, tokens, valid, cache=None, *, return_hidden=False, kv_len=None, remat=False):
        hidden, cache = self.base(tokens, valid, cache, return_hidden=True, kv_len=kv_len, remat=remat)
        h = jnp.concatenate([hidden, jax.nn.one_hot(tokens, V, dtype=hidden.dtype)], axis=-1)
        return (h, cache) if return_hidden else (self.lm_logits(h), cache)

    def lm_logits(self, h):
        return self.base.lm_logits(h[..., :self.cfg.hidden_size]) + h[..., self.cfg.hidden_size:] @ self.bias[...]


@pytest.fixture(scope="module")
def model() -> Scripted:
    return Scripted(Transformer(CFG, rngs=nnx.Rngs(0)))


def params_writing(model: Scripted, response: str | None) -> nnx.State:
    """The model's parameters with a bias that makes it write "<think>" + response (None: no bias)."""
    table = np.zeros((V, V), np.float32)
    if response is not None:
        chain = [TOK.special_id("<think>")] + TOK.encode(response)
        assert len(set(chain)) == len(chain), "the scripted response needs distinct tokens"
        for a, b in zip(chain, chain[1:]):
            table[a, b] = 40.0
    _, params = nnx.split(model)
    params = jax.tree.map(lambda x: x, params)
    params["bias"] = nnx.Param(jnp.asarray(table))
    return params


def config(**kw) -> RolloutConfig:
    base = dict(n_groups=2, group_size=2, max_new_tokens=24, max_actions_per_turn=1, mode="host", kv_block=64)
    return RolloutConfig(**{**base, **kw})


def test_code_exec_rollout(model):
    try:
        Sandbox()
    except SandboxUnavailable as error:
        pytest.skip(f"bubblewrap cannot run on this machine: {error}")
    problems = load_code_problems()
    fib = next(i for i, p in enumerate(problems) if "Fibonacci" in p.question)  # outputs 1, 1, 55, 832040
    rollout = HostRollout(model, TOK, make_host("code_exec", prompt_style="compact"),
                          config(max_turns=1, max_user_tokens=200))
    seeds = np.array([fib, fib + len(problems)], np.int32)
    traj = rollout.run(params_writing(model, "xy</think><answer>print(1)</answer>"), jax.random.key(0), seeds).to_numpy()
    np.testing.assert_allclose(traj.turn_rewards[:, 0], 0.5)  # print(1) passes 2 of the 4 tests
    np.testing.assert_allclose(traj.episode_reward, 0.5)
    assert traj.turn_format_ok.all() and not traj.success.any()
    text = traj.to_text(0, TOK)
    assert "Fibonacci" in text and text.endswith("<think>xy</think><answer>print(1)</answer>")
    garbage = rollout.run(params_writing(model, None), jax.random.key(1), seeds).to_numpy()
    assert not garbage.turn_format_ok.any() and (garbage.turn_rewards == 0).all()
    np.testing.assert_allclose(garbage.episode_reward, -0.1)  # the format penalty only


def test_search_qa_rollout(model):
    rollout = HostRollout(model, TOK, make_host("search_qa", prompt_style="compact", top_k=1),
                          config(max_turns=2, max_user_tokens=320))
    seeds = np.array([0, 25], np.int32)
    traj = rollout.run(params_writing(model, "xy</think><answer>search[Owl]</answer>"), jax.random.key(0), seeds).to_numpy()
    assert traj.turn_active.all() and traj.turn_format_ok.all()
    assert (traj.turn_rewards == 0).all() and not traj.success.any()
    text = traj.to_text(0, TOK)
    assert text.count("search[Owl]") == 2
    assert "Search results for 'Owl':\nNo relevant documents found for the query." in text
