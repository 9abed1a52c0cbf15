"""MathQA TextEnv: the device answer check, the generator, files, render and demonstrations against
plain-Python references (RAGEN's ``_check_answer``: lower-case, remove all whitespace, compare)."""

from __future__ import annotations

import json
import random
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envs.math_qa import INCORRECT, MathQA, MathQAAction, MathQAParams, item_table
from envs.math_qa_check import answer_matches
from envs.math_qa_data import TEMPLATE_STEPS, TEMPLATES, generate_problem, load_table, read_file
from ragen_jax.models.tokenizers import CharTokenizer
from ragen_jax.rollout.layout import RolloutConfig, env_keys
from ragen_jax.sft.demos import DemoWriter, demo_seeds

TOK = CharTokenizer()
SPECIAL = ["<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>"]


# ----- plain-Python references ----------------------------------------------------------------------
def ragen_check(answer: str, label: str | None) -> bool:
    """RAGEN ``MetaMathQAEnv._check_answer`` (is_correct)."""
    normalized_answer = re.sub(r"\s+", "", answer.strip().lower())
    if not label:
        return False
    return normalized_answer == re.sub(r"\s+", "", label.lower())


def ragen_turn(response: bytes, label: str, max_actions: int = 1) -> tuple[float, bool]:
    """RAGEN's parse (``ctx_manager._parse_response``) + one MetaMathQA step -> (reward, format_ok)."""
    text = "<think>" + response.decode("utf-8", errors="replace")
    m = re.search(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", text, re.DOTALL)
    if not m:
        return 0.0, False
    content = m.group(2)
    for token in SPECIAL:
        content = content.replace(token, "")
    actions = [a.strip() for a in content.split("||") if a.strip()][:max_actions]
    if not actions:
        return 0.0, False
    return (1.0 if ragen_check(actions[0], label) else 0.0), True


# Each template's text and answer, read back from the question alone.
TEMPLATE_ANSWERS = [
    (r"(\w+) has (\d+) (\w+)\. (?:He|She) buys (\d+) more\. How many \3 does \1 have now\?",
     lambda g: int(g[1]) + int(g[3])),
    (r"(\w+) has (\d+) (\w+)\. (?:He|She) gives (\d+) to a friend\. How many \3 does \1 have left\?",
     lambda g: int(g[1]) - int(g[3])),
    (r"(\w+) buys (\d+) bags with (\d+) (\w+) in each bag\. How many \4 does \1 have\?",
     lambda g: int(g[1]) * int(g[2])),
    (r"(\w+) shares (\d+) (\w+) equally among (\d+) friends\. How many \3 does each friend get\?",
     lambda g: int(g[1]) // int(g[3]) if int(g[1]) % int(g[3]) == 0 else None),
    (r"(\w+) has (\d+) (\w+)\. (?:He|She) buys (\d+) more and gives (\d+) to a friend\. How many \3 does \1 have now\?",
     lambda g: int(g[1]) + int(g[3]) - int(g[4])),
    (r"(\w+) buys (\d+) bags with (\d+) (\w+) in each bag and finds (\d+) more\. How many \4 does \1 have\?",
     lambda g: int(g[1]) * int(g[2]) + int(g[4])),
    (r"(\w+) shares (\d+) (\w+) equally among (\d+) friends\. Each friend loses (\d+)\. How many \3 does each "
     r"friend have left\?", lambda g: int(g[1]) // int(g[3]) - int(g[4]) if int(g[1]) % int(g[3]) == 0 else None),
    (r"(\w+) has (\d+) boxes of (\d+) (\w+)\. (?:He|She) gets (\d+) more and gives away (\d+)\. How many \4 are left\?",
     lambda g: int(g[1]) * int(g[2]) + int(g[4]) - int(g[5])),
    (r"A class has (\d+) rows of (\d+) desks\. (\d+) desks break and (\d+) new desks arrive\. How many desks are "
     r"there now\?", lambda g: int(g[0]) * int(g[1]) - int(g[2]) + int(g[3])),
    (r"(\w+) earns (\d+) dollars a day for (\d+) days and spends (\d+) dollars\. (?:He|She) then earns (\d+) dollars "
     r"a day for (\d+) days\. How many dollars does \1 have\?",
     lambda g: int(g[1]) * int(g[2]) - int(g[3]) + int(g[4]) * int(g[5])),
    (r"A farm has (\d+) pens of (\d+) hens and (\d+) pens of (\d+) ducks\. (\d+) birds fly away\. How many birds "
     r"are left\?", lambda g: int(g[0]) * int(g[1]) + int(g[2]) * int(g[3]) - int(g[4])),
]


def reference_answer(question: str) -> tuple[int, int]:
    """(template index, answer) computed from the question text alone."""
    hits = [(t, fn(m.groups())) for t, (pattern, fn) in enumerate(TEMPLATE_ANSWERS)
            if (m := re.fullmatch(pattern, question))]
    assert len(hits) == 1, question
    return hits[0]


# ----- the answer check -----------------------------------------------------------------------------
LABELS = ["\\frac{1}{2}", "1,000", "1000", "3.5", "-7", "x^2+2x+1", "ΟΔΟΣ", "ΣΑ", "Σ", "σ", "ς", "İstanbul", "KELVIN",
          "straße", "(2, 3)", "\\sqrt{2}", "Ω", "ǅ", "𐐀𐐀", "Ab Σ.", "12 apples", "ΑΣ'Σ", "A\u0301Σ"]
UNICODE = ["Σ", "σ", "ς", "İ", "i\u0307", "\u212a", "k", "ß", "ẞ", "É", "é", "\u2126", "ω", "π", "√", "½", "\u0301",
           "'", "ǅ", "ǆ", "Ⅸ", "ⅸ", "Ⓐ", "ⓐ", "𐐀", "𐐨", "ﬃ", "\u00a0", "\u3000", "\u2028", "\x1c", "\u200b", "\u0345"]
SPACES = [" ", "  ", "\n", "\t", "\r\n", "\u00a0", "\u3000", "\u2009", "\x0b", "\x1f"]


def adversarial(label: str, rng: random.Random) -> bytes:
    """An answer near ``label``: case, whitespace, leading zeros, separators, unicode, invalid bytes."""
    kind = rng.randrange(14)
    if kind == 0:
        out = label
    elif kind == 1:  # whitespace anywhere
        out = "".join(ch + (rng.choice(SPACES) if rng.random() < 0.4 else "") for ch in label)
    elif kind == 2:
        out = rng.choice([label.upper(), label.swapcase(), label.title(), label.casefold()])
    elif kind == 3:
        out = "0" * rng.randint(1, 2) + label
    elif kind == 4:  # "1,000" vs "1000"
        out = label.replace(",", "") if "," in label else (f"{int(label):,}" if label.lstrip("-").isdigit() else label + ",")
    elif kind == 5:
        out = label + rng.choice([".", ". ", "!", ".0"])
    elif kind == 6:
        out = rng.choice(["", " ", "\n\t"])
    elif kind == 7:  # longer than any window, equal after normalisation
        i = rng.randint(0, len(label))
        out = label[:i] + rng.choice(SPACES) * rng.randint(64, 120) + label[i:]
    elif kind == 8:  # unicode inserted or replacing a character
        chars = list(label) or [""]
        i = rng.randrange(len(chars))
        chars[i] = rng.choice(UNICODE) + (chars[i] if rng.random() < 0.5 else "")
        out = "".join(chars)
    elif kind == 9:  # greek words, final sigma context
        out = rng.choice(["ΟΔΟΣ", "οδοσ", "οδος", "ΟΔΟΣ ", "ΣΑ", "σα", "ας", "ΑΣ", "ΑΣ'Σ", "ασ'ς", "Α\u0301Σ",
                          "ΣΣ"])
    elif kind == 10:  # one character changed
        chars = list(label) or ["x"]
        chars[rng.randrange(len(chars))] = rng.choice("0123456789abcXYZ ,.-")
        out = "".join(chars)
    elif kind == 11:  # invalid UTF-8 somewhere
        raw = label.encode("utf-8")
        i = rng.randint(0, len(raw))
        return raw[:i] + rng.choice([b"\xff", b"\x80", b"\xe2\x80", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"]) + raw[i:]
    elif kind == 12:
        out = label.lower() if rng.random() < 0.5 else label.upper().replace(" ", "\n")
    else:
        out = "".join(rng.choice(UNICODE + list("ab1 ")) for _ in range(rng.randint(0, 6)))
    return out.encode("utf-8")


def python_check(answer: bytes, label: str) -> bool:
    return ragen_check(answer.decode("utf-8", errors="replace"), label)


def test_device_check_equals_python_on_adversarial_answers():
    rng = random.Random(0)
    labels = [str(generate_problem(3, i).answer) for i in range(200)] + LABELS
    width, label_width, chunk, total = 512, 64, 2048, 12_288
    pairs = [(label, adversarial(label, rng)) for label in (rng.choice(labels) for _ in range(total))]
    check = jax.jit(jax.vmap(answer_matches))
    got = []
    for start in range(0, total, chunk):
        part = pairs[start:start + chunk]
        text = np.zeros((chunk, width), np.uint8)
        lengths = np.zeros((chunk,), np.int32)
        label_bytes = np.zeros((chunk, label_width), np.uint8)
        label_lengths = np.zeros((chunk,), np.int32)
        for row, (label, answer) in enumerate(part):
            assert len(answer) <= width
            text[row, : len(answer)] = np.frombuffer(answer, np.uint8)
            lengths[row] = len(answer)
            norm = re.sub(r"\s+", "", label.lower()).encode("utf-8")
            label_bytes[row, : len(norm)] = np.frombuffer(norm, np.uint8)
            label_lengths[row] = len(norm)
        got.extend(np.asarray(check(text, lengths, label_bytes, label_lengths)).tolist())
    want = [python_check(answer, label) for label, answer in pairs]
    wrong = [(label, answer, g) for (label, answer), g, w in zip(pairs, got, want) if g != w]
    assert not wrong, wrong[:10]
    assert 0.2 < np.mean(want) < 0.8  # both verdicts are well represented
    assert sum(w for (_, a), w in zip(pairs, want) if len(a) > 64) > 100  # long answers that are correct


# ----- the generator --------------------------------------------------------------------------------
def test_generator_is_deterministic_and_its_answers_are_right():
    problems = [generate_problem(0, i) for i in range(1500)]
    assert problems == [generate_problem(0, i) for i in range(1500)]
    other = [generate_problem(1, i) for i in range(1500)]
    assert sum(a.question != b.question for a, b in zip(problems, other)) > 1400
    seen = set()
    for p in problems + other:
        template, answer = reference_answer(p.question)
        assert all(1 <= int(x) <= 99 for x in re.findall(r"\d+", p.question)) and len(p.question) <= 140
        seen.add(template)
        assert p.answer == answer >= 1 and p.template == template
        assert 1 <= len(p.steps) <= 4
        for step in p.steps:  # the worked steps are true, with small numbers
            assert eval(f"{step.left} {step.op} {step.right}".replace("/", "//")) == step.result  # noqa: S307
            assert step.op != "/" or step.left % step.right == 0
            assert 1 <= step.result <= 99
        assert p.solution.endswith(f"= {answer}.")
    assert seen == set(range(len(TEMPLATES)))
    table = load_table("", 64, 0, 32, 0)
    assert table.questions == tuple(p.question for p in problems[:64])  # the env's table: items 0..N-1
    assert table.labels == tuple(str(p.answer) for p in problems[:64])


@pytest.mark.parametrize("max_steps", [1, 2, 3])
def test_max_steps_keeps_the_shorter_templates_only(max_steps):
    problems = [generate_problem(0, i, max_steps) for i in range(600)]
    assert all(len(p.steps) <= max_steps and len(p.steps) == TEMPLATE_STEPS[p.template] for p in problems)
    assert {p.template for p in problems} == {i for i, n in enumerate(TEMPLATE_STEPS) if n <= max_steps}
    assert load_table("", 16, 0, 32, 0, max_steps).questions == tuple(p.question for p in problems[:16])
    with pytest.raises(ValueError, match="max_steps must be in 1..4"):
        generate_problem(0, 0, 0)


@pytest.mark.parametrize("max_steps,max_number", [(2, 20), (4, 10)])
def test_max_number_bounds_every_number_of_a_problem(max_steps, max_number):
    problems = [generate_problem(0, i, max_steps, max_number) for i in range(400)]
    for p in problems:
        template, answer = reference_answer(p.question)
        assert p.template == template and p.answer == answer >= 1
        numbers = [int(x) for x in re.findall(r"\d+", p.question + " " + p.solution)]
        assert max(numbers) <= max_number
    assert {p.template for p in problems} == {i for i, n in enumerate(TEMPLATE_STEPS) if n <= max_steps}
    default_range = [generate_problem(3, i, max_steps) for i in range(50)]
    assert [generate_problem(3, i, max_steps, 99) for i in range(50)] == default_range
    assert load_table("", 16, 0, 32, 0, max_steps, max_number).questions == tuple(p.question for p in problems[:16])
    for bad in (9, 100):
        with pytest.raises(ValueError, match="max_number must be in 10..99"):
            generate_problem(0, 0, max_steps, bad)


# ----- files ----------------------------------------------------------------------------------------
METAMATHQA = [
    {"query": "What is 2 + 3?", "response": "2 + 3 = 5.\nThe answer is: 5", "type": "GSM_Rephrased"},
    {"query": "Simplify 2/4.", "response": "Divide by 2.\nThe answer is: \\frac{1}{2}\n", "type": "MATH_AnsAug"},
    {"query": "No label here.", "response": "I do not know.", "type": "MATH_SV"},
    {"query": "Name it.", "response": "It is big.\nThe answer is:  The Big ONE ", "type": "MATH_FOBAR"},
]
GSM8K = [
    {"question": "Ann has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7 apples.\n#### 7"},
    {"question": "A year has 1000 days?", "answer": "Yes.\n#### 1,000"},
]


def write_metamathqa(tmp_path):
    path = tmp_path / "metamathqa.json"
    path.write_text(json.dumps(METAMATHQA))
    return str(path)


def write_gsm8k(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in GSM8K) + "\n")
    return str(path)


def test_files_are_read_with_ragen_labels(tmp_path):
    fmt, items = read_file(write_metamathqa(tmp_path))
    assert fmt == "metamathqa"
    assert [label for _, label, _ in items] == ["5", "\\frac{1}{2}", None, "The Big ONE"]
    fmt, items = read_file(write_gsm8k(tmp_path))
    assert fmt == "gsm8k"
    assert items[0] == (GSM8K[0]["question"], "7", "3+4=7 apples.")
    assert [label for _, label, _ in items] == ["7", "1,000"]
    (tmp_path / "gsm8k.parquet").write_bytes(b"PAR1")
    with pytest.raises(ValueError, match="JSONL"):
        read_file(str(tmp_path / "gsm8k.parquet"))
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "x"}))
    with pytest.raises(ValueError, match="'query' and 'response'"):
        read_file(str(tmp_path / "bad.jsonl"))
    with pytest.raises(FileNotFoundError, match="data_path"):
        read_file(str(tmp_path / "missing.json"))


def test_env_on_a_file_checks_answers_on_device(tmp_path):
    env = MathQA()
    params = MathQAParams(data_path=write_metamathqa(tmp_path), max_actions=2)
    table = item_table(params)
    assert table.labels == ("5", "\\frac{1}{2}", "The Big ONE") and table.dropped == 1
    keys = jax.random.split(jax.random.PRNGKey(0), 64)
    _, states = jax.vmap(env.reset_env, in_axes=(0, None))(keys, params)
    assert set(np.asarray(states.item).tolist()) == {0, 1, 2}  # uniform over the table

    step_env = jax.jit(lambda state, action: env.step_env(jax.random.PRNGKey(1), state, action, params))

    def step(state, answer: str):
        raw = answer.encode("utf-8")
        text = np.zeros((params.max_action_bytes,), np.uint8)
        text[: min(len(raw), text.size)] = np.frombuffer(raw[: text.size], np.uint8)
        return step_env(state, MathQAAction(text, jnp.int32(len(raw))))

    state = jax.tree.map(lambda x: x[int(np.argmax(np.asarray(states.item) == 2))], states)
    _, wrong, reward, done, info = step(state, "the big one?")
    assert float(reward) == 0.0 and not bool(done) and int(wrong.time) == 1
    _, right, reward, done, _ = step(wrong, " the  BIG one ")
    assert float(reward) == 0.5 and bool(done) and bool(right.success)  # RAGEN: 1 / 2**attempt
    _, _, reward, _, info = step(state, "the big one" + " " * params.max_action_bytes)  # too long to check
    assert float(reward) == 0.0 and bool(info["action_too_long"])
    # Host mode's parse of RAGEN's answer pieces checks the same way.
    parsed, n_valid = env.parse_pieces(["The  big\u3000one"], True, True, state, params, 1)
    _, reward, done, info = jax.jit(lambda s, p: env.step_turn(jax.random.PRNGKey(2), s, p, params))(state, parsed)
    assert n_valid == 1 and float(reward) == 1.0 and bool(done) and bool(info["format_ok"])


# ----- render, parse, step --------------------------------------------------------------------------
def test_render_on_device_equals_render_text():
    env = MathQA()
    params = MathQAParams(max_actions=2)
    for style in ("ragen", "compact"):
        layer = env.text_layer(TOK, params, prompt_style=style, max_actions_per_turn=1)
        assert layer.system_text().startswith("You're a helpful assistant. You are solving Math problems. ") == (style == "ragen")
        keys = jax.random.split(jax.random.PRNGKey(1), 32)
        _, states = jax.vmap(env.reset_env, in_axes=(0, None))(keys, params)
        wrong = states.replace(time=states.time + 1)
        for batch in (states, wrong):
            tokens, lengths = jax.jit(jax.vmap(layer.render))(batch)
            turns, turn_lengths = jax.jit(jax.vmap(layer.render_turn, in_axes=(0, None)))(batch, jnp.int32(1))
            for i in range(32):
                one = jax.tree.map(lambda x: x[i], batch)
                assert TOK.decode(np.asarray(tokens[i, : lengths[i]]).tolist()) == layer.render_text(one)
                assert TOK.decode(np.asarray(turns[i, : turn_lengths[i]]).tolist()) == layer.turn_text(one, 1)
        assert layer.render_text(jax.tree.map(lambda x: x[0], wrong)) == INCORRECT
        question = layer.render_text(jax.tree.map(lambda x: x[0], states))
        assert question == item_table(params).questions[int(states.item[0])]


def test_parse_and_step_turn_match_ragen_pipeline():
    env = MathQA()
    rng = random.Random(1)
    params = MathQAParams(max_action_bytes=512)
    table = item_table(params)
    exact = env.text_layer(TOK, params, max_actions_per_turn=1, bytes_per_token=None, answer_window=None)
    windowed = env.text_layer(TOK, params, max_actions_per_turn=1)  # the rollout's defaults (window 64)
    keys = jax.random.split(jax.random.PRNGKey(2), 256)
    _, states = jax.vmap(env.reset_env, in_axes=(0, None))(keys, params)
    responses = []
    for item in np.asarray(states.item).tolist():
        label = table.labels[item]
        answer = adversarial(label, rng)
        form = rng.randrange(6)
        if form == 0:
            responses.append(b"steps</think>\n<answer>" + answer + b"</answer>")
        elif form == 1:
            responses.append(b"x</think><answer>" + answer + b" || 3</answer>tail")
        elif form == 2:
            responses.append(b"x</think><answer><think>" + answer + b"</answer>")
        elif form == 3:
            responses.append(b"no tags " + answer)
        elif form == 4:
            responses.append(b"a</think> <answer> || " + answer + b"</answer>")
        else:
            responses.append(b"r</think><answer>" + answer[: len(answer) // 2] + b"\xe2<think>" + answer[len(answer) // 2:]
                             + b"</answer>")
    size = max(len(r) for r in responses)
    tokens = np.zeros((len(responses), size), np.int32)
    for row, r in enumerate(responses):
        tokens[row, : len(r)] = 8 + np.frombuffer(r, np.uint8).astype(np.int32)  # byte b is CharTokenizer id 8 + b
    lengths = np.asarray([len(r) for r in responses], np.int32)
    turn_keys = jax.random.split(jax.random.PRNGKey(3), len(responses))
    want = [ragen_turn(r, table.labels[item]) for r, item in zip(responses, np.asarray(states.item).tolist())]
    for layer in (exact, windowed):
        parsed = jax.jit(jax.vmap(layer.parse))(jnp.asarray(tokens), jnp.asarray(lengths))
        _, reward, done, info = jax.jit(jax.vmap(layer.step_turn))(turn_keys, states, parsed)
        got = list(zip(np.asarray(reward).tolist(), np.asarray(info["format_ok"]).tolist()))
        if layer is exact:
            assert got == want
        else:
            # The window reads at most 64 answer bytes: a longer answer is an invalid turn, never credited.
            for (g_reward, g_ok), (w_reward, w_ok), r in zip(got, want, responses):
                answer = re.search(rb"<answer>(.*?)</answer>", r, re.DOTALL)
                if answer is None or len(answer.group(1)) <= 64:
                    assert (g_reward, g_ok) == (w_reward, w_ok), r
                else:
                    assert g_reward <= w_reward
    assert 0.2 < np.mean([w for w, _ in want]) < 0.8


# ----- demonstrations -------------------------------------------------------------------------------
def test_demonstrations_are_solved_by_the_env(tmp_path):
    config = RolloutConfig(n_groups=1, group_size=1, max_turns=1, max_new_tokens=96, max_actions_per_turn=1,
                           prompt_style="compact")
    env = MathQA()
    writer = DemoWriter(env, None, TOK, config)
    params = env.default_params
    clean = writer.write(demo_seeds(8))
    for episode in clean:
        state = env.reset_env(env_keys(jnp.int32(episode.seed))[0], params)[1]
        question = item_table(params).questions[int(state.item)]
        _, answer = reference_answer(question)
        assert episode.success and episode.rewards == (1.0,)
        assert episode.responses[0].endswith(f"= {answer}.</think><answer>{answer}</answer>")
    noisy = writer.write(demo_seeds(8), noisy_fraction=1.0)
    assert all(not e.success and e.rewards == (0.0,) and e.format_ok == (True,) for e in noisy)
    # A generated question names its unit: the noisy answer is the right number with it, after the same reasoning.
    for with_unit, right in zip(noisy, clean):
        reasoning, _, answer = right.responses[0].partition("</think><answer>")
        number = answer.removesuffix("</answer>")
        unit = with_unit.responses[0].removeprefix(f"{reasoning}</think><answer>{number} ").removesuffix("</answer>")
        assert unit.isalpha() and with_unit.responses[0] == f"{reasoning}</think><answer>{number} {unit}</answer>"
        state = env.reset_env(env_keys(jnp.int32(right.seed))[0], params)[1]
        assert f"How many {unit} " in item_table(params).questions[int(state.item)]
    file_params = MathQAParams(data_path=write_gsm8k(tmp_path))
    file_demos = DemoWriter(env, file_params, TOK, config).write(demo_seeds(4))
    assert all(e.success for e in file_demos)
    assert {e.responses[0] for e in file_demos} <= {
        "3+4=7 apples.</think><answer>7</answer>", "Yes.</think><answer>1,000</answer>"}
