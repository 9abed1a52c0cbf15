"""Decode throughput of ragen_jax's sampler against transformers' PyTorch ``generate`` (KV cache).

Same weights (the ``tiny`` preset, exported through ``ragen_jax.models.hf_io`` and checked for logit
parity), same batch, prompt length and number of new tokens, temperature sampling over the full
vocabulary, every row forced to produce all new tokens (no eos on our side; ``min_new_tokens`` on
PyTorch's). Both run in this one process, alternating, on 2 CPU threads: PyTorch with
``torch.set_num_threads(2)``, the whole process pinned to 2 cores with ``taskset`` when the machine
has more. The process re-executes itself with tcmalloc preloaded when the library exists (glibc
malloc costs JAX about a third of its CPU time in page faults on this workload) and with
``OMP_WAIT_POLICY=PASSIVE`` (PyTorch's best setting when other processes share the cores); both apply
to both sides.

    .venv/bin/python benchmarks/sampling.py                  # B=64, prompt 128, 128 new tokens
    .venv/bin/python benchmarks/sampling.py --cache-slack 256 --repeats 5

Rows: our sampler; PyTorch. Columns: new tokens per
second of prefill + decode (the whole generation), of decode alone (ours: ``generate`` after
``append``; PyTorch: generate(N new) minus generate(1 new)), and per CPU-second of the process (less
sensitive than wall time when other processes share the cores). Writes benchmarks/results/sampling.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
_CHILD_FLAG = "RAGEN_BENCH_SAMPLING_CHILD"


def _reexec_pinned_with_tcmalloc(threads: int) -> None:
    """Re-run this script with tcmalloc preloaded and pinned to ``threads`` cores (once)."""
    if os.environ.get(_CHILD_FLAG):
        return
    env = dict(os.environ, **{_CHILD_FLAG: "1"})
    # PyTorch's OpenMP threads spin while they wait; when other processes share the cores that makes
    # it several times slower (measured 7x at load 16 on 2 cores). Passive waiting is its best setting
    # there, and it does not affect XLA (no OpenMP).
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if os.path.exists(TCMALLOC):
        env["LD_PRELOAD"] = (TCMALLOC + " " + env.get("LD_PRELOAD", "")).strip()
    command = [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
    if (os.cpu_count() or 1) > threads and shutil.which("taskset"):
        cores = ",".join(str(c) for c in range(threads))
        command = ["taskset", "-c", cores, *command]
        env["RAGEN_BENCH_PINNED"] = f"taskset -c {cores}"
    os.execvpe(command[0], command, env)


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row (median kept)")
    parser.add_argument("--cache-slack", type=int, default=0,
                        help="extra empty cache slots beyond prompt + new (a rollout sizes the cache "
                             "to the whole conversation); shows the effect of kv_block")
    parser.add_argument("--kv-block", type=int, default=64)
    parser.add_argument("--decode-segment", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2,
                        help="PyTorch threads, and the number of cores the process is pinned to")
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "sampling.json"))
    return parser.parse_args()




def main() -> None:
    args = _parse_args()
    _reexec_pinned_with_tcmalloc(args.threads)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

    import jax
    import numpy as np
    import torch
    from flax import nnx

    from ragen_jax.models import transformer
    from ragen_jax.models.config import get_preset
    from ragen_jax.models.hf_io import save_hf_checkpoint
    from ragen_jax.sampling.sampler import Sampler, SamplingConfig, init_sampler_state

    torch.set_num_threads(args.threads)
    cfg = get_preset("tiny")
    model = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    b, p, n = args.batch, args.prompt, args.new
    prompts = np.random.default_rng(0).integers(8, cfg.vocab_size, (b, p)).astype(np.int32)
    tcmalloc = TCMALLOC in os.environ.get("LD_PRELOAD", "")
    max_len = p + n + args.cache_slack
    config = SamplingConfig(max_new_tokens=n, kv_block=args.kv_block,
                            decode_segment=args.decode_segment)

    def timed(fn):
        """(wall seconds, process CPU seconds, result) of fn()."""
        w0, c0 = time.perf_counter(), time.process_time()
        result = fn()
        return time.perf_counter() - w0, time.process_time() - c0, result

    def ours_runner(sampler):
        def once(seed):
            state = jax.block_until_ready(init_sampler_state(cfg, b, max_len))
            prefill = timed(lambda: jax.block_until_ready(sampler.append(params, state, prompts)))
            decode = timed(lambda: jax.block_until_ready(
                sampler.generate(params, prefill[2], jax.random.key(seed), 1.0)))
            out = decode[2][0]
            assert int(out.lengths.min()) == n, "every row must produce all new tokens"
            return {"total": (prefill[0] + decode[0], prefill[1] + decode[1]),
                    "decode": decode[:2], "tokens": np.asarray(out.tokens)}
        return once

    rows: dict[str, dict] = {}
    runners = {}
    compile_s = {}
    first_tokens = {}

    # Our sampler with the library as it is.
    sampler = Sampler(graphdef, config)
    runners["ours"] = ours_runner(sampler)
    compile_s["ours"], _, warm = timed(lambda: runners["ours"](0))
    first_tokens["ours"] = warm["tokens"]

    if not args.skip_torch:
        from transformers import Qwen2ForCausalLM

        with tempfile.TemporaryDirectory() as tmp:
            save_hf_checkpoint(model, tmp)
            hf = Qwen2ForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        ours_logits = np.asarray(model(prompts[:2, :16], np.ones((2, 16), bool))[0])
        with torch.no_grad():
            theirs = hf(torch.from_numpy(prompts[:2, :16]).long()).logits.numpy()
        parity = float(np.abs(ours_logits - theirs).max())
        print(f"logit parity (max |ours - transformers|): {parity:.2e}")
        assert parity < 1e-3, "the transformers model does not match ours; check hf_io"
        input_ids = torch.from_numpy(prompts).long()

        def generate(seed, new_tokens):
            torch.manual_seed(seed)
            with torch.no_grad():
                out = hf.generate(
                    input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                    temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens, use_cache=True, pad_token_id=0, eos_token_id=1,
                )
            assert out.shape == (b, p + new_tokens)

        def torch_once(seed):
            total = timed(lambda: generate(seed, n))
            prefill = timed(lambda: generate(seed, 1))
            return {"total": total[:2], "decode": (total[0] - prefill[0], total[1] - prefill[1])}

        generate(0, 4)  # warm-up
        runners["torch"] = torch_once

    # Timed runs, alternating between rows so that load changes hit every row alike.
    samples = {name: [] for name in runners}
    for r in range(args.repeats):
        for name, run in runners.items():
            samples[name].append(run(r + 1))

    tokens = b * n
    med = statistics.median
    for name, runs in samples.items():
        rows[name] = {
            "tokens_per_s": tokens / med(x["total"][0] for x in runs),
            "decode_tokens_per_s": tokens / med(x["decode"][0] for x in runs),
            "tokens_per_cpu_s": tokens / med(x["total"][1] for x in runs),
        }
        if name in compile_s:
            rows[name]["first_call_s"] = compile_s[name]

    result = {
        "batch": b, "prompt": p, "new_tokens": n, "cache_slots": max_len,
        "kv_block": args.kv_block, "decode_segment": args.decode_segment, "threads": args.threads,
        "tcmalloc": tcmalloc, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "pinned": os.environ.get("RAGEN_BENCH_PINNED", "no (few cores)"),
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0], "repeats": args.repeats,
        "jax_version": jax.__version__, "torch_version": torch.__version__, "rows": rows,
    }
    if "torch" in rows:
        for name in rows:
            if name != "torch":
                result[f"ratio_{name}"] = rows[name]["tokens_per_s"] / rows["torch"]["tokens_per_s"]
                result[f"decode_ratio_{name}"] = (
                    rows[name]["decode_tokens_per_s"] / rows["torch"]["decode_tokens_per_s"])

    print(f"\nbatch {b}, prompt {p}, {n} new tokens, cache {max_len} slots, kv_block "
          f"{args.kv_block}, decode_segment {args.decode_segment}, {args.threads} threads, "
          f"tcmalloc {'on' if tcmalloc else 'off'}, load average {result['load_average_1m']:.1f}")
    header = f"{'':32s}{'tok/s':>10s}{'decode tok/s':>14s}{'tok/CPU-s':>11s}"
    if "torch" in rows:
        header += f"{'vs PyTorch':>12s}"
    print(header)
    labels = {"ours": "ours (JAX)", "ours_proposed": "ours + proposed cache update",
              "torch": "PyTorch generate"}
    for name, row in rows.items():
        line = (f"{labels[name]:32s}{row['tokens_per_s']:10,.0f}{row['decode_tokens_per_s']:14,.0f}"
                f"{row['tokens_per_cpu_s']:11,.0f}")
        if "torch" in rows:
            line += f"{row['tokens_per_s'] / rows['torch']['tokens_per_s']:11.2f}x"
        print(line)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
