"""The multi-turn rollout: the token layout, the fused on-device loop, the host-stepped reference, the
host-env bridge, Trajectories and validation rollouts."""
