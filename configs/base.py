"""RAGEN-2's defaults (config/base.yaml + the verl defaults it inherits), as an ml_collections config.

Every key any part of ragen_jax reads has its default here; task files (configs/<task>.py) start from
``get_config()`` and change only what differs. Override anything on the command line:

    python -m ragen_jax.main --config=configs/sokoban.py --config.trainer.total_steps=50

Algorithm presets (RAGEN-2's main table) are chosen with the config string, e.g.
``--config=configs/sokoban.py:grpo`` (ppo | grpo | drgrpo | dapo | rloo).
The paper's filter setting is one flag away: ``--config.filter.value=0.9`` (top-p 0.9, linear mode,
as RAGEN's README recommends); the main table used softmax mode: add ``--config.filter.top_p_mode=softmax``.
"""

from __future__ import annotations

import ml_collections

from ragen_jax.setup.config_check import ConfigError


def get_config(algorithm: str = "") -> ml_collections.ConfigDict:
    """RAGEN-2's defaults; ``algorithm`` (the ":grpo" in ``--config=configs/base.py:grpo``) applies a preset."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.mode = "train"  # train | eval | sft (build the supervised warm start only)
    c.run_dir = ""  # default: runs/<env.name>-<algorithm.name>-seed<seed>
    # random: random preset weights, or the weights of model.hf_path / gguf_path;
    # sft: the supervised warm start (ragen_jax/sft/warm_start.py), built and cached under sft.cache_dir if missing.
    c.init = "random"

    # Supervised warm start on solver demonstrations (used by init=sft and mode=sft).
    c.sft = ml_collections.ConfigDict()
    c.sft.demos = 1024  # demonstration episodes (seeds far from the training and validation seeds)
    c.sft.noisy_fraction = 0.3  # share of episodes with one random suboptimal turn
    c.sft.no_reasoning_fraction = 0.0  # share of episodes whose responses leave the reasoning out ("</think><answer>..")
    c.sft.steps = 120  # AdamW steps (tiny preset, FrozenLake: about 5 min on 2 CPU cores)
    c.sft.batch_size = 16  # whole episodes per step
    c.sft.micro_batch_size = 4  # episodes per forward / backward pass (same gradient up to rounding, a quarter of the memory)
    c.sft.bucket = 256  # batch lengths round up to a multiple of this (one compile per length; a batch is one length)
    c.sft.lr = 1e-3  # peak learning rate (10% warm-up, cosine decay to 10%)
    c.sft.val_episodes = 64  # held-out validation episodes per decoding mode after training (0: skip)
    c.sft.seed = 0  # model init, demo noise and batch order; separate from `seed` so RL seeds share one warm start
    c.sft.cache_dir = "runs/warm_starts"  # <cache_dir>/<env>-<hash of every setting that changes it>/

    c.model = ml_collections.ConfigDict()
    c.model.preset = "qwen2.5-3b"  # RAGEN-2's default model size; task files pick "tiny" for CPU
    c.model.hf_path = ""  # a local Hugging Face checkpoint dir (config.json, safetensors, tokenizer.json)
    c.model.gguf_path = ""  # a local .gguf file (Llama-family)
    c.model.dtype = "float32"  # compute dtype: float32 | bfloat16
    # ModelConfig fields replaced in the preset, e.g. {"num_layers": 2, "hidden_size": 128}.
    c.model.overrides = ml_collections.ConfigDict()
    c.model.tokenizer = "char"  # char | hf (taken from hf_path)
    c.model.chat_style = "qwen"  # qwen (ChatML) | llama3

    c.env = ml_collections.ConfigDict()
    c.env.name = "sokoban"
    c.env.prompt_style = "ragen"  # ragen (RAGEN-2's texts) | compact (short texts for the tiny default)
    c.env.max_actions_per_turn = 2
    # Fields of the env's EnvParams (envs/<name>.py), e.g. max_actions (RAGEN max_actions_per_traj: 10)
    # or FrozenLake's success_rate; task files list the ones they set.
    c.env.params = ml_collections.ConfigDict({"max_actions": 10})

    c.rollout = ml_collections.ConfigDict()
    c.rollout.mode = "fused"  # fused (envs on device) | host (envs stepped in Python)
    c.rollout.n_groups = 8  # prompt groups per step (one env seed each)
    c.rollout.group_size = 16  # samples per group
    c.rollout.max_turns = 5
    c.rollout.max_new_tokens = 400  # per turn
    c.rollout.temperature = 1.0
    c.rollout.context_mode = "full"  # full | limited
    c.rollout.context_window = 2  # turns kept in limited mode
    c.rollout.train_seed = 10000
    c.rollout.format_penalty = -0.1
    # Host environments (env.name in envs.registry.HOST_REGISTRY, rollout.mode=host; docs/host_envs.md).
    c.rollout.max_user_tokens = 0  # static width (tokens) of one user message; host envs need >= 1
    c.rollout.host_workers = 0  # worker processes stepping the envs; 0 = in this process (no timeout)
    # Longest one env call (reset or step) may run in a worker before the episode ends with "timeout":
    # generous for a Python env turn, short enough that one hung sandbox does not stall training.
    c.rollout.host_step_timeout_s = 10.0
    c.rollout.host_error_penalty = -0.1  # penalty of the turn whose env call failed (ends the episode)

    c.validation = ml_collections.ConfigDict()
    c.validation.every = 10  # steps; also before training
    c.validation.episodes = 512
    c.validation.seed = 123
    c.validation.temperature = 0.5
    c.validation.greedy = False

    c.algorithm = ml_collections.ConfigDict()
    # Preset ppo | grpo | drgrpo | dapo | rloo, chosen with the config string: --config=configs/<task>.py:grpo
    # (apply_algorithm_preset sets the keys below; --config.algorithm.* overrides still apply after it).
    c.algorithm.name = "ppo"
    c.algorithm.adv_estimator = "gae"  # gae | grpo | rloo
    c.algorithm.gamma = 1.0
    c.algorithm.lam = 1.0
    c.algorithm.bi_level_gae = False
    c.algorithm.high_level_gamma = 0.95
    c.algorithm.norm_adv_by_std = True  # GRPO; False = Dr.GRPO
    c.algorithm.clip_ratio_low = 0.2
    c.algorithm.clip_ratio_high = 0.28
    c.algorithm.clip_ratio_c = 3.0  # dual clip
    c.algorithm.entropy_coeff = 0.001
    # The reward the update learns from: "env", or "coin", a fair coin per episode that ignores the input
    # (the induced template-collapse control of benchmarks/reproduce.py; ragen_jax/rl/train_reward.py).
    c.algorithm.train_reward = "env"
    c.algorithm.use_kl_loss = False
    c.algorithm.kl_coeff = 0.001
    c.algorithm.kl_type = "low_var_kl"  # kl (k1) | mse (k2) | low_var_kl (k3)
    c.algorithm.loss_agg_mode = "token-mean"
    c.algorithm.value_clip = 0.5
    c.algorithm.ppo_epochs = 1
    c.algorithm.mini_batch_size = 32
    c.algorithm.micro_batch_size = 8
    # Use the sampler's log-probs as old log-probs (they equal the trainer's forward); True recomputes
    # them and logs the max |sampler - recomputed| gap as a regression guard.
    c.algorithm.recompute_old_logprobs = False
    c.algorithm.logprob_chunk = 128  # positions per chunk of the chunked log-prob / entropy pass
    # The update runs at the batch's longest row rounded up to one of this many evenly spaced widths of
    # the rollout's static width (compiles once per width met); 1 = always the static width.
    c.algorithm.width_buckets = 8
    # The actor's and critic's backward passes recompute each block's forward instead of storing its
    # activations: same numbers, ~30% more update compute. Off: on the tiny preset (4 layers) it saves
    # only 3% of the update's memory (benchmarks/update_width.py); deep models are where it pays.
    c.algorithm.remat = False
    # Each mini-batch's rows are packed side by side into as few rows of the update's width as hold them
    # (rl/packing.py: attention and positions per episode, the losses count each episode as one sequence),
    # and micro-batches left empty are skipped: the same gradient up to float rounding, fewer rows to run.
    c.algorithm.pack_rows = True

    c.filter = ml_collections.ConfigDict()
    c.filter.metric = "reward_std"  # reward_std | reward_var | reward_mean | reward_sum
    c.filter.strategy = "top_p"  # top_p | top_k | top_k_abs | min_p
    c.filter.value = 1.0  # 1.0 with include_zero = no filtering (RAGEN's default)
    c.filter.top_p_mode = "linear"  # linear | softmax
    c.filter.include_zero = True
    c.filter.eps = 0.01
    c.filter.largest = True
    c.filter.soft_reweight = False
    c.filter.loss_scaling = "none"  # none | linear | sqrt
    c.filter.empty_stop_steps = 5

    c.optim = ml_collections.ConfigDict()
    c.optim.actor_lr = 1e-6
    c.optim.critic_lr = 1e-5
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.weight_decay = 0.01
    c.optim.grad_clip = 1.0

    c.mi = ml_collections.ConfigDict()
    c.mi.enabled = True
    c.mi.every = 5  # and at step 1
    c.mi.num_samples = 64
    c.mi.first_turn = True
    c.mi.trajectory = True
    c.mi.ema_decay = 0.9
    c.mi.std_eps = 1e-3
    # The cross-scoring runs at the sampled prompts' and reasonings' real widths rounded up to one of
    # this many evenly spaced widths of the static ones (compiles once per width pair met); 1 = always
    # the static widths (one compile per strategy, every call pays for the padding).
    c.mi.width_buckets = 8

    c.trainer = ml_collections.ConfigDict()
    c.trainer.total_steps = 400
    c.trainer.checkpoint_every = 100
    c.trainer.keep_checkpoints = 3
    c.trainer.sample_every = 10  # log sample conversations as text
    c.trainer.max_nonfinite_in_a_row = 3
    c.trainer.rv_collapse_baseline_steps = 10
    c.trainer.rv_collapse_window = 10
    c.trainer.rv_collapse_ratio = 0.1
    c.trainer.low_val_success = 0.01
    c.trainer.low_val_patience = 5
    c.trainer.progress = True
    # A checkpoint is not saved (the run stops: "parameter_explosion") when the largest |parameter| grew
    # more than this many times since the last good checkpoint: an exploded update must not reach it.
    c.trainer.max_param_growth = 10.0
    # Resuming a run with a config that changes what its steps compute (anything outside
    # trainer.RESUME_FREE_KEYS: learning rate, model, env, seeds, ...) is refused unless this is True.
    c.trainer.allow_config_change = False

    # JAX's persistent compilation cache (ragen_jax/setup/runtime.py): compiled programs are kept on disk,
    # so a second run with the same shapes (a resume, another seed) starts without compiling them again.
    c.compile_cache = ml_collections.ConfigDict()
    c.compile_cache.enabled = True
    # "": $JAX_COMPILATION_CACHE_DIR when set, else $XDG_CACHE_HOME/ragen_jax/jax_compilation_cache
    # (~/.cache/ragen_jax/jax_compilation_cache); safe to delete, it grows without a size limit.
    c.compile_cache.dir = ""
    # Programs that compile faster than this are not written (a disk read would not save much); the
    # test suite's cache (tests/conftest.py) uses the same value.
    c.compile_cache.min_compile_time_secs = 0.5

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1
    c.mesh.fsdp = 1
    c.mesh.tensor = 1
    c.mesh.distributed = "auto"  # auto (TPU pods) | on | off
    return apply_algorithm_preset(c, algorithm) if algorithm else c


ALGORITHM_PRESETS = {
    # RAGEN-2 main table (scripts/runs/run_main_table_diff_algo.sh).
    "ppo": dict(adv_estimator="gae", loss_agg_mode="token-mean"),
    "dapo": dict(adv_estimator="gae", loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28),
    "grpo": dict(adv_estimator="grpo", norm_adv_by_std=True, loss_agg_mode="seq-mean-token-mean"),
    "drgrpo": dict(adv_estimator="grpo", norm_adv_by_std=False, loss_agg_mode="seq-mean-token-sum"),
    # verl's leave-one-out estimator, not in RAGEN-2's tables; the bandit's CPU default (configs/bandit.py).
    "rloo": dict(adv_estimator="rloo", loss_agg_mode="seq-mean-token-mean"),
}


def split_options(options: str, data_option: str) -> tuple[bool, list[str]]:
    """A task config's comma-separated options (``--config=configs/<task>.py:OPTIONS``): whether
    ``data_option`` (the task's alternative data) is among them, and the others (algorithm presets)."""
    names = [name for name in options.split(",") if name]
    return data_option in names, [name for name in names if name != data_option]


def apply_algorithm_preset(config: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
    """Set ``config.algorithm`` to the named preset (ppo | grpo | drgrpo | dapo | rloo)."""
    if name not in ALGORITHM_PRESETS:
        raise ConfigError(f"unknown algorithm preset {name!r} (the part after ':' in --config=FILE.py:PRESET); "
                          f"choose one of {', '.join(ALGORITHM_PRESETS)}")
    config.algorithm.name = name
    config.algorithm.update(ALGORITHM_PRESETS[name])
    return config


def cpu_task_config(env_name: str, *, max_turns: int, max_new_tokens: int, total_steps: int,
                    env_params: dict, max_actions_per_turn: int = 2, algorithm: str = "",
                    micro_batch_size: int = 8) -> ml_collections.ConfigDict:
    """RAGEN-2's defaults shrunk for the CPU default of one task: tiny preset started from the supervised
    warm start, compact prompts, 4 x 8 episodes per step, a higher learning rate for the small model,
    validation on 64 episodes, and GRPO unless ``algorithm`` names another preset: without a critic the
    update costs half as much on 2 cores, and group-relative advantages need no value function to warm
    up over a run of a few dozen steps (PPO is one config string away: configs/<task>.py:ppo).
    ``micro_batch_size``: rows per forward / backward pass of the update (the gradient is the same up to
    rounding); the multi-turn tasks, whose rows are 1,000-1,600 tokens wide, use 4, which halves the
    update's working memory at the same speed."""
    c = get_config(algorithm or "grpo")
    c.env.name = env_name
    c.env.prompt_style = "compact"
    c.env.max_actions_per_turn = max_actions_per_turn
    c.env.params = env_params
    c.model.preset = "tiny"
    c.init = "sft"  # RL from random weights cannot discover the answer format
    c.rollout.n_groups = 4
    c.rollout.group_size = 8
    c.rollout.max_turns = max_turns
    c.rollout.max_new_tokens = max_new_tokens
    c.algorithm.mini_batch_size = 16
    c.algorithm.micro_batch_size = micro_batch_size
    c.optim.actor_lr = 1e-4
    c.optim.critic_lr = 1e-3
    c.trainer.total_steps = total_steps
    c.trainer.checkpoint_every = 10
    c.validation.every = 10
    c.validation.episodes = 64
    c.mi.num_samples = 16
    return c


def host_task_config(env_name: str, *, env_params: dict, max_turns: int, max_new_tokens: int,
                     max_user_tokens: int, total_steps: int, algorithm: str) -> ml_collections.ConfigDict:
    """RAGEN-2's defaults for a host environment (``envs.registry.HOST_REGISTRY``) trained from a real
    model's weights (``--config.model.hf_path``): RAGEN's prompts, the checkpoint's tokenizer, bfloat16,
    16 groups x 8 (RAGEN-2's DeepCoder and SearchQA runs). ``env_params`` are the env class's keyword
    arguments; ``max_user_tokens`` the width of its longest user message in tokens."""
    c = get_config(algorithm)
    c.env.name = env_name
    c.env.prompt_style = "ragen"
    c.env.max_actions_per_turn = 1
    c.env.params = ml_collections.ConfigDict(env_params)
    c.model.tokenizer = "hf"
    c.model.dtype = "bfloat16"
    c.init = "random"  # host envs have no supervised warm start: the checkpoint's weights
    c.rollout.mode = "host"
    c.rollout.n_groups = 16
    c.rollout.group_size = 8
    c.rollout.max_turns = max_turns
    c.rollout.max_new_tokens = max_new_tokens
    c.rollout.max_user_tokens = max_user_tokens
    c.trainer.total_steps = total_steps
    return c
