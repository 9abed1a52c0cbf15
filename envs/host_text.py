"""The text side shared by the plain-Python host envs (``envs/code_exec.py``, ``envs/search_qa.py``).

``parse_answer`` is RAGEN's response parse (``ragen/llm_agent/ctx_manager.py``): the response, prefixed
with the prompt's "<think>", must match ``<think>(.*?)</think>\\s*<answer>(.*?)</answer>`` (first match,
DOTALL); the answer has the special strings removed, is split on "||", each piece stripped, empty ones
dropped, the first ``max_actions`` kept. No match: no pieces. ``HostPrompt`` writes RAGEN's messages
through ``envs/prompts.py``: the system message ("You're a helpful assistant. " + the env's
instruction), the turn text ("\\nTurn k:\\nState:\\n{obs}\\n...You have {n} actions left...") and
"Reward:\\n{r}\\n" with Python's ``str`` of the float reward, as RAGEN's f-string prints it.
"""

from __future__ import annotations

import dataclasses
import re

from envs import prompts

ANSWER_PATTERN = re.compile(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.DOTALL)
SPECIALS = ("<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>")


def parse_answer(response_text: str, max_actions: int) -> tuple[bool, tuple[str, ...]]:
    """(matched, pieces) of a response given without the prompt's leading "<think>"."""
    match = ANSWER_PATTERN.search("<think>" + response_text)
    if match is None:
        return False, ()
    answer = match.group(2)
    for special in SPECIALS:
        answer = answer.replace(special, "")
    pieces = [piece.strip() for piece in answer.split("||")]
    return True, tuple(piece for piece in pieces if piece)[:max_actions]


@dataclasses.dataclass(frozen=True)
class HostPrompt:
    """RAGEN's message texts for one env. style: "ragen" | "compact" (``envs/prompts.py``);
    max_response_tokens: the "Max response length" of the turn text (RAGEN envs.yaml ``max_tokens``)."""

    instruction: str
    style_name: str = "ragen"
    max_response_tokens: int = 400

    @property
    def style(self) -> prompts.PromptStyle:
        return prompts.get_style(self.style_name)

    def system_text(self) -> str:
        return prompts.system_text(self.style, self.instruction, None, None, 0)

    def turn_text(self, turn: int, obs: str, actions_left: int, warning: bool = False) -> str:
        return prompts.turn_text(self.style, turn, obs, actions_left, self.max_response_tokens, warning)

    def reward_text(self, reward: float) -> str:
        return prompts.reward_text(self.style, str(float(reward)))
