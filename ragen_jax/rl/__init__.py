"""RL math as pure functions over arrays (group statistics, advantages, losses, SNR-Aware Filtering),
the fused update step and its optimizers."""
