"""RAGEN's two-armed bandit (``ragen/env/bandit``): symbolic arm names, one pull, one turn.

Each episode draws one (low-risk, high-risk) name pair from the split's list (RAGEN's ``ARM_NAMES``:
12 train pairs, 8 test pairs) and puts the two arms in random order as actions 1 and 2. The low-risk
arm always pays 0.1; the high-risk arm pays 1.0 with probability 0.25, else 0.0. Success = pulling
the high-risk arm. The action names are the arm names (so they depend on the state): a response
naming an arm of another episode is an invalid action, as in RAGEN. The observation is RAGEN's
``INIT_PROMPT`` before the pull and "{arm}: {reward} points" after it; the system prompt is RAGEN's
bare "You're a helpful assistant. " (the env has an empty instruction and no action list).

Differences from RAGEN: RAGEN offsets the seed per env instance (so a group's members see different
names); here the key decides, and the rollout decides what keys a group shares.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envs.base import TextEnv, TextEnvParams, TextEnvState, checked_action, select
from envs.demos import TurnChoice
from envs.text import ActionVocab, Dynamic, Parsed, Static, TokenFragments, format_fixed, make_parsed
from envs.text import answer_cut, answer_pieces, byte_classes, clean_answer, compact, parse_answer

TRAIN_PAIRS = (
    ("Teacher", "Trader"), ("Nurse", "StartupFounder"), ("Librarian", "Investor"),
    ("Accountant", "StockBroker"), ("Engineer", "RealEstateAgent"), ("Pharmacist", "Musician"),
    ("Clerk", "Freelancer"), ("Technician", "Youtuber"), ("Planner", "Artist"), ("Postman", "Pilot"),
    ("Banker", "VentureCapitalist"), ("Gardener", "Cryptominer"),
)
TEST_PAIRS = (
    ("Receptionist", "Explorer"), ("Archivist", "Filmmaker"), ("Bookkeeper", "Consultant"),
    ("SocialWorker", "Photographer"), ("Mechanic", "GameDesigner"), ("Secretary", "Entrepreneur"),
    ("Cashier", "DataScientist"), ("CivilServant", "StartupAccelerator"),
)
ALL_PAIRS = TRAIN_PAIRS + TEST_PAIRS
# Name index 2*i is pair i's low-risk arm, 2*i + 1 its high-risk arm.
ARM_NAMES = tuple(name for pair in ALL_PAIRS for name in pair)
SPLITS = {"train": (0, len(TRAIN_PAIRS)), "test": (len(TRAIN_PAIRS), len(TEST_PAIRS))}

INIT_PROMPT = (
    "You are playing a bandit game. Goal: Maximize your total reward by choosing which arm to pull. \n"
    "Game Rules: \n"
    "1. There are 2 arms, named {name_a} and {name_b}\n"
    "2. Each arm has its own reward distribution, related to their names. \n"
    "3. Analyze the symbolic meaning of each arm's name to guess how their reward distribution might behave.\n"
    "4. Based on the symbolic meaning of their names, which arm do you think is more likely to give higher "
    "rewards on average? Choose between {name_a} and {name_b}, and output like <answer> {name_a} </answer> "
    "or <answer> {name_b} </answer>.\n"
)
# compact style: the same choice, without the rules text (the CPU default tokenizes every character)
COMPACT_INIT_PROMPT = "Arms: {name_a}, {name_b}. Pick the arm whose name suggests the higher average reward."


@struct.dataclass
class BanditParams(TextEnvParams):
    split: str = struct.field(pytree_node=False, default="train")
    low_reward: float = 0.1
    high_reward: float = 1.0
    high_low_reward: float = 0.0
    high_prob: float = 0.25
    max_actions: int = 1


@struct.dataclass
class BanditState(TextEnvState):
    arms: jax.Array  # int32[2]: ARM_NAMES index of action 1 and action 2
    high_action: jax.Array  # int32[]: the action id (1 or 2) of the high-risk arm
    pulled: jax.Array  # int32[]: 0 before the pull, else the action id pulled
    reward: jax.Array  # f32[]: the reward of the pull


class Bandit(TextEnv):
    reward_decimals = 1  # 0.1, 1.0, 0.0 print as Python floats do
    default_max_response_tokens = 100
    list_actions_in_system = False

    @property
    def action_lookup(self) -> dict[int, str]:  # type: ignore[override]
        return {1: "arm 1", 2: "arm 2"}  # ids only; the names of an episode are in its state

    @property
    def default_params(self) -> BanditParams:
        return BanditParams()

    def reset_env(self, key: jax.Array, params: BanditParams) -> tuple[jax.Array, BanditState]:
        if params.split not in SPLITS:
            raise ValueError(f"Bandit split must be one of {tuple(SPLITS)}, got {params.split!r}")
        first, count = SPLITS[params.split]
        k_pair, k_order = jax.random.split(key)
        pair = first + jax.random.randint(k_pair, (), 0, count)
        high_first = jax.random.bernoulli(k_order)
        low, high = 2 * pair, 2 * pair + 1
        arms = jnp.where(high_first, jnp.stack([high, low]), jnp.stack([low, high])).astype(jnp.int32)
        state = BanditState(
            time=jnp.zeros((), jnp.int32), terminated=jnp.zeros((), bool), success=jnp.zeros((), bool),
            arms=arms, high_action=jnp.where(high_first, 1, 2).astype(jnp.int32),
            pulled=jnp.zeros((), jnp.int32), reward=jnp.zeros((), jnp.float32),
        )
        return self.get_obs(state), state

    def get_obs(self, state: BanditState, params: Any = None, key: Any = None) -> jax.Array:
        return state.arms

    def step_env(
        self, key: jax.Array, state: BanditState, action: jax.Array, params: BanditParams
    ) -> tuple[jax.Array, BanditState, jax.Array, jax.Array, dict]:
        """One pull (it ends the episode). action: 1 or 2 (anything else is invalid: nothing happens)."""
        action, valid = checked_action(action, state, 2)
        is_high = action == state.high_action
        jackpot = jax.random.uniform(key) < params.high_prob
        reward = jnp.where(is_high, jnp.where(jackpot, params.high_reward, params.high_low_reward), params.low_reward)
        reward = jnp.where(valid, reward, 0.0).astype(jnp.float32)
        pulled = BanditState(
            time=state.time + 1, terminated=jnp.ones((), bool), success=is_high, arms=state.arms,
            high_action=state.high_action, pulled=action, reward=reward,
        )
        new_state = select(valid, pulled, state)
        info = {"action_is_effective": valid, "action_is_valid": valid}
        return self.get_obs(new_state), new_state, reward, new_state.terminated, info

    def action_ids_by_name(self, state: BanditState) -> dict[str, int]:
        """Host: the episode's two arm names (lower-cased) -> action ids 1 and 2."""
        arms = np.asarray(state.arms)
        return {ARM_NAMES[int(arms[0])].lower(): 1, ARM_NAMES[int(arms[1])].lower(): 2}

    def demo_policy(self) -> "BanditPolicy":
        return BanditPolicy()

    def parse_bytes(
        self, buf: jax.Array, n: jax.Array, state: BanditState | None, params: Any, max_actions: int,
        answer_window: int | None = None,
    ) -> Parsed:
        """RAGEN pipeline against ALL arm names, then keep the names of this episode's two arms."""
        if state is None:
            raise ValueError("Bandit's action names depend on the episode: call parse(tokens, length, state)")
        vocab = ActionVocab(ARM_NAMES, tuple(range(len(ARM_NAMES))))
        classes = byte_classes(buf, n)
        span = parse_answer(buf, n, classes)
        ans, cls, ans_n = clean_answer(buf, n, span, classes, answer_window)
        pieces = answer_pieces(ans, cls, ans_n, max_actions, vocab.piece_width, answer_cut(span, answer_window))
        name, found = vocab.lookup(pieces)
        arm = jnp.where(name == state.arms[0], 1, jnp.where(name == state.arms[1], 2, 0)).astype(jnp.int32)
        actions, n_valid = compact(found & (arm > 0), arm)
        return make_parsed(actions, n_valid, pieces.n_parsed, span.matched, pieces.complete)

    # ----- text -------------------------------------------------------------------------------------
    def instruction_text(self, params: BanditParams, style: str) -> str:
        return ""

    def render_state_text(self, state: BanditState, params: BanditParams, style: str = "ragen") -> str:
        name_a, name_b = (ARM_NAMES[int(i)] for i in np.asarray(state.arms))
        if int(state.pulled) == 0:
            return (INIT_PROMPT if style == "ragen" else COMPACT_INIT_PROMPT).format(name_a=name_a, name_b=name_b)
        pulled = ARM_NAMES[int(np.asarray(state.arms)[int(state.pulled) - 1])]
        return f"{pulled}: {format_fixed(float(state.reward), self.reward_decimals)} points"

    def render_state_items(
        self, state: BanditState, params: BanditParams, frags: TokenFragments, style: str = "ragen"
    ) -> list[Static | Dynamic]:
        before = state.pulled == 0
        names = frags.table(ARM_NAMES)
        name_a = Dynamic(names, state.arms[:1], jnp.reshape(before, (1,)))
        name_b = Dynamic(names, state.arms[1:], jnp.reshape(before, (1,)))
        # The first prompt split at its placeholders; each fixed piece only shows before the pull.
        template = (INIT_PROMPT if style == "ragen" else COMPACT_INIT_PROMPT).replace("{name_a}", "\0a\0").replace("{name_b}", "\0b\0").split("\0")
        items: list[Static | Dynamic] = []
        for piece in template:
            if piece == "a":
                items.append(name_a)
            elif piece == "b":
                items.append(name_b)
            elif piece:
                items.append(frags.optional(piece, before))
        pulled_name = state.arms[jnp.clip(state.pulled - 1, 0, 1)]
        items += [
            Dynamic(names, jnp.reshape(pulled_name, (1,)), jnp.reshape(~before, (1,))),
            frags.optional(": ", ~before),
            Dynamic(frags.digits, *_masked(frags.fixed_items(state.reward, self.reward_decimals, 2), ~before)),
            frags.optional(" points", ~before),
        ]
        return items


def _masked(item: Dynamic, on: jax.Array) -> tuple[jax.Array, jax.Array]:
    return item.idx, item.enabled & on


class BanditPolicy:
    """Demonstrations (``envs.demos``): pull the high-risk arm (success). Reasoning names both arms:
    "Trader is high-risk, Teacher is safe; pick Trader." A noisy episode picks the safe arm with the
    same facts."""

    def plan_length(self, state: Any, params: Any) -> int:
        return 1

    def turn(self, state: Any, params: Any, k: int, noisy: bool, rng: np.random.Generator) -> TurnChoice:
        arms, high_action = np.asarray(state.arms), int(state.high_action)
        high, low = ARM_NAMES[int(arms[high_action - 1])], ARM_NAMES[int(arms[2 - high_action])]
        pick = low if noisy else high
        return TurnChoice(f"{high} is high-risk, {low} is safe; pick {pick}.", (pick,))
