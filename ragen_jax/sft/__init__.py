"""Supervised warm start: solver demonstrations and the cached SFT policy that ``init=sft`` starts RL from."""
