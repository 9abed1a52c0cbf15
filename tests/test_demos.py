"""Solver demonstrations: solver-correct, noisy but coherent, and exactly the rollout's token layout.

References are independent of ``ragen_jax.sft.demos``: gymnasium's FrozenLake for replays, a plain-Python
Sokoban push rule (``envs.sokoban_solver.push_step``), Python ``eval`` for Countdown, and the rollout
itself (fused and host paths) driven by a sampler that emits the demonstrated responses.
"""

from __future__ import annotations

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv

from envs.bandit import ARM_NAMES, Bandit
from envs.base import TextEnv
from envs.countdown import Countdown
from envs.demos import TurnChoice
from envs.frozen_lake import FrozenLake, to_desc
from envs.registry import REGISTRY
from envs.sokoban import SokobanEnv
from envs.sokoban_solver import push_step
from ragen_jax.sft.demos import DemoWriter, demo_seeds, demo_stats, response_text
from ragen_jax.models.config import get_preset
from ragen_jax.models.tokenizers import CharTokenizer
from ragen_jax.models.transformer import Transformer
from ragen_jax.rollout.fused import Rollout
from ragen_jax.rollout.layout import RolloutConfig, env_keys
from ragen_jax.sampling.sampler import SampleOutput

TOK = CharTokenizer()
SMALL = get_preset("tiny", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16)
RESPONSE = re.compile(r"^(.*?)</think><answer>(.*?)</answer>$", re.DOTALL)
GYM_ACTION = {"Left": 0, "Down": 1, "Right": 2, "Up": 3}
SOKOBAN_ID = {"Up": 1, "Down": 2, "Left": 3, "Right": 4}


def rollout_config(**kw) -> RolloutConfig:
    base = dict(n_groups=1, group_size=1, max_turns=5, max_new_tokens=128, prompt_style="compact")
    base.update(kw)
    return RolloutConfig(**base)


def start_state(env, params, seed: int):
    reset_key, _ = env_keys(jnp.int32(seed))
    return jax.tree.map(np.asarray, env.reset_env(reset_key, params)[1])


@pytest.fixture(scope="module")
def lake_writer():
    return DemoWriter(FrozenLake(), None, TOK, rollout_config(max_turns=3))


@pytest.fixture(scope="module")
def lake_demos(lake_writer):
    return {
        "clean": lake_writer.write(demo_seeds(8), noisy_fraction=0.0, rng_seed=0),
        "noisy": lake_writer.write(demo_seeds(8, 6_000_000), noisy_fraction=1.0, rng_seed=1),
    }


def answers(episode) -> list[list[str]]:
    out = []
    for text in episode.responses:
        match = RESPONSE.match(text)
        assert match, text
        out.append([piece.strip() for piece in match.group(2).split("||")])
    return out


# ------------------------------------------------------------------------------------------------------
# Solver-correct clean demonstrations (replayed through independent references)
# ------------------------------------------------------------------------------------------------------
def test_clean_frozen_lake_demos_replay_to_the_goal_in_gymnasium(lake_demos):
    env = FrozenLake()
    params = env.default_params
    for episode in lake_demos["clean"]:
        assert episode.noisy_turn == -1 and episode.success
        state = start_state(env, params, episode.seed)
        gym = FrozenLakeEnv(desc=to_desc(state.grid), is_slippery=False)
        gym.reset(seed=0)
        gym.unwrapped.s = int(state.pos)
        rewards = []
        for pieces in answers(episode):
            total = 0.0
            for piece in pieces:
                _, r, terminated, _, _ = gym.step(GYM_ACTION[piece])
                total += r
            rewards.append(total)
        assert terminated and total == 1.0
        assert rewards == list(episode.rewards)
        # Shortest: BFS length is the Manhattan lower bound or more; the demo uses exactly as many moves
        # as gymnasium needed, and no turn has more than max_actions_per_turn actions.
        assert all(1 <= len(p) <= 2 for p in answers(episode))


@pytest.mark.slow  # Sokoban's level generator takes long to compile on CPU
@pytest.mark.parametrize("seeds", [demo_seeds(4)])
def test_clean_sokoban_demos_push_every_box_onto_a_target(seeds):
    env = SokobanEnv()
    episodes = DemoWriter(env, None, TOK, rollout_config()).write(seeds, noisy_fraction=0.0)
    for episode in episodes:
        state = start_state(env, env.default_params, episode.seed)
        fixed = np.asarray(state.fixed)
        boxes = frozenset(map(tuple, np.argwhere(state.boxes).tolist()))
        player = tuple(int(v) for v in state.player)
        moves = [SOKOBAN_ID[p] for pieces in answers(episode) for p in pieces]
        for action in moves:
            boxes, player = push_step(fixed, boxes, player, action)
        targets = frozenset(map(tuple, np.argwhere(fixed == 2).tolist()))
        assert boxes <= targets and episode.success
        assert len(moves) == int(state.solution_length)  # the solver's plan is a shortest one
        assert episode.episode_reward == pytest.approx(10.0 + 1.0 - 0.1 * len(moves), abs=1e-4)
        r, c = (int(v) for v in state.player)
        assert episode.responses[0].startswith(f"P ({r}, {c}) X ")


def test_countdown_and_bandit_demos():
    env = Countdown()
    countdown = DemoWriter(env, None, TOK, rollout_config(max_turns=1, max_actions_per_turn=1))
    clean = countdown.write(demo_seeds(6))
    for episode in clean:
        state = start_state(env, env.default_params, episode.seed)
        nums = [int(x) for x in state.numbers[: int(state.n_numbers)]]
        (equation,), = answers(episode)
        assert eval(equation) == int(state.target)  # noqa: S307 - the test's own arithmetic reference
        assert Counter(int(x) for x in re.findall(r"\d+", equation)) == Counter(nums)
        assert episode.success and episode.rewards == (1.0,)
        assert episode.responses[0].startswith(f"{nums} to {int(state.target)}: ")
    noisy = countdown.write(demo_seeds(6), noisy_fraction=1.0)
    assert all(not e.success and e.rewards == (pytest.approx(0.1),) for e in noisy)

    bandit = Bandit()
    writer = DemoWriter(bandit, None, TOK, rollout_config(max_turns=1, max_actions_per_turn=1))
    for noisy_fraction, expect in ((0.0, True), (1.0, False)):
        for episode in writer.write(demo_seeds(6), noisy_fraction=noisy_fraction):
            state = start_state(bandit, bandit.default_params, episode.seed)
            high = ARM_NAMES[int(state.arms[int(state.high_action) - 1])]
            assert episode.success is expect
            assert episode.responses[0].startswith(f"{high} is high-risk")


def test_demos_without_reasoning_keep_the_actions_and_the_noisy_draws(lake_writer, lake_demos):
    """no_reasoning_fraction leaves the reasoning out of the drawn episodes' responses, nothing else: the
    actions, rewards and outcome are the reasoned demonstration's, and the noisy draws are unchanged."""
    seeds = demo_seeds(8, 6_000_000)
    episodes = lake_writer.write(seeds, noisy_fraction=1.0, rng_seed=1, no_reasoning_fraction=0.5)
    assert 0 < sum(not e.reasoned for e in episodes) < len(episodes)
    for with_reasoning, episode in zip(lake_demos["noisy"], episodes):
        assert (episode.actions, episode.rewards, episode.success, episode.noisy_turn) == (
            with_reasoning.actions, with_reasoning.rewards, with_reasoning.success, with_reasoning.noisy_turn)
        assert all(episode.format_ok)
        if episode.reasoned:
            assert episode.responses == with_reasoning.responses
        else:
            assert all(text.startswith("</think><answer>") for text in episode.responses)
            assert [RESPONSE.match(t).group(2) for t in episode.responses] == [
                RESPONSE.match(t).group(2) for t in with_reasoning.responses]
    assert demo_stats(episodes)["no_reasoning_episodes"] == sum(not e.reasoned for e in episodes)
    with pytest.raises(ValueError, match="no_reasoning_fraction"):
        lake_writer.write(seeds[:1], no_reasoning_fraction=2.0)


# ------------------------------------------------------------------------------------------------------
# Noisy demonstrations: valid format, truthful reasoning, re-planned afterwards
# ------------------------------------------------------------------------------------------------------
MOVES = {"Left": (0, -1), "Down": (1, 0), "Right": (0, 1), "Up": (-1, 0)}


def test_noisy_frozen_lake_demos_are_valid_and_coherent(lake_demos):
    episodes = lake_demos["noisy"]
    assert all(e.noisy_turn >= 0 for e in episodes)
    for episode in episodes:
        assert all(episode.format_ok)
        text = TOK.decode(list(episode.tokens))
        observed = re.findall(r"Turn \d+:\nP \((\d), (\d)\)", text)  # one per turn prompt (compact observation)
        goal = re.search(r"Turn 1:\nP \(\d, \d\) G \((\d), (\d)\)", text).groups()
        for t, response in enumerate(episode.responses):
            reasoning, answer = RESPONSE.match(response).groups()
            # The reasoning restates the observation of this turn ...
            assert reasoning.startswith(f"P ({observed[t][0]}, {observed[t][1]}) G ({goal[0]}, {goal[1]})")
            # ... and the cells it names are where the answer's moves lead (plain-Python moves).
            cell = tuple(int(v) for v in observed[t])
            named = re.findall(r"(Left|Down|Right|Up) to \((\d), (\d)\)", reasoning)
            assert [n for n, *_ in named] == [p.strip() for p in answer.split("||")]
            for name, r, c in named:
                dr, dc = MOVES[name]
                cell = (min(max(cell[0] + dr, 0), 3), min(max(cell[1] + dc, 0), 3))
                assert cell == (int(r), int(c))
            if t + 1 < len(observed):
                assert cell == tuple(int(v) for v in observed[t + 1])
    # The noise costs something on average but the solver recovers most episodes.
    stats = demo_stats(episodes)
    assert stats["turns"] >= demo_stats(lake_demos["clean"])["turns"]
    assert stats["success"] >= 0.5


def test_response_text_format():
    assert response_text(TurnChoice("why", ("Up", "Left"))) == "why</think><answer>Up || Left</answer>"


def test_every_registered_env_brings_its_demo_policy():
    for make_env in REGISTRY.values():
        policy = make_env().demo_policy()  # the env owns its solver: the writer knows no env class
        assert callable(policy.plan_length) and callable(policy.turn)

    class Undemonstrated(FrozenLake):
        demo_policy = TextEnv.demo_policy

    with pytest.raises(ValueError, match="no demonstration policy for Undemonstrated"):
        DemoWriter(Undemonstrated(), None, TOK, rollout_config())


def test_too_long_responses_raise_a_clear_error():
    writer = DemoWriter(FrozenLake(), None, TOK, rollout_config(max_turns=1, max_new_tokens=16))
    with pytest.raises(ValueError, match="max_new_tokens"):
        writer.write(demo_seeds(1))


# ------------------------------------------------------------------------------------------------------
# The token layout is exactly the rollout's
# ------------------------------------------------------------------------------------------------------
class ForcedSampler:
    """Stands in for the rollout's sampler: append is a no-op, generate returns the given responses.

    responses: int32[T, B, N] and lengths int32[T, B] (turn t of row b); inactive rows emit nothing.
    """

    def __init__(self, responses: np.ndarray, lengths: np.ndarray, pad_id: int) -> None:
        self.responses, self.lengths, self.pad_id = responses, lengths, pad_id
        self.calls = 0

    def append(self, params, state, tokens, valid):
        return state

    def generate(self, params, state, key, temperature, active):
        t = self.calls % self.responses.shape[0]
        self.calls += 1
        lengths = jnp.where(jnp.asarray(active), jnp.asarray(self.lengths[t]), 0)
        valid = jnp.arange(self.responses.shape[2])[None, :] < lengths[:, None]
        tokens = jnp.where(valid, jnp.asarray(self.responses[t]), self.pad_id)
        zeros = jnp.zeros(tokens.shape, jnp.float32)
        return SampleOutput(tokens=tokens, logprobs=zeros, entropy=zeros, valid=valid, lengths=lengths,
                            stopped=lengths > 0), state


def forced_arrays(episodes, turns: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    responses = np.zeros((turns, len(episodes), width), np.int32)
    lengths = np.zeros((turns, len(episodes)), np.int32)
    for b, episode in enumerate(episodes):
        for t, text in enumerate(episode.responses):
            ids = TOK.encode(text)
            responses[t, b, : len(ids)] = ids
            lengths[t, b] = len(ids)
    return responses, lengths


@pytest.mark.parametrize("mode", ["fused", "host"])
def test_demo_tokens_equal_the_rollout_of_the_same_responses(lake_writer, lake_demos, mode):
    episodes = lake_demos["clean"][:4] + lake_demos["noisy"][:4]
    cfg = lake_writer.config
    config = RolloutConfig(n_groups=len(episodes), group_size=1, max_turns=cfg.max_turns,
                           max_new_tokens=cfg.max_new_tokens, prompt_style="compact")
    rollout = Rollout(Transformer(SMALL, rngs=nnx.Rngs(0)), TOK, FrozenLake(), config)
    responses, lengths = forced_arrays(episodes, config.max_turns, config.max_new_tokens)
    rollout.samplers[False] = ForcedSampler(responses, lengths, TOK.pad_id)
    params = nnx.split(Transformer(SMALL, rngs=nnx.Rngs(0)))[1]
    seeds = np.array([e.seed for e in episodes], np.int32)
    traj = rollout.run(params, jax.random.key(0), seeds, mode=mode).to_numpy()
    for i, episode in enumerate(episodes):
        n = int(traj.lengths[i])
        assert n == episode.length
        np.testing.assert_array_equal(traj.tokens[i, :n], episode.tokens)
        np.testing.assert_array_equal(traj.loss_mask[i, :n], episode.loss_mask)
        np.testing.assert_array_equal(traj.turn_ids[i, :n], episode.turn_ids)
        turns = episode.num_turns
        assert int(traj.num_turns[i]) == turns
        np.testing.assert_allclose(traj.turn_rewards[i, :turns], episode.rewards, atol=1e-6)
        assert bool(traj.success[i]) == episode.success
        assert traj.turn_format_ok[i, :turns].all()
        np.testing.assert_array_equal(traj.response_lengths[i, :turns], episode.response_lengths)
