"""The compiled decode step moves only what it must: no copy of the KV cache or of a layer's slice of it.

Decode is memory-bound: each step has to read the weights once and the attended keys and values once,
and everything else it reads or writes is overhead. XLA turns some innocent-looking formulations into
full copies of cache-sized buffers (reading a layer's attended slots back out of a stacked cache, or a
write fused with a sub-window read), so these tests read the optimised HLO of the tiny preset at a
realistic decode shape and fail on

- any instruction, in the decode step or in the sampler's decode loop body, that materialises an
  array of at least a quarter of one layer's attended K (or V) slots, other than an in-place
  dynamic-update-slice (the cache append) and pure aliases (parameters, tuples, bitcasts);
- ``bytes accessed`` of one step above 1.25 x (weights + attended K/V + logits), for the unblocked
  attention (``attention_block=0``). On CPU the attended keys count once per query head of their key
  head: there a decode step's scores are one matrix-vector product per query head
  (``models.attention.query_key_scores``), which reads the keys G times and still runs 1.5-2.5x faster
  than the one batched dot that reads them once. With key blocks (the default) the attention is a
  loop over the filled blocks, whose body XLA's cost analysis counts once, so the count would be a
  lower bound only; there each block's keys and values are sliced out (a block, under a quarter of
  the window here), and the sampling tests check the result.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.models.config import get_preset
from ragen_jax.models.kv_cache import init_cache, open_window
from ragen_jax.models.transformer import Transformer
from ragen_jax.sampling.sampler import Sampler, SamplingConfig, init_sampler_state

B = 8  # rows
FILLED = 1024  # cache slots already filled (prompt and earlier turns)
NEW = 64  # decode steps of one generate
SLOTS = 1152  # cache capacity (a rollout sizes it to the whole conversation)
KV_BLOCK = 32
BYTES_SLACK = 1.25

# Instructions that never move data: they name or regroup existing buffers.
_ALIASES = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all"}
# Instructions whose work lives in other computations, checked on their own.
_CONTROL = {"while", "call", "conditional"}

_COMPUTATION = re.compile(r"^(?:ENTRY )?%(?P<name>[\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(
    r"^\s*(?P<root>ROOT )?%(?P<name>[\w.\-]+) = (?P<type>\(.*?\)|\S+) (?P<op>[\w\-]+)\((?P<rest>.*)$")
_ARRAY = re.compile(r"\w+\[([\d,]*)\]")


def _computations(hlo: str) -> tuple[dict[str, list[re.Match]], str]:
    """{computation name: its instructions} and the entry computation's name."""
    comps: dict[str, list[re.Match]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = head["name"]
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            instr = _INSTRUCTION.match(line)
            if instr:
                comps[current].append(instr)
    return comps, entry


def _elements(type_text: str) -> int:
    """Elements of the largest array in an instruction's (possibly tuple) result type."""
    sizes = [math.prod(int(d) for d in dims.split(",") if d) for dims in _ARRAY.findall(type_text)]
    return max(sizes, default=0)


def _is_in_place_update(comps, fused: str) -> bool:
    """The fused computation's result is dynamic-update-slices (seen through bitcasts and tuples):
    XLA writes those into their operand's buffer (copy insertion adds a visible ``copy`` otherwise)."""
    by_name = {i["name"]: i for i in comps[fused]}
    pending = [next(i for i in comps[fused] if i["root"])]
    while pending:
        instr = pending.pop()
        if instr["op"] == "dynamic-update-slice":
            continue
        if instr["op"] not in ("bitcast", "tuple"):
            return False
        operands = re.findall(r"%([\w.\-]+)", instr["rest"].split("),")[0])
        pending.extend(by_name[o] for o in operands if o in by_name)
    return True


def _materialised(comps, roots: list[str], min_elements: int) -> list[str]:
    """HLO lines, in ``roots`` and the computations they call, that write a new array of at least
    ``min_elements`` elements."""
    found, seen, pending = [], set(), list(roots)
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        for instr in comps[name]:
            op = instr["op"]
            if op in _CONTROL:
                pending.extend(re.findall(r"(?:body|condition|to_apply|calls|branch_computations)="
                                          r"\{?%([\w.\-]+)", instr["rest"]))
                continue
            if op in _ALIASES or _elements(instr["type"]) < min_elements:
                continue
            if op == "fusion":
                fused = re.search(r"calls=%([\w.\-]+)", instr["rest"])[1]
                if _is_in_place_update(comps, fused):
                    continue
            found.append(f"{op} {instr['type'][:60]} %{instr['name']}")
    return found


def _while_bodies(comps, entry: str) -> list[str]:
    return [m for instr in comps[entry] if instr["op"] == "while"
            for m in re.findall(r"body=%([\w.\-]+)", instr["rest"])]


@pytest.fixture(scope="module", params=[0, get_preset("tiny").attention_block], ids=["unblocked", "blocks"])
def parts(request):
    cfg = get_preset("tiny", attention_block=request.param)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    return cfg, graphdef, params


def _layer_slice_elements(cfg, slots: int) -> int:
    return B * cfg.num_kv_heads * slots * cfg.head_dim


def test_decode_step_copies_no_cache_and_reads_little_more_than_it_must(parts):
    cfg, graphdef, params = parts
    width = FILLED + KV_BLOCK  # the attended slots of a step that writes slot FILLED
    cache = init_cache(cfg, B, SLOTS).replace(end=jnp.asarray(FILLED, jnp.int32))
    window = open_window(cache, width)  # what the sampler's decode loop carries

    def step(params, window, token):
        model = nnx.merge(graphdef, params)
        return model(token, jnp.ones(token.shape, bool), cache=window)

    compiled = jax.jit(step, donate_argnums=(1,)).lower(
        params, window, jnp.zeros((B, 1), jnp.int32)).compile()
    comps, entry = _computations(compiled.as_text())
    copies = _materialised(comps, [entry], _layer_slice_elements(cfg, width) // 4)
    assert not copies, f"the decode step materialises cache-sized buffers: {copies}"
    if cfg.attention_block:
        return
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    key_reads = cfg.num_heads // cfg.num_kv_heads if jax.default_backend() == "cpu" else 1
    layer_bytes = _layer_slice_elements(cfg, width) * cfg.compute_dtype.itemsize
    attended = (key_reads + 1) * cfg.num_layers * layer_bytes
    logits = B * cfg.vocab_size * 4
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    ratio = cost["bytes accessed"] / (weights + attended + logits)
    assert ratio <= BYTES_SLACK, f"one decode step accesses {ratio:.2f}x the bytes it needs"


def test_generate_decode_loop_copies_no_cache(parts):
    cfg, graphdef, params = parts
    config = SamplingConfig(max_new_tokens=NEW, kv_block=KV_BLOCK, decode_segment=NEW // 2)
    sampler = Sampler(graphdef, config)
    state = init_sampler_state(cfg, B, SLOTS)
    state = sampler.append(params, state, np.ones((B, FILLED), np.int32))
    lowered = sampler._generate_jit.lower(
        params, state, jax.random.key(0), jnp.float32(1.0), jnp.ones((B,), bool))
    comps, entry = _computations(lowered.compile().as_text())
    bodies = _while_bodies(comps, entry)
    assert len(bodies) == 2, "one decode loop per segment"
    smallest = FILLED + NEW // 2  # attended slots of the first segment
    copies = _materialised(comps, bodies, _layer_slice_elements(cfg, smallest) // 4)
    assert not copies, f"the decode loop materialises cache-sized buffers every step: {copies}"
