"""Solver demonstrations for the supervised warm start, written in the rollout's exact token layout.

For every seed: reset the env exactly as the rollout does (``env_keys(seed)``), then turn by turn let
the env's solver choose up to ``max_actions_per_turn`` actions from the CURRENT state (so it re-plans
after every turn, after a noisy action and after a slip), write the assistant response

    "{reasoning}</think><answer>{A1} || {A2}</answer>"      (the prompt already ends with "<think>")

where the reasoning states the facts the actions depend on, taken from the state (``policies``), and
step the env with the env's own device parse and ``step_turn`` (same keys as the rollout:
``step_key(step_base, actions executed so far)``), so rewards and the next observation are the real
ones. With probability ``noisy_fraction`` an episode gets one noisy turn (drawn uniformly among the
turns the solver's first plan needs): its first action is a random valid action other than the
solver's (preferring ones that keep the episode solvable), the rest of that turn and every later turn
come from the solver again; the reasoning still describes the state and the chosen actions truthfully.

Token layout (``ragen_jax.rollout.layout``, full-history context), built from the same pieces:

    tokens = encode(chat.first_prompt(system, turn_text(state_1, 1)))  + encode(response_1)
           + encode(chat.later_prompt(reward_text(r_1) + turn_text(state_2, 2), False)) + encode(response_2)
           + ...                                                        (until done or max_turns)

loss_mask marks the response tokens (what the rollout's loss_mask covers: the generated tokens, up to
and including the stop "</answer>"); a response never ends with the end-of-turn token, so every later
prompt starts by closing the previous assistant turn. For the character tokenizer, host ``encode`` of
the text equals the device render, so these are the tokens a rollout producing the same responses holds.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from envs.bandit import ARM_NAMES, Bandit
from envs.base import TextEnv
from envs.countdown import Countdown
from envs.countdown_solver import Solution, Step, solve_add_sub, solve_any
from envs.frozen_lake import GOAL, HOLE, FrozenLake
from envs.sokoban import SokobanEnv
from envs.sokoban_generator import TARGET
from envs.sokoban_solver import push_step
from envs.sokoban_solver import solve as solve_sokoban
from envs.solvers import FROZEN_LAKE_MOVES, frozen_lake_bfs
from ragen_jax.models.tokenizers import Tokenizer
from ragen_jax.rollout.layout import RolloutConfig, env_keys, get_chat_template, step_key

# Demonstration seeds live far from RAGEN's validation (123+) and training (10000+) seed ranges.
DEMO_SEED_BASE = 5_000_000


# ----------------------------------------------------------------------------------------------------
# Demonstration policies: solver + reasoning text per env
# ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TurnChoice:
    """One demonstrated turn: the reasoning text and the answer pieces (action names / an equation)."""

    reasoning: str
    actions: tuple[str, ...]


class DemoPolicy(Protocol):
    """What the writer needs from an env's solver. ``state`` is one host-side (numpy) env state."""

    def plan_length(self, state: Any, params: Any) -> int:
        """Actions the solver's plan from ``state`` takes (sets which turn a noisy episode perturbs)."""

    def turn(self, state: Any, params: Any, k: int, noisy: bool, rng: np.random.Generator) -> TurnChoice:
        """Up to k actions from ``state``; noisy: the first one is a random non-solver action."""


def _coord(cell: Sequence[int]) -> str:
    return f"({int(cell[0])}, {int(cell[1])})"


def _pick(rng: np.random.Generator, preferred: list[int], fallback: list[int]) -> int:
    options = preferred or fallback
    return int(options[int(rng.integers(len(options)))])


class FrozenLakePolicy:
    """BFS shortest path (``envs.solvers.frozen_lake_bfs``). Reasoning, e.g.

    "P (0, 1) G (3, 2); hole Down. Right to (0, 2), Down to (1, 2)."
    = player and goal cells, the neighbours of the player that are holes, each chosen move and the
    cell it leads to (intended cell: on a slippery lake the env may move elsewhere; the next turn
    re-plans from where the player really is). A noisy first move avoids holes when it can."""

    names = FrozenLake.action_lookup

    @staticmethod
    def _layout(state: Any, params: Any) -> tuple[np.ndarray, tuple[int, int], tuple[int, int]]:
        grid = np.asarray(state.grid)
        cell = divmod(int(state.pos), int(params.size))
        goal = tuple(int(v) for v in np.argwhere(grid == GOAL)[0])
        return grid, cell, goal

    @staticmethod
    def _move(grid: np.ndarray, cell: tuple[int, int], action: int) -> tuple[int, int]:
        dr, dc = FROZEN_LAKE_MOVES[action]
        rows, cols = grid.shape
        return min(max(cell[0] + dr, 0), rows - 1), min(max(cell[1] + dc, 0), cols - 1)

    def plan_length(self, state: Any, params: Any) -> int:
        grid, cell, goal = self._layout(state, params)
        plan = frozen_lake_bfs(grid, cell, goal)
        return len(plan) if plan else 0

    def turn(self, state: Any, params: Any, k: int, noisy: bool, rng: np.random.Generator) -> TurnChoice:
        grid, cell, goal = self._layout(state, params)
        near = [self.names[a] for a in sorted(self.names) if
                self._move(grid, cell, a) != cell and grid[self._move(grid, cell, a)] == HOLE]
        holes = ("holes " if len(near) > 1 else "hole ") + ", ".join(near) if near else "no hole near"
        plan = frozen_lake_bfs(grid, cell, goal) or []
        trace: list[tuple[int, tuple[int, int]]] = []
        cur = cell
        if noisy:
            options = [a for a in sorted(self.names) if not plan or a != plan[0]]
            safe = [a for a in options if self._move(grid, cur, a) != cur and grid[self._move(grid, cur, a)] != HOLE]
            action = _pick(rng, safe, options)
            cur = self._move(grid, cur, action)
            trace.append((action, cur))
            plan = [] if grid[cur] in (HOLE, GOAL) else frozen_lake_bfs(grid, cur, goal) or []
        for action in plan:
            if len(trace) >= k:
                break
            cur = self._move(grid, cur, action)
            trace.append((action, cur))
        if not trace:  # no path (cannot happen on generated maps): any move, still described truthfully
            action = _pick(rng, [], sorted(self.names))
            trace.append((action, self._move(grid, cur, action)))
        moves = ", ".join(f"{self.names[a]} to {_coord(c)}" for a, c in trace)
        reasoning = f"P {_coord(cell)} G {_coord(goal)}; {holes}. {moves}."
        return TurnChoice(reasoning, tuple(self.names[a] for a, _ in trace))


class SokobanPolicy:
    """BFS shortest solution (``envs.sokoban_solver.solve``). Reasoning, e.g.

    "P (4, 3) X (3, 3) O (1, 3); X goes Up. Up pushes X to (2, 3), Up pushes X to (1, 3)."
    = player, box and target cells, the direction of the solver's next push (why the moves go that
    way), then each action as a move ("Left to (r, c)"), a push ("Up pushes X to (r, c)") or "Up is
    blocked" (a wall or a box that cannot move). A noisy
    first action prefers moves that change the board and keep the level solvable."""

    names = SokobanEnv.action_lookup

    @staticmethod
    def _parts(state: Any) -> tuple[np.ndarray, frozenset, tuple[int, int]]:
        boxes = frozenset(tuple(int(v) for v in rc) for rc in np.argwhere(np.asarray(state.boxes)))
        return np.asarray(state.fixed), boxes, tuple(int(v) for v in np.asarray(state.player))

    @staticmethod
    def _solve(fixed: np.ndarray, boxes: frozenset, player: tuple[int, int]) -> list[int] | None:
        mask = np.zeros(fixed.shape, bool)
        for rc in boxes:
            mask[rc] = True
        return solve_sokoban(fixed, mask, player)

    def plan_length(self, state: Any, params: Any) -> int:
        fixed, boxes, player = self._parts(state)
        plan = self._solve(fixed, boxes, player)
        return len(plan) if plan else 0

    def turn(self, state: Any, params: Any, k: int, noisy: bool, rng: np.random.Generator) -> TurnChoice:
        fixed, boxes, player = self._parts(state)
        targets = frozenset(tuple(int(v) for v in rc) for rc in np.argwhere(fixed == TARGET))
        plan = self._solve(fixed, boxes, player) or []
        why = ""
        b, p = boxes, player
        for action in plan:  # the direction of the solver's next push
            nb, p = push_step(fixed, b, p, action)
            if nb != b:
                why = f"; X goes {self.names[action]}"
                break
            b = nb
        trace: list[str] = []  # one phrase per action
        actions: list[int] = []
        b, p = boxes, player

        def act(action: int) -> None:
            nonlocal b, p
            nb, np_ = push_step(fixed, b, p, action)
            name = self.names[action]
            if nb != b:
                trace.append(f"{name} pushes X to {_coord(sorted(nb - b)[0])}")
            elif np_ == p:
                trace.append(f"{name} is blocked")
            else:
                trace.append(f"{name} to {_coord(np_)}")
            actions.append(action)
            b, p = nb, np_

        if noisy:
            options = [a for a in sorted(self.names) if not plan or a != plan[0]]
            good = [a for a in options if push_step(fixed, b, p, a) != (b, p)
                    and self._solve(fixed, *push_step(fixed, b, p, a)) is not None]
            act(_pick(rng, good, options))
            plan = [] if b <= targets else self._solve(fixed, b, p) or []
        for action in plan:
            if len(actions) >= k or b <= targets:
                break
            act(action)
        if not actions:  # unsolvable from here (a box is stuck): any action, described truthfully
            act(_pick(rng, [], sorted(self.names)))
        box_text = ", ".join(_coord(c) for c in sorted(boxes))
        target_text = ", ".join(_coord(c) for c in sorted(targets))
        reasoning = f"P {_coord(player)} X {box_text} O {target_text}{why}. {', '.join(trace)}."
        return TurnChoice(reasoning, tuple(self.names[a] for a in actions))


class CountdownPolicy:
    """The Countdown solver (+- first, then + - * /). Reasoning = the numbers, the target and the
    solver's steps, e.g. "[3, 5, 2] to 4: 5 + 2 = 7, 7 - 3 = 4." with the answer "5 + 2 - 3". A noisy
    answer is a random +- combination of all numbers that misses the target (computed truthfully; it
    scores 0.1)."""

    def plan_length(self, state: Any, params: Any) -> int:
        return 1

    @staticmethod
    def _task(state: Any) -> tuple[list[int], int]:
        return [int(x) for x in np.asarray(state.numbers)[: int(state.n_numbers)]], int(state.target)

    @staticmethod
    def _random_miss(nums: list[int], target: int, rng: np.random.Generator) -> Solution | None:
        for _ in range(20):
            order = [nums[i] for i in rng.permutation(len(nums))]
            total, steps, equation = Fraction(order[0]), [], str(order[0])
            for n in order[1:]:
                op = "+" if rng.random() < 0.5 else "-"
                result = total + n if op == "+" else total - n
                steps.append(Step(total, op, Fraction(n), result))
                equation += f" {op} {n}"
                total = result
            if total != target:
                return Solution(equation, tuple(steps))
        return None

    def turn(self, state: Any, params: Any, k: int, noisy: bool, rng: np.random.Generator) -> TurnChoice:
        nums, target = self._task(state)
        solution = self._random_miss(nums, target, rng) if noisy else None
        if solution is None:
            solution = solve_add_sub(nums, target)
        if solution is None and not params.only_add_sub_solvable:
            solution = solve_any(nums, target)
        if solution is None:
            raise ValueError(f"Countdown task {nums} -> {target} has no solution; the demo cannot be written")
        steps = ", ".join(step.text() for step in solution.steps) or solution.equation
        return TurnChoice(f"{nums} to {target}: {steps}.", (solution.equation,))


class BanditPolicy:
    """Pull the high-risk arm (success). Reasoning names both arms: "Trader is high-risk, Teacher is
    safe; pick Trader." A noisy episode picks the safe arm with the same facts."""

    def plan_length(self, state: Any, params: Any) -> int:
        return 1

    def turn(self, state: Any, params: Any, k: int, noisy: bool, rng: np.random.Generator) -> TurnChoice:
        arms, high_action = np.asarray(state.arms), int(state.high_action)
        high, low = ARM_NAMES[int(arms[high_action - 1])], ARM_NAMES[int(arms[2 - high_action])]
        pick = low if noisy else high
        return TurnChoice(f"{high} is high-risk, {low} is safe; pick {pick}.", (pick,))


def policy_for(env: TextEnv) -> DemoPolicy:
    """The demonstration policy of a built-in env."""
    for kind, policy in ((FrozenLake, FrozenLakePolicy), (SokobanEnv, SokobanPolicy),
                         (Countdown, CountdownPolicy), (Bandit, BanditPolicy)):
        if isinstance(env, kind):
            return policy()
    raise ValueError(
        f"no demonstration policy for {type(env).__name__}; pass DemoWriter(..., policy=...) with plan_length "
        "and turn methods (see ragen_jax.sft.demos.DemoPolicy)"
    )


def response_text(choice: TurnChoice) -> str:
    """The assistant response after the prompt's "<think>": reasoning, then the "||"-joined answer."""
    return f"{choice.reasoning}</think><answer>{' || '.join(choice.actions)}</answer>"


@dataclasses.dataclass(frozen=True)
class DemoEpisode:
    """One demonstration in the rollout's compacted layout.

    tokens: int32[L]; loss_mask: bool[L] (the response tokens); turn_ids: int32[L] (0-based turn of
    every token). Per turn: prompt_lengths, response_lengths (tokens), responses (text), actions (the
    answer pieces), rewards (env turn rewards), format_ok (the device parse's verdict).
    noisy_turn: the turn with the random action, -1 for a clean episode.
    """

    seed: int
    tokens: np.ndarray
    loss_mask: np.ndarray
    turn_ids: np.ndarray
    prompt_lengths: tuple[int, ...]
    response_lengths: tuple[int, ...]
    responses: tuple[str, ...]
    actions: tuple[tuple[str, ...], ...]
    rewards: tuple[float, ...]
    format_ok: tuple[bool, ...]
    success: bool
    noisy_turn: int

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_turns(self) -> int:
        return len(self.responses)

    @property
    def episode_reward(self) -> float:
        return float(sum(self.rewards))


class _Building:
    """The growing token sequence of one episode."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.loss: list[bool] = []
        self.turn: list[int] = []
        self.prompt_lengths: list[int] = []
        self.response_lengths: list[int] = []
        self.responses: list[str] = []
        self.actions: list[tuple[str, ...]] = []
        self.rewards: list[float] = []
        self.format_ok: list[bool] = []

    def add(self, ids: Sequence[int], turn: int, loss: bool) -> None:
        self.tokens += [int(i) for i in ids]
        self.loss += [loss] * len(ids)
        self.turn += [turn] * len(ids)


class DemoWriter:
    """Writes demonstrations of one (env, env params, tokenizer, rollout settings).

    The text layer is built exactly as ``Rollout`` builds it (prompt style, max_actions_per_turn, the
    env's default response budget), so prompts and the parse match the RL-time rollout.
    """

    def __init__(
        self,
        env: TextEnv,
        env_params: Any,
        tokenizer: Tokenizer,
        config: RolloutConfig,
        policy: DemoPolicy | None = None,
    ) -> None:
        self.env, self.tokenizer, self.config = env, tokenizer, config
        self.env_params = env.default_params if env_params is None else env_params
        self.layer = env.text_layer(tokenizer, self.env_params, config.prompt_style, config.max_actions_per_turn)
        self.chat = get_chat_template(config.chat_template)
        self.system = self.layer.system_text()
        self.policy = policy_for(env) if policy is None else policy
        layer, params = self.layer, self.env_params

        def reset_one(seed):
            reset_key, step_base = env_keys(seed)
            return env.reset_env(reset_key, params)[1], step_base

        def turn_one(tokens, length, state, step_base):
            # The rollout's turn: device parse of the generated tokens, then the env's step_turn.
            parsed = layer.parse(tokens, length, state)
            new_state, reward, done, info = layer.step_turn(step_key(step_base, state.time), state, parsed)
            return new_state, reward, done, info["success"], parsed.format_ok, parsed.n_valid

        self._reset = jax.jit(jax.vmap(reset_one))
        self._turn = jax.jit(jax.vmap(turn_one))

    def write(
        self, seeds: Sequence[int], noisy_fraction: float = 0.0, rng_seed: int = 0, chunk: int = 256
    ) -> list[DemoEpisode]:
        """One demonstration per seed (in order). noisy_fraction: probability of a noisy episode."""
        if not 0.0 <= noisy_fraction <= 1.0:
            raise ValueError(f"noisy_fraction must be in [0, 1], got {noisy_fraction}; set sft.noisy_fraction.")
        seeds = [int(s) for s in seeds]
        rng = np.random.default_rng(rng_seed)
        out: list[DemoEpisode] = []
        width = min(chunk, max(len(seeds), 1))
        for start in range(0, len(seeds), width):
            part = seeds[start:start + width]
            # Every chunk has the same number of rows (the last one padded), so reset and step compile once.
            padded = part + [part[-1]] * (width - len(part))
            out += self._write_chunk(padded, noisy_fraction, rng)[: len(part)]
        return out

    # ------------------------------------------------------------------------------------------------
    def _write_chunk(self, seeds: list[int], noisy_fraction: float, rng: np.random.Generator) -> list[DemoEpisode]:
        cfg, tok, layer, chat = self.config, self.tokenizer, self.layer, self.chat
        b, width = len(seeds), cfg.max_new_tokens
        states, step_bases = self._reset(jnp.asarray(seeds, jnp.int32))
        k = cfg.max_actions_per_turn
        rows = [_Building() for _ in range(b)]
        noisy_turn = np.full((b,), -1, np.int64)
        success = np.zeros((b,), bool)
        active = np.ones((b,), bool)
        host_states = jax.device_get(states)
        for i in range(b):
            if rng.random() < noisy_fraction:
                host = _row(host_states, i)
                turns_needed = -(-max(self.policy.plan_length(host, self.env_params), 1) // k)
                noisy_turn[i] = rng.integers(min(turns_needed, cfg.max_turns))
        for t in range(cfg.max_turns):
            tokens = np.full((b, width), tok.pad_id, np.int32)
            lengths = np.zeros((b,), np.int32)
            host_states = jax.device_get(states)
            for i in np.flatnonzero(active):
                host = _row(host_states, i)
                left = int(self.env.max_actions_per_episode(self.env_params)) - int(host.time)
                choice = self.policy.turn(host, self.env_params, min(k, max(left, 1)), t == noisy_turn[i], rng)
                text = response_text(choice)
                ids = tok.encode(text)
                if len(ids) > width:
                    raise ValueError(
                        f"a demonstration response has {len(ids)} tokens, more than rollout.max_new_tokens="
                        f"{width}; raise rollout.max_new_tokens (response: {text!r})"
                    )
                if t == 0:
                    prompt = chat.first_prompt(self.system, layer.turn_text(host, 1))
                else:
                    user = layer.reward_text(rows[i].rewards[-1]) + layer.turn_text(host, t + 1)
                    prompt = chat.later_prompt(user, response_ended_turn=False)
                prompt_ids = tok.encode(prompt)
                rows[i].add(prompt_ids, t, False)
                rows[i].add(ids, t, True)
                rows[i].prompt_lengths.append(len(prompt_ids))
                rows[i].response_lengths.append(len(ids))
                rows[i].responses.append(text)
                rows[i].actions.append(tuple(choice.actions))
                tokens[i, : len(ids)] = ids
                lengths[i] = len(ids)
            new_states, reward, done, succ, ok, n_valid = jax.device_get(
                self._turn(jnp.asarray(tokens), jnp.asarray(lengths), states, step_bases))
            for i in np.flatnonzero(active):
                if n_valid[i] != len(rows[i].actions[-1]) or not ok[i]:
                    raise RuntimeError(
                        f"the env's parse read {n_valid[i]} valid actions (format_ok={bool(ok[i])}) from the "
                        f"demonstration {rows[i].responses[-1]!r}; the demo policy must write valid answers"
                    )
                rows[i].rewards.append(float(reward[i]))
                rows[i].format_ok.append(bool(ok[i]))
                success[i] = bool(succ[i])
            live = jnp.asarray(active)
            states = jax.tree.map(
                lambda new, old: jnp.where(jnp.reshape(live, (b,) + (1,) * (new.ndim - 1)), new, old),
                new_states, states)
            active = active & ~np.asarray(done, bool)
            if not active.any():
                break
        return [
            DemoEpisode(
                seed=seeds[i], tokens=np.asarray(r.tokens, np.int32), loss_mask=np.asarray(r.loss, bool),
                turn_ids=np.asarray(r.turn, np.int32), prompt_lengths=tuple(r.prompt_lengths),
                response_lengths=tuple(r.response_lengths), responses=tuple(r.responses),
                actions=tuple(r.actions), rewards=tuple(r.rewards), format_ok=tuple(r.format_ok),
                success=bool(success[i]), noisy_turn=int(noisy_turn[i]),
            )
            for i, r in enumerate(rows)
        ]


def _row(states: Any, i: int) -> Any:
    """Row i of a batched (numpy) env state: the host-side view the policies read."""
    return jax.tree.map(lambda x: np.asarray(x[i]), states)


def demo_seeds(count: int, base: int = DEMO_SEED_BASE) -> np.ndarray:
    """int32[count]: the env seeds of the demonstrations (disjoint from validation and RL seeds)."""
    return base + np.arange(count, dtype=np.int32)


def demo_stats(episodes: Sequence[DemoEpisode]) -> dict[str, float]:
    """Token lengths and outcomes of a demonstration set (for logs and the benchmark)."""
    first = [e.prompt_lengths[0] for e in episodes]
    later = [p for e in episodes for p in e.prompt_lengths[1:]]
    responses = [r for e in episodes for r in e.response_lengths]
    lengths = [e.length for e in episodes]
    clean = [e for e in episodes if e.noisy_turn < 0]
    noisy = [e for e in episodes if e.noisy_turn >= 0]
    mean = lambda xs: float(np.mean(xs)) if len(xs) else 0.0  # noqa: E731
    return {
        "episodes": float(len(episodes)),
        "noisy_episodes": float(len(noisy)),
        "success": mean([e.success for e in episodes]),
        "clean_success": mean([e.success for e in clean]),
        "noisy_success": mean([e.success for e in noisy]),
        "turns": mean([e.num_turns for e in episodes]),
        "first_prompt_tokens": mean(first),
        "later_prompt_tokens": mean(later),
        "response_tokens": mean(responses),
        "max_response_tokens": float(max(responses)) if responses else 0.0,
        "sequence_tokens": mean(lengths),
        "max_sequence_tokens": float(max(lengths)) if lengths else 0.0,
        "reasoning_chars": mean([len(r.split("</think>")[0]) for e in episodes for r in e.responses]),
    }
