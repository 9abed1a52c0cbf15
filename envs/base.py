"""The environment contract of ragen_jax: a gymnax ``Environment`` plus an on-device text layer.

Environment (gymnax 1.0.1 API)
------------------------------
Every env subclasses ``TextEnv`` (a ``gymnax.environments.environment.Environment``) and defines:
  - ``EnvParams``: frozen ``flax.struct`` dataclass deriving from ``TextEnvParams`` (field
    ``max_actions``: the per-episode action budget, RAGEN's ``max_actions_per_traj``); shape-defining
    fields are ``struct.field(pytree_node=False)``.
  - ``EnvState``: ``flax.struct`` dataclass deriving from ``TextEnvState`` (fields ``time``: actions
    executed so far, ``terminated``: the env ended the episode, ``success``).
  - ``reset_env(key, params) -> (obs, state)`` and ``step_env(key, state, action, params) ->
    (obs, state, reward f32[], terminated bool[], info)``; ``action`` is RAGEN's action id (ids start
    at 1; 0 and any id outside the action set are invalid: no-op, reward 0, ``time`` unchanged).
    ``step_env`` must increment ``time`` for valid actions and keep a terminated state unchanged.
  - ``action_lookup`` (dict id -> name, RAGEN's ``ACTION_LOOKUP``), ``reward_decimals`` (how the
    "Reward:" line prints rewards), ``default_max_response_tokens`` (RAGEN ``max_tokens``),
    ``instruction_text(params, style)``, ``symbol_legend()``, ``render_state_text(state, params, style)``
    (host, one state) and ``render_state_items(state, params, fragments, style)`` (device, same text, see
    ``text.py``). ``style`` is the prompt style: "ragen" renders RAGEN's text; "compact" may render a
    shorter observation with the same facts (the CPU default tokenizes every character).
gymnax's inherited ``step`` AUTO-RESETS finished episodes (and reports truncation at ``max_actions``);
that is for classic vectorised RL only. Multi-turn rollouts must call ``step_env`` / ``step_turn``, which
never reset: a finished episode stays finished.

Text layer
----------
``env.text_layer(tokenizer, params, prompt_style="ragen"|"compact", max_actions_per_turn=2,
max_response_tokens=None) -> TextLayer`` builds the token tables once on the host. ``TextLayer``:
  - ``system_text() -> str``, ``system_tokens() -> int32 ndarray`` (host; static per layer)
  - ``render(state) -> (int32[obs_len], length)`` device; ``render_text(state) -> str`` host (same text)
  - ``render_turn(state, turn, warning=False) -> (int32[turn_len], length)`` / ``turn_text(...)``: the
    whole user turn ("\\nTurn k:\\nState:\\n{obs}\\n... You have N actions left. ...")
  - ``render_reward(reward) -> (int32[L], length)`` / ``reward_text(reward)``: "Reward:\\n{r}\\n"
  - ``parse(tokens int32[R], length, state=None) -> Parsed`` (actions int32[K], n_valid, n_parsed,
    matched, format_ok); ``state`` is needed only by envs whose action names depend on the state (Bandit).
    Cost knobs (static): ``bytes_per_token`` (default 4) caps the response at R * min(W, 4) bytes (a longer
    response is read as if cut there); ``answer_window`` (default 64) reads at most that many answer
    bytes; pieces closed by "||" inside it are exact, and an answer cut before K pieces are known is an
    invalid turn (never credited). ``None`` for both = exact RAGEN semantics for any response (the tests check that mode).
  - ``step_turn(key, state, parsed, params=None) -> (state, turn_reward f32[], done bool[], info)`` with
    info = {"success", "n_executed", "format_ok", "actions_left"}.
All device methods are jit/vmap-able. Free-text envs (Countdown) override ``TextEnv.parse_bytes``
(returning any struct with ``n_valid``, ``n_parsed``, ``format_ok``) and ``TextEnv.step_turn``.

Host side (the env's own knowledge that the library calls without knowing the env)
------------------------------------------------------------------------------------
  - ``parse_pieces(pieces, matched, complete, state, params, max_actions) -> (parsed, n_valid)``: host
    mode's counterpart of ``parse_bytes``, from the answer pieces of RAGEN's ``re`` parse. The default
    maps names through ``action_ids_by_name(state)`` (lower-cased name -> id; Bandit's depend on the
    state); free-text envs (Countdown) override ``parse_pieces``.
  - ``demo_policy() -> envs.demos.DemoPolicy``: the solver and the reasoning text of the supervised
    warm start's demonstrations; envs without one raise.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from gymnax.environments import environment

from envs import prompts
from envs.demos import DemoPolicy
from envs.text import (
    ActionVocab,
    Dynamic,
    Parsed,
    ResponseBytes,
    Static,
    TokenFragments,
    assemble,
    format_fixed,
    parse_actions,
)
from ragen_jax.models.tokenizers import Tokenizer


@struct.dataclass
class TextEnvParams:
    max_actions: int = 10


@struct.dataclass
class TextEnvState:
    time: jax.Array
    terminated: jax.Array
    success: jax.Array


def select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """Leafwise ``where(pred, on_true, on_false)`` over two states of the same structure (pred: bool[])."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def checked_action(action: jax.Array, state: TextEnvState, num_actions: int) -> tuple[jax.Array, jax.Array]:
    """(action int32[], valid bool[]): RAGEN's ids 1..num_actions on a live state are valid; anything
    else must leave the state unchanged (``select(valid, moved, state)``) and pay 0."""
    action = jnp.asarray(action, jnp.int32)
    return action, (action >= 1) & (action <= num_actions) & ~state.terminated


class TextEnv(environment.Environment):
    """Base class: gymnax env + the generic multi-action turn and the text layer factory."""

    action_lookup: dict[int, str] = {}
    reward_decimals: int = 1
    default_max_response_tokens: int = 100
    # Whether the system prompt lists the actions (RAGEN: envs whose config has an action_lookup).
    list_actions_in_system: bool = True
    # Raised when the env's demonstrations change in a way its params do not capture: it enters the
    # supervised warm start's cache key (above 1 only, so the keys of the other envs stay as they are).
    demo_format: int = 1

    # ----- contract pieces each env provides -------------------------------------------------------
    def instruction_text(self, params: Any, style: str) -> str:
        raise NotImplementedError  # abstract

    def symbol_legend(self) -> Sequence[tuple[str, str]] | None:
        return None

    def render_state_text(self, state: Any, params: Any, style: str = "ragen") -> str:
        raise NotImplementedError  # abstract

    def render_state_items(
        self, state: Any, params: Any, frags: TokenFragments, style: str = "ragen"
    ) -> list[Static | Dynamic]:
        raise NotImplementedError  # abstract

    # ----- generic parts ----------------------------------------------------------------------------
    @property
    def action_names(self) -> tuple[str, ...]:
        return tuple(self.action_lookup[i] for i in sorted(self.action_lookup))

    @property
    def num_actions(self) -> int:
        return len(self.action_lookup)

    def max_actions_per_episode(self, params: Any) -> int:
        return int(params.max_actions)

    def action_vocab(self) -> ActionVocab:
        ids = tuple(sorted(self.action_lookup))
        return ActionVocab(tuple(self.action_lookup[i] for i in ids), ids)

    def is_truncated(self, state: Any, params: Any) -> jax.Array:
        return state.time >= params.max_actions

    def is_terminated(self, state: Any, params: Any) -> jax.Array:
        return state.terminated

    def parse_bytes(
        self, buf: jax.Array, n: jax.Array, state: Any, params: Any, max_actions: int, answer_window: int | None = None
    ) -> Parsed:
        """Response bytes -> Parsed (RAGEN pipeline with this env's action names)."""
        del state, params
        return parse_actions(buf, n, self.action_vocab(), max_actions, answer_window)

    def step_turn(self, key: jax.Array, state: Any, parsed: Parsed, params: Any) -> tuple[Any, jax.Array, jax.Array, dict]:
        """Apply parsed.actions[:n_valid] in order; stop at done or when the action budget is spent.

        turn_reward = sum of the executed actions' rewards; done = terminated or time >= max_actions.
        The state is unchanged when n_valid == 0 (or the episode was already done).
        """
        num = parsed.actions.shape[0]
        keys = jax.random.split(key, num)

        def apply_one(carry, inputs):
            cur, total, executed = carry
            step_key, action, slot = inputs
            live = (slot < parsed.n_valid) & ~cur.terminated & (cur.time < params.max_actions)
            _, nxt, reward, _, _ = self.step_env(step_key, cur, action, params)
            cur = select(live, nxt, cur)
            total = total + jnp.where(live, reward, 0.0).astype(jnp.float32)
            return (cur, total, executed + live.astype(jnp.int32)), None

        init = (state, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
        (state, total, executed), _ = jax.lax.scan(
            apply_one, init, (keys, parsed.actions, jnp.arange(num))
        )
        done = state.terminated | (state.time >= params.max_actions)
        info = {
            "success": state.success,
            "n_executed": executed,
            "format_ok": parsed.format_ok,
            "actions_left": (params.max_actions - state.time).astype(jnp.int32),
        }
        return state, total, done, info

    # ----- host side: the parse of host mode, the demonstrations ----------------------------------
    def action_ids_by_name(self, state: Any) -> dict[str, int]:
        """Lower-cased action name -> action id: the names a response may use in ``state`` (host)."""
        del state
        return {name.lower(): action_id for action_id, name in self.action_lookup.items()}

    def parse_pieces(
        self, pieces: Sequence[str], matched: bool, complete: bool, state: Any, params: Any, max_actions: int
    ) -> tuple[Any, int]:
        """Host mode's parsed turn (what ``step_turn`` takes) and n_valid, from RAGEN's text parse.

        pieces: the answer's stripped non-empty "||"-pieces (<= max_actions); matched: the format regex
        matched; complete: False when the answer window cut the answer before K pieces were known (an
        invalid turn). Pieces map through ``action_ids_by_name`` with ``str.lower()``; unknown ones are
        dropped, and the turn is well-formed only if every piece is a valid action.
        """
        del params
        if not self.action_lookup:
            raise TypeError(
                f"{type(self).__name__} has no action_lookup: override parse_pieces with its free-text parse "
                "(see Countdown), or implement the HostEnv protocol directly"
            )
        names = self.action_ids_by_name(state)
        ids = [names[piece.lower()] for piece in pieces if piece.lower() in names]
        n_valid, n_parsed = len(ids), len(pieces) if complete else 1
        actions = np.zeros((max_actions,), np.int32)
        actions[:n_valid] = ids
        format_ok = matched and n_valid > 0 and n_valid == n_parsed
        parsed = Parsed(
            actions=jnp.asarray(actions), n_valid=jnp.int32(n_valid), n_parsed=jnp.int32(n_parsed),
            matched=jnp.asarray(matched), format_ok=jnp.asarray(format_ok),
        )
        return parsed, n_valid

    def demo_policy(self) -> DemoPolicy:
        """The solver that writes this env's supervised demonstrations (``envs/demos.py``)."""
        raise ValueError(
            f"no demonstration policy for {type(self).__name__}; define {type(self).__name__}.demo_policy, or "
            "pass DemoWriter(..., policy=...) with plan_length and turn methods (see envs.demos.DemoPolicy)"
        )

    def text_layer(
        self,
        tokenizer: Tokenizer,
        params: Any = None,
        prompt_style: str = "ragen",
        max_actions_per_turn: int = 2,
        max_response_tokens: int | None = None,
        bytes_per_token: int | None = 4,
        answer_window: int | None = 64,
    ) -> "TextLayer":
        return TextLayer(
            self,
            tokenizer,
            self.default_params if params is None else params,
            prompt_style,
            max_actions_per_turn,
            self.default_max_response_tokens if max_response_tokens is None else max_response_tokens,
            bytes_per_token,
            answer_window,
        )


def to_host(state: Any) -> Any:
    """A single (unbatched) state as numpy arrays, for host-side text rendering."""
    return jax.tree.map(np.asarray, state)


class TextLayer:
    """Token tables for one (env, tokenizer, params, prompt style); see the module docstring."""

    def __init__(
        self,
        env: TextEnv,
        tokenizer: Tokenizer,
        params: Any,
        prompt_style: str,
        max_actions_per_turn: int,
        max_response_tokens: int,
        bytes_per_token: int | None = 4,
        answer_window: int | None = 64,
    ) -> None:
        if max_actions_per_turn < 1:
            raise ValueError(f"max_actions_per_turn must be >= 1, got {max_actions_per_turn}")
        self.env = env
        self.tokenizer = tokenizer
        self.params = params
        self.style_name = prompt_style
        self.style = prompts.get_style(prompt_style)
        self.max_actions_per_turn = max_actions_per_turn
        self.max_response_tokens = max_response_tokens
        self.bytes_per_token = bytes_per_token
        self.answer_window = answer_window
        self.response_bytes = ResponseBytes.from_tokenizer(tokenizer)
        self.fragments = TokenFragments(tokenizer)
        self._turn_digits = 3
        self._budget_digits = max(1, len(str(int(params.max_actions))))
        self._reward_int_digits = 6

    # ----- host text ----------------------------------------------------------------------------------
    def system_text(self) -> str:
        return prompts.system_text(
            self.style,
            self.env.instruction_text(self.params, self.style_name),
            self.env.symbol_legend() if self.style.show_legend else None,
            self.env.action_names if self.env.list_actions_in_system else None,
            self.env.max_actions_per_episode(self.params),
        )

    def system_tokens(self) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(self.system_text()), np.int32)

    def render_text(self, state: Any) -> str:
        return self.env.render_state_text(to_host(state), self.params, self.style_name)

    def turn_text(self, state: Any, turn: int, warning: bool = False) -> str:
        host = to_host(state)
        left = int(self.params.max_actions) - int(host.time)
        return prompts.turn_text(self.style, turn, self.render_text(state), left, self.max_response_tokens, warning)

    def reward_text(self, reward: float) -> str:
        return prompts.reward_text(self.style, format_fixed(float(reward), self.env.reward_decimals))

    # ----- device rendering -------------------------------------------------------------------------
    def _obs_items(self, state: Any) -> list[Static | Dynamic]:
        return self.env.render_state_items(state, self.params, self.fragments, self.style_name)

    def render(self, state: Any) -> tuple[jax.Array, jax.Array]:
        """The observation text of ``state`` as (tokens int32[obs_len], length int32[])."""
        return assemble(self._obs_items(state), self.tokenizer.pad_id)

    def render_turn(self, state: Any, turn: jax.Array, warning: jax.Array | bool = False) -> tuple[jax.Array, jax.Array]:
        """The whole user turn (``turn_text``) as (tokens int32[turn_len], length)."""
        f, s = self.fragments, self.style
        left = self.params.max_actions - state.time
        items: list[Static | Dynamic] = [
            f.static(s.turn_prefix), f.int_items(turn, self._turn_digits), f.static(s.turn_after_number),
            *self._obs_items(state), f.static(s.turn_after_obs), f.optional(s.warning, jnp.asarray(warning)),
            f.static(s.actions_left_prefix), f.int_items(left, self._budget_digits + 1),
            f.static(s.actions_left_suffix),
        ]
        if s.show_max_tokens:
            items.append(f.static(str(self.max_response_tokens)))
        items.append(f.static(s.turn_suffix))
        return assemble(items, self.tokenizer.pad_id)

    def render_reward(self, reward: jax.Array) -> tuple[jax.Array, jax.Array]:
        f, s = self.fragments, self.style
        items = [
            f.static(s.reward_prefix),
            f.fixed_items(reward, self.env.reward_decimals, self._reward_int_digits),
            f.static(s.reward_suffix),
        ]
        return assemble(items, self.tokenizer.pad_id)

    @property
    def obs_len(self) -> int:
        """Static length of ``render``'s token buffer."""
        state = jax.eval_shape(lambda k: self.env.reset_env(k, self.params)[1], jax.random.PRNGKey(0))
        return int(jax.eval_shape(self.render, state)[0].shape[0])

    # ----- device parsing and stepping --------------------------------------------------------------
    def parse(self, tokens: jax.Array, length: jax.Array, state: Any = None) -> Parsed:
        """Generated tokens (WITHOUT the prompt's trailing "<think>") -> Parsed."""
        max_bytes = None if self.bytes_per_token is None else tokens.shape[0] * self.bytes_per_token
        buf, n = self.response_bytes(tokens, length, max_bytes)
        return self.env.parse_bytes(buf, n, state, self.params, self.max_actions_per_turn, self.answer_window)

    def step_turn(
        self, key: jax.Array, state: Any, parsed: Parsed, params: Any = None
    ) -> tuple[Any, jax.Array, jax.Array, dict]:
        """``env.step_turn`` with this layer's params unless ``params`` is given."""
        return self.env.step_turn(key, state, parsed, self.params if params is None else params)
