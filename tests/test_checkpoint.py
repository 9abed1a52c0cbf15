import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ragen_jax.train.checkpoint import Checkpointer, NonFiniteCheckpointError, PreemptionGuard


def _state(x):
    return {"params": {"w": jnp.full((3, 2), x, jnp.float32), "b": jnp.arange(4.0) * x},
            "rng": jax.random.key_data(jax.random.key(int(x))), "step": jnp.asarray(int(x), jnp.int32)}


def test_save_restore_keeps_last_k_and_restores_exactly(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, _state(float(step)), {"step": step, "seed_counter": 10 * step})
    assert ckpt.all_steps() == [2, 3] and ckpt.latest_step() == 3
    state, meta, step = ckpt.restore(_state(0.0))
    assert step == 3 and meta == {"step": 3, "seed_counter": 30}
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(_state(3.0))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    old, _, _ = ckpt.restore(_state(0.0), step=2)
    assert float(old["params"]["w"][0, 0]) == 2.0
    ckpt.close()


def test_refuses_nan_and_keeps_previous(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    ckpt.save(1, _state(1.0), {"step": 1})
    bad = _state(2.0)
    bad["params"]["w"] = bad["params"]["w"].at[0, 0].set(jnp.nan)
    with pytest.raises(NonFiniteCheckpointError, match=r"\['params'\]\['w'\]"):
        ckpt.save(2, bad, {"step": 2})
    assert ckpt.all_steps() == [1]


def test_half_written_checkpoint_is_never_picked_up(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    ckpt.save(1, _state(1.0), {"step": 1})
    ckpt.close()
    # What an interrupted orbax save leaves behind: a temporary directory for step 2.
    os.makedirs(tmp_path / "ckpt" / "2.orbax-checkpoint-tmp-123" / "state")
    again = Checkpointer(str(tmp_path / "ckpt"))
    assert again.latest_step() == 1
    state, meta, step = again.restore(_state(0.0))
    assert step == 1 and meta["step"] == 1


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        Checkpointer(str(tmp_path / "empty")).restore(_state(0.0))


def test_preemption_guard_turns_sigterm_into_a_flag():
    guard = PreemptionGuard()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.requested
    finally:
        guard.close()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def _damage(directory, step):
    import glob

    files = [f for f in glob.glob(os.path.join(directory, str(step), "state", "**", "d", "*"), recursive=True)
             if os.path.isfile(f)]
    assert files
    for f in files:
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)


def _big_state(x):  # big enough that the array bytes live in the data files _damage truncates
    return {"w": jnp.arange(4096.0).reshape(64, 64) * x, "b": jnp.arange(4.0) * x}


def test_the_protected_step_survives_rotation(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2)
    ckpt.save(1, _state(1.0), {"step": 1})
    ckpt.protect(1)
    for step in (2, 3, 4):
        ckpt.save(step, _state(float(step)), {"step": step})
    assert ckpt.all_steps() == [1, 3, 4]
    ckpt.protect(4)
    ckpt.save(5, _state(5.0), {"step": 5})
    assert ckpt.all_steps() == [4, 5]


def test_restore_newest_skips_a_damaged_checkpoint_in_one_line_and_quarantine_moves_it(tmp_path):
    directory = str(tmp_path / "ckpt")
    ckpt = Checkpointer(directory)
    for step in (1, 2, 3):
        ckpt.save(step, _big_state(float(step)), {"step": step})
    ckpt.close()
    _damage(directory, 3)
    again = Checkpointer(directory)
    lines = []
    state, meta, step, damaged = again.restore_newest(_big_state(0.0), log=lines.append)
    assert step == 2 and meta == {"step": 2} and damaged == [3]
    np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(_big_state(2.0)["w"]))
    assert len(lines) == 1 and "step 3" in lines[0] and "trying step 2" in lines[0] and "\n" not in lines[0]
    assert again.all_steps() == [1, 2, 3]  # restoring reads only
    moved = again.quarantine(damaged)
    assert again.all_steps() == [1, 2] and os.listdir(moved)[0].startswith("3-")
    again.save(3, _big_state(3.0), {"step": 3})  # the step can be saved again
    assert again.all_steps() == [1, 2, 3]


def test_no_restorable_checkpoint_is_one_line(tmp_path):
    from ragen_jax.train.checkpoint import CheckpointRestoreError

    directory = str(tmp_path / "ckpt")
    ckpt = Checkpointer(directory)
    ckpt.save(1, _big_state(1.0), {"step": 1})
    _damage(directory, 1)
    with pytest.raises(CheckpointRestoreError, match=r"^none of the checkpoints .* \(steps 1\)") as info:
        Checkpointer(directory).restore_newest(_big_state(0.0), log=lambda line: None)
    assert "\n" not in str(info.value)
