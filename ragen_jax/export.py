"""Export a trained policy to a Hugging Face directory: ``python -m ragen_jax.export RUN_DIR OUT_DIR``.

    python -m ragen_jax.export runs/frozen_lake-grpo-seed0 exported/ [--step N] [--overwrite]
    export_hf("runs/frozen_lake-grpo-seed0", "exported/")        # -> "exported/"

What it reads: ``RUN_DIR/config.json`` (the resolved config ``ragen_jax.main`` writes) and the actor
parameters of the latest (or ``--step``) checkpoint under ``RUN_DIR/checkpoints`` (what
``trainer.train`` saves). The actor is rebuilt exactly as the trainer builds it
(``run_setup.build_tokenizer`` / ``build_policy``; nothing is compiled, no rollout is built) and only
its parameters are restored from the checkpoint (an orbax partial restore: critic, optimizer moments
and reference weights are never read).

What it writes (``hf_io.save_hf_checkpoint``): ``config.json`` (Qwen2ForCausalLM or
LlamaForCausalLM), ``model.safetensors`` in the run's parameter dtype, and the tokenizer files when
the run has a Hugging Face tokenizer (``model.hf_path``: the checkpoint's own files; ``model.gguf_path``:
the tokenizer rebuilt from the GGUF metadata, with the file's chat template in tokenizer_config.json).
The tiny preset's byte-level ``CharTokenizer`` has no Hugging Face form: no tokenizer files are written
and the printed summary says how its ids map (8 special tokens, then byte b -> 8 + b).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from flax import nnx

from ragen_jax.models.tokenizers import SPECIAL_TOKENS, CharTokenizer
from ragen_jax.models.transformer import Transformer
from ragen_jax.parallel.distributed import nonfinite_leaves
from ragen_jax.setup.build import build_policy, build_tokenizer
from ragen_jax.train.checkpoint import one_line

CONFIG_FILE = "config.json"
CHECKPOINT_DIR = "checkpoints"


class ExportError(ValueError):
    """A run directory or output directory that cannot be exported from / to; the message names the fix."""


@dataclasses.dataclass
class RestoredPolicy:
    """The actor of one checkpoint, with what is needed to use or export it."""

    model: Transformer
    tokenizer: Any
    config: ml_collections.ConfigDict
    step: int


def read_run_config(run_dir: str | os.PathLike) -> ml_collections.ConfigDict:
    """``RUN_DIR/config.json`` as a ConfigDict (the resolved config ``ragen_jax.main`` wrote)."""
    file = Path(run_dir) / CONFIG_FILE
    if not file.is_file():
        raise ExportError(
            f"{file} not found: RUN_DIR must be a run directory written by `python -m ragen_jax.main` "
            "(it writes the resolved config there)"
        )
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ExportError(f"{file} is not valid JSON ({e}); the run directory is damaged") from None
    return ml_collections.ConfigDict(data)


def _actor_template(config: ml_collections.ConfigDict) -> tuple[Transformer, Any]:
    """(actor built as ``trainer.build_run`` builds it, tokenizer), as a template for the checkpoint's
    values: neither the critic nor the supervised warm start's weights are built or read, because the
    actor's structure depends on neither the advantage estimator nor ``init``."""
    actor_only = copy.deepcopy(config)
    actor_only.algorithm.adv_estimator = "grpo"  # build_policy builds a critic only for "gae"
    actor_only.init = "random"  # init=sft would load (or even train) the warm start, then be overwritten
    tokenizer = build_tokenizer(actor_only)
    actor, _ = build_policy(actor_only, tokenizer)
    return actor, tokenizer


def _candidate_steps(manager: ocp.CheckpointManager, directory: Path, step: int | None) -> list[int]:
    """The steps to try, in order: ``step`` alone, or every step newest first."""
    steps = sorted(manager.all_steps())
    if not steps:
        raise ExportError(
            f"no checkpoint in {directory}: train at least one step first (checkpoints are written every "
            "trainer.checkpoint_every steps and at the end of a run)"
        )
    if step is None:
        return steps[::-1]
    if step not in steps:
        raise ExportError(f"no checkpoint for step {step} in {directory}; available steps: {steps}")
    return [step]


def restore_policy(run_dir: str | os.PathLike, step: int | None = None) -> RestoredPolicy:
    """The actor of the latest (or ``step``) checkpoint of ``run_dir``, as a Transformer on one device.

    Without ``step``, a checkpoint that does not restore (a damaged file) or holds non-finite values is
    reported in one line on stderr and the one before it is used, as a resumed run does."""
    config = read_run_config(run_dir)
    directory = Path(run_dir).resolve() / CHECKPOINT_DIR
    if not directory.is_dir():
        raise ExportError(
            f"no checkpoint directory {directory}: train at least one step first (checkpoints are written "
            "every trainer.checkpoint_every steps and at the end of a run)"
        )
    actor, tokenizer = _actor_template(config)
    graphdef, params = nnx.split(actor)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, params)
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False))
    errors = []
    try:
        for candidate in _candidate_steps(manager, directory, step):
            try:
                # trainer.train saves {"state": TrainState.tree(), "meta": ...}; read the "actor" subtree only.
                restored = manager.restore(
                    candidate,
                    args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                        item={"actor": abstract},
                        restore_args={"actor": ocp.checkpoint_utils.construct_restore_args(abstract)},
                        partial_restore=True,
                    )),
                )
                actor_params = restored["state"]["actor"]
                bad = nonfinite_leaves(actor_params)
                if bad:
                    raise ValueError(f"non-finite values in {bad[0]}")
            except Exception as e:  # orbax / tensorstore raise many types for a damaged file
                errors.append(f"step {candidate}: {one_line(e)}")
                print(f"warning: checkpoint step {candidate} in {directory} does not restore ({one_line(e)})",
                      file=sys.stderr, flush=True)
                continue
            return RestoredPolicy(model=nnx.merge(graphdef, actor_params), tokenizer=tokenizer, config=config,
                                  step=candidate)
    finally:
        manager.close()
    raise ExportError(f"no checkpoint of {directory} restores ({'; '.join(errors)})")


def _check_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"{out_dir} exists and is not a directory; choose another OUT_DIR")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ExportError(f"{out_dir} exists and is not empty; choose an empty OUT_DIR or pass --overwrite")


def tokenizer_note(tokenizer: Any) -> str:
    """One line saying which tokenizer the exported model expects."""
    if isinstance(tokenizer, CharTokenizer):
        return (f"tokenizer: ragen_jax CharTokenizer (byte-level, no files; ids 0-{len(SPECIAL_TOKENS) - 1} "
                f"are {', '.join(SPECIAL_TOKENS)}, byte b is id {len(SPECIAL_TOKENS)} + b)")
    return "tokenizer: Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json, generation_config.json)"


def _add_gguf_chat_template(config: ml_collections.ConfigDict, out_dir: Path) -> None:
    """Copy the GGUF's chat template into tokenizer_config.json, so ``apply_chat_template`` works."""
    from ragen_jax.models.gguf import chat_template

    template = chat_template(config.model.gguf_path)
    file = out_dir / "tokenizer_config.json"
    if template is None or not file.exists():
        return
    data = json.loads(file.read_text(encoding="utf-8"))
    data["chat_template"] = template
    file.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def export_hf(run_dir: str, out_dir: str, step: int | None = None, *, overwrite: bool = False,
              verbose: bool = True) -> str:
    """Write the actor of ``run_dir``'s latest (or ``step``) checkpoint to ``out_dir`` as a Hugging Face
    directory; returns ``out_dir``. Raises ExportError for a missing config.json or checkpoint, or a
    non-empty ``out_dir`` without ``overwrite``."""
    out = Path(out_dir)
    _check_out_dir(out, overwrite)
    policy = restore_policy(run_dir, step)
    hf_tokenizer = None if isinstance(policy.tokenizer, CharTokenizer) else policy.tokenizer
    from ragen_jax.models.hf_io import save_hf_checkpoint

    save_hf_checkpoint(policy.model, out, tokenizer=hf_tokenizer)
    if hf_tokenizer is not None and policy.config.model.gguf_path and not policy.config.model.hf_path:
        _add_gguf_chat_template(policy.config, out)
    if verbose:
        cfg = policy.model.cfg
        n_params = sum(x.size for x in jax.tree.leaves(nnx.state(policy.model, nnx.Param)))
        print(f"exported step {policy.step} of {run_dir} -> {out}: {cfg.architecture} "
              f"({n_params:,} parameters, {cfg.param_dtype}, {cfg.num_layers} layers)")
        for file in sorted(out.iterdir()):
            print(f"  {file.name}  ({file.stat().st_size:,} bytes)")
        print(tokenizer_note(policy.tokenizer))
    return str(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ragen_jax.export",
        description="Export the actor of a run's checkpoint to a Hugging Face directory.")
    parser.add_argument("run_dir", help="the run directory (holds config.json and checkpoints/)")
    parser.add_argument("out_dir", help="the output directory (created; must be empty unless --overwrite)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty OUT_DIR")
    args = parser.parse_args(argv)
    try:
        export_hf(args.run_dir, args.out_dir, args.step, overwrite=args.overwrite)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
