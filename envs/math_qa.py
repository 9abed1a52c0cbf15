"""MathQA (RAGEN's ``MetamathQA`` env, ``ragen/env/metamathqa/env.py``, ``config/_5_metamathqa.yaml``).

The observation is a question; the model answers in ``<answer>...</answer>``; the answer is correct iff
``re.sub(r"\\s+", "", answer.lower())`` equals the same form of the label. Reward 1/2^attempt for a
correct answer, else 0; RAGEN's ``max_actions_per_traj`` is 1, so the episode is a single attempt with
reward in {0, 1} and success = correct. With ``max_actions`` > 1 the later attempts follow RAGEN too: a
correct answer ends the episode; after a wrong one the observation is "Incorrect. Please think again."
(and the episode ends when the budget is spent).

Data (``envs/math_qa_data.py``): generated grade-school word problems (the default) or a local
MetaMathQA / GSM8K file (``data_path``). RAGEN draws an item uniformly under the episode's seed from
MetaMathQA's train split, for training and validation alike; here reset draws the item id uniformly
from the table. The table is built once on the host (``load_table``); the questions are pre-tokenized
into a device table by the text layer, the normalised labels are a uint8[N, A] table, so reset, render,
parse and the check all run inside the jitted rollout (``envs/math_qa_check.py``).

The action is free text (like Countdown's): the first non-blank stripped "||"-piece of the answer,
as bytes (``MathQAAction``). Bytes that were not valid UTF-8 in the response are written as 0xFF, which
never matches (the reference decodes them as U+FFFD, which no label holds). An action longer than
``max_action_bytes`` (128) scores 0 (``action_too_long``); a text layer built with an ``answer_window``
makes a longer answer an invalid turn, as for every env. Items whose normalised label is longer than
``max_label_bytes`` are not in the table.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envs.base import TextEnv, TextEnvParams, TextEnvState, select
from envs.math_qa_check import answer_matches, decode_utf8
from envs.math_qa_data import ItemTable, load_table
from envs.math_qa_solver import MathQAPolicy
from envs.text import (
    Dynamic,
    Static,
    TokenFragments,
    answer_cut,
    answer_pieces,
    byte_classes,
    clean_answer,
    parse_answer,
)

RAGEN_INSTRUCTION = "You are solving Math problems. "
COMPACT_INSTRUCTION = "Math: solve the problem, then give the final answer.\n"
CORRECT, INCORRECT = "Correct!", "Incorrect. Please think again."
_INVALID_BYTE = 0xFF  # never part of valid UTF-8


@struct.dataclass
class MathQAParams(TextEnvParams):
    """max_actions: RAGEN max_actions_per_traj (1: a single attempt).
    data_path: "" = generated problems, else a local MetaMathQA / GSM8K file (.json, .jsonl).
    num_items: generated problems in the table; for a file, at most this many items (a seeded subset,
      0 = all). data_seed: the generator's seed (the subset's for a file).
    max_label_bytes: the widest normalised label (longer ones are dropped); max_question_bytes: the
      longest question kept (0 = any); max_action_bytes: the longest answer the device checks.
    max_steps: generated problems only: the most arithmetic steps a problem's solution takes (1-4).
    max_number: generated problems only: the largest number in a question or its worked steps (10-99).
    """

    max_actions: int = 1
    data_path: str = struct.field(pytree_node=False, default="")
    num_items: int = struct.field(pytree_node=False, default=4096)
    data_seed: int = struct.field(pytree_node=False, default=0)
    max_label_bytes: int = struct.field(pytree_node=False, default=32)
    max_question_bytes: int = struct.field(pytree_node=False, default=0)
    max_action_bytes: int = struct.field(pytree_node=False, default=128)
    max_steps: int = struct.field(pytree_node=False, default=4)
    max_number: int = struct.field(pytree_node=False, default=99)


@struct.dataclass
class MathQAState(TextEnvState):
    """item: int32[], the question's row of the table."""

    item: jax.Array


@struct.dataclass
class MathQAAction:
    """One free-text answer: text uint8[A] (bytes past ``length`` are ignored), length int32[]
    (0 = no action; > A = too long to check)."""

    text: jax.Array
    length: jax.Array


@struct.dataclass
class MathQAParsed:
    """A parsed turn: the first answer piece and RAGEN's bookkeeping (every non-blank piece is valid)."""

    action: MathQAAction
    n_valid: jax.Array
    n_parsed: jax.Array
    matched: jax.Array
    format_ok: jax.Array


def item_table(params: MathQAParams) -> ItemTable:
    """The (cached) item table of these settings."""
    return load_table(params.data_path, params.num_items, params.data_seed, params.max_label_bytes,
                      params.max_question_bytes, params.max_steps, params.max_number)


class MathQA(TextEnv):
    """RAGEN's MetaMathQA as a TextEnv (single turn, one free-text answer)."""

    action_lookup: dict[int, str] = {}
    reward_decimals = 2
    default_max_response_tokens = 100
    list_actions_in_system = False
    demo_format = 2  # the noisy demonstration of a generated problem answers with the question's unit

    @property
    def default_params(self) -> MathQAParams:
        return MathQAParams()

    @property
    def name(self) -> str:
        return "MathQA"

    # ----- gymnax -------------------------------------------------------------------------------
    def get_obs(self, state: MathQAState, params: Any = None, key: Any = None) -> jax.Array:
        """int32[2]: [item, attempts made]."""
        return jnp.stack([state.item, state.time]).astype(jnp.int32)

    def reset_env(self, key: jax.Array, params: MathQAParams) -> tuple[jax.Array, MathQAState]:
        item = jax.random.randint(key, (), 0, len(item_table(params))).astype(jnp.int32)
        state = MathQAState(time=jnp.int32(0), terminated=jnp.bool_(False), success=jnp.bool_(False), item=item)
        return self.get_obs(state), state

    def step_env(
        self, key: jax.Array, state: MathQAState, action: MathQAAction, params: MathQAParams
    ) -> tuple[jax.Array, MathQAState, jax.Array, jax.Array, dict]:
        """Check the answer: reward 1/2^attempt if correct (the episode ends), else 0. A blank action
        (length 0) is a no-op."""
        del key
        table = item_table(params)
        label = jnp.asarray(table.label_bytes)[state.item]
        label_len = jnp.asarray(table.label_lengths)[state.item]
        width = action.text.shape[-1]
        fits = action.length <= width
        live = (action.length > 0) & ~state.terminated
        correct = live & fits & answer_matches(action.text, jnp.minimum(action.length, width), label, label_len)
        reward = jnp.where(correct, 0.5 ** state.time.astype(jnp.float32), 0.0).astype(jnp.float32)
        new_state = state.replace(
            time=state.time + live.astype(jnp.int32),
            terminated=state.terminated | correct,
            success=state.success | correct,
        )
        info = {"correct": correct, "action_too_long": live & ~fits}
        return self.get_obs(new_state), new_state, reward, new_state.terminated, info

    # ----- text ---------------------------------------------------------------------------------
    def instruction_text(self, params: Any, style: str) -> str:
        return RAGEN_INSTRUCTION if style == "ragen" else COMPACT_INSTRUCTION

    def render_state_text(self, state: MathQAState, params: MathQAParams, style: str = "ragen") -> str:
        """The question before the first attempt, then RAGEN's feedback (the same in both styles)."""
        if int(state.time) == 0:
            return item_table(params).questions[int(state.item)]
        return CORRECT if bool(state.success) else INCORRECT

    def render_state_items(
        self, state: MathQAState, params: MathQAParams, frags: TokenFragments, style: str = "ragen"
    ) -> list[Static | Dynamic]:
        """Device mirror of ``render_state_text``: the question is row ``item`` of a table of every
        question, tokenized once per tokenizer."""
        questions = frags.table(item_table(params).questions)
        first = state.time == 0
        return [
            Dynamic(questions, jnp.reshape(state.item, (1,)).astype(jnp.int32), jnp.reshape(first, (1,))),
            frags.optional(CORRECT, ~first & state.success),
            frags.optional(INCORRECT, ~first & ~state.success),
        ]

    def parse_bytes(
        self,
        buf: jax.Array,
        n: jax.Array,
        state: Any,
        params: MathQAParams,
        max_actions: int,
        answer_window: int | None = None,
    ) -> MathQAParsed:
        """RAGEN's parse for a language env: the first non-blank stripped "||"-piece is the answer.

        buf: uint8[B] response bytes, n: int32[]. As Countdown's: an answer longer than
        ``answer_window`` whose first pieces are not all closed inside it is an invalid turn.
        """
        del state
        classes = byte_classes(buf, n)
        # Mark the bytes that are not valid UTF-8 in the response itself, before the tags are removed
        # (a removal must not join stray bytes into a character).
        _, _, _, ok = decode_utf8(buf, n)
        marked = classes + 4 * (~ok).astype(jnp.int32)
        span = parse_answer(buf, n, classes)
        ans, cls, ans_n = clean_answer(buf, n, span, marked, answer_window)
        cut = answer_cut(span, answer_window)
        width = params.max_action_bytes if answer_window is None else min(params.max_action_bytes, answer_window)
        pieces = answer_pieces(ans, cls, ans_n, max_actions, width, cut)
        n_valid = jnp.where(pieces.complete, pieces.n_parsed, 0).astype(jnp.int32)
        n_parsed = jnp.where(pieces.complete, pieces.n_parsed, jnp.maximum(pieces.n_parsed, 1)).astype(jnp.int32)
        length = jnp.where(n_valid > 0, pieces.lengths[0], 0).astype(jnp.int32)
        text = jnp.where(pieces.classes[0] >= 4, jnp.uint8(_INVALID_BYTE), pieces.bytes[0]).astype(jnp.uint8)
        return MathQAParsed(
            action=MathQAAction(text=text, length=length),
            n_valid=n_valid,
            n_parsed=n_parsed,
            matched=span.matched,
            format_ok=span.matched & (n_valid > 0) & (n_valid == n_parsed),
        )

    def parse_pieces(
        self, pieces: Sequence[str], matched: bool, complete: bool, state: Any, params: MathQAParams,
        max_actions: int,
    ) -> tuple[MathQAParsed, int]:
        """Host mode's parse (``TextEnv.parse_pieces``): the first piece is the answer (its UTF-8 bytes,
        cut to ``max_action_bytes``; ``length`` keeps the full length, so a longer one scores 0)."""
        del complete, state, max_actions
        width = params.max_action_bytes
        first = pieces[0].encode("utf-8") if pieces else b""
        text = np.zeros((width,), np.uint8)
        text[: min(len(first), width)] = np.frombuffer(first[:width], np.uint8)
        n = len(pieces)
        parsed = MathQAParsed(
            action=MathQAAction(text=jnp.asarray(text), length=jnp.int32(len(first))),
            n_valid=jnp.int32(n), n_parsed=jnp.int32(n), matched=jnp.asarray(matched),
            format_ok=jnp.asarray(matched and n > 0),
        )
        return parsed, n

    def demo_policy(self) -> MathQAPolicy:
        return MathQAPolicy(item_table)

    def step_turn(
        self, key: jax.Array, state: MathQAState, parsed: MathQAParsed, params: MathQAParams
    ) -> tuple[MathQAState, jax.Array, jax.Array, dict]:
        """Check the first answer piece (one attempt per turn). info as ``TextEnv.step_turn``."""
        live = (parsed.n_valid > 0) & ~state.terminated & (state.time < params.max_actions)
        _, nxt, reward, _, _ = self.step_env(key, state, parsed.action, params)
        state = select(live, nxt, state)
        reward = jnp.where(live, reward, 0.0).astype(jnp.float32)
        done = state.terminated | (state.time >= params.max_actions)
        info = {
            "success": state.success,
            "n_executed": live.astype(jnp.int32),
            "format_ok": parsed.format_ok,
            "actions_left": (params.max_actions - state.time).astype(jnp.int32),
        }
        return state, reward, done, info
