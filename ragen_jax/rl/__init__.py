"""RL math as pure functions over arrays: advantages, losses, SNR-Aware Filtering."""
