"""RL math as pure functions over arrays (advantages, losses, SNR-Aware Filtering), the fused update
step and its optimizers."""
