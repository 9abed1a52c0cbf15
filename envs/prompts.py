"""Prompt texts of RAGEN-2 (``ctx_manager.py``) and a compact variant with the same structure.

Message layout of one episode (RAGEN "full" context mode):
  system    = SYSTEM_PREFIX + instruction + symbol legend + action list (``system_text``)
  user 1    = turn text (``turn_parts``) with the state observation inside
  assistant = "<think>...</think><answer>...</answer>"
  user k    = reward text of turn k-1 (``REWARD_TEMPLATE``) + turn text of turn k
The "ragen" style reproduces RAGEN's strings character for character; "compact" keeps the structure
but shortens the fixed text to what a model trained from scratch on demonstrations needs (the CPU
default tokenizes every character, and every episode pays for the system prompt): no symbol legend
(the instruction names the symbols), no action budget line, no format reminder, and envs may render a
shorter observation (``render_state_text(..., style="compact")``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

PROMPT_STYLES = ("ragen", "compact")


@dataclass(frozen=True)
class PromptStyle:
    """The fixed strings of one prompt style. ``turn_*`` strings surround the dynamic numbers:

    turn text = turn_prefix + str(turn) + turn_after_number + obs + turn_after_obs + [warning]
                + actions_left_prefix + str(actions_left) + actions_left_suffix
                + str(max_response_tokens) + turn_suffix
    """

    system_prefix: str
    show_legend: bool
    legend_header: str
    legend_separator: str
    actions_header: str
    budget_template: str  # formatted with max_actions
    turn_prefix: str
    turn_after_number: str
    turn_after_obs: str
    warning: str
    actions_left_prefix: str
    actions_left_suffix: str
    turn_suffix: str
    show_max_tokens: bool
    reward_prefix: str
    reward_suffix: str


RAGEN = PromptStyle(
    system_prefix="You're a helpful assistant. ",
    show_legend=True,
    legend_header="\nThe meaning of each symbol in the state is:\n",
    legend_separator=", ",
    actions_header="\nYour available actions are:\n",
    budget_template='\nYou can make up to {max_actions} actions, separated by the action separator " || "\n',
    turn_prefix="\nTurn ",
    turn_after_number=":\nState:\n",
    turn_after_obs="\n",
    warning="No valid action provided previously. Environment state remains the same. Please try again.\n",
    actions_left_prefix="You have ",
    actions_left_suffix=(
        " actions left. Always output: <think> [Your thoughts] </think> <answer> [your answer] </answer> "
        "with no extra text. Strictly follow this format. Max response length: "
    ),
    turn_suffix=" words (tokens).\n",
    show_max_tokens=True,
    reward_prefix="Reward:\n",
    reward_suffix="\n",
)

COMPACT = PromptStyle(
    system_prefix="",
    show_legend=False,  # the instruction names the symbols the observation uses
    legend_header="\nSymbols: ",
    legend_separator=", ",
    actions_header="\nActions: ",
    budget_template="\n",
    turn_prefix="\nTurn ",
    turn_after_number=":\n",
    turn_after_obs="\n",
    warning="Invalid answer, state unchanged.\n",
    actions_left_prefix="Actions left: ",
    actions_left_suffix=".\n",  # the format is shown by the prompt's trailing "<think>"
    turn_suffix="",
    show_max_tokens=False,
    reward_prefix="Reward:\n",
    reward_suffix="\n",
)


def get_style(name: str) -> PromptStyle:
    if name == "ragen":
        return RAGEN
    if name == "compact":
        return COMPACT
    raise ValueError(f"unknown prompt_style {name!r}; use one of {PROMPT_STYLES}")


def system_text(
    style: PromptStyle,
    instruction: str,
    legend: Sequence[tuple[str, str]] | None,
    action_names: Sequence[str] | None,
    max_actions: int,
) -> str:
    """RAGEN ``_build_system_content`` + ``_init_prefix_lookup``: prefix + instruction
    + "\\nThe meaning of each symbol in the state is:\\n" + "S: meaning, ..." (grid envs)
    + "\\nYour available actions are:\\n" + "A, B, ..." + budget line (envs with an action lookup)."""
    text = style.system_prefix + instruction
    if legend:
        text += style.legend_header + style.legend_separator.join(f"{s}: {m}" for s, m in legend)
    if action_names:
        text += style.actions_header + ", ".join(action_names)
        text += style.budget_template.format(max_actions=max_actions)
    return text


def turn_text(style: PromptStyle, turn: int, obs: str, actions_left: int, max_tokens: int, warning: bool) -> str:
    """The user turn text of RAGEN ``_build_turn_state_content`` (ragen style)."""
    text = style.turn_prefix + str(turn) + style.turn_after_number + obs + style.turn_after_obs
    if warning:
        text += style.warning
    text += style.actions_left_prefix + str(actions_left) + style.actions_left_suffix
    if style.show_max_tokens:
        text += str(max_tokens)
    return text + style.turn_suffix


def reward_text(style: PromptStyle, reward_str: str) -> str:
    """"Reward:\\n{r}\\n" (the reward is formatted by the caller)."""
    return style.reward_prefix + reward_str + style.reward_suffix
