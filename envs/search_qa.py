"""SearchQA (RAGEN-2's HotpotQA search task, ``ragen/env/search/env.py``) as a host env, with local BM25.

Multi-turn, one action per turn: ``search[query]`` (reward 0; the top ``top_k`` passages come back as
the next state) or ``finish[answer]`` (reward = ``envs/qa_reward.py``: 1 on an exact match after SQuAD
normalisation, else F1 when F1 >= 0.3, else 0; the episode ends). Any other non-empty action is read
as an answer through RAGEN's extraction fallback. The episode also ends after ``max_steps`` actions
(RAGEN: 10 for both ``max_steps`` and ``max_actions_per_traj``). A response that does not parse gives
no action: reward 0, the rollout's format penalty, the same state with RAGEN's warning next turn.

Question of seed s: ``questions[s % len(questions)]`` (RAGEN). Retrieval: ``envs/search_index.py``
(BM25 over a local corpus instead of RAGEN's dense retrieval server). Data (``envs/search_data.py``):
the shipped invented-world corpus and questions by default; ``questions_path`` / ``corpus_path``
(JSONL) for the user's own, or ``hotpotqa_path`` (a HotpotQA JSON file: its questions, and its
contexts as the corpus unless ``corpus_path`` is given).
"""

from __future__ import annotations

import functools

from envs.host import HostStep
from envs.host_text import HostPrompt, parse_answer
from envs.qa_reward import AnswerScore, extract_answer, score_answer
from envs.search_data import Question, load_corpus, load_hotpotqa, load_questions
from envs.search_index import BM25Index, format_results
from envs.search_world import CORPUS_PATH, QUESTIONS_PATH

# RAGEN config/envs.yaml, SearchQA: env_instruction (a YAML block, its trailing newline kept) and max_tokens.
INSTRUCTION = (
    "You are a search agent answering questions by searching for information.\n"
    "Use search[your query] to find relevant documents, and finish[your answer] to submit your final answer.\n"
    "\n"
    "You should first reason step-by-step about the current situation. This reasoning process MUST be "
    "enclosed within <think> </think> tags.\n"
    "Then provide your action within <answer>...</answer> tags.\n"
    "\n"
    "Examples:\n"
    "  <think>I need to find information about Ben Platt's father.</think><answer>search[Ben Platt father parent]</answer>\n"
    "  <think>Based on the search results, Ben Platt's father is Henry Platt.</think><answer>finish[Henry Platt]</answer>\n"
)
MAX_RESPONSE_TOKENS = 300
ACTIONS_LINE = "Available actions: search[<query>], finish[<answer>]"


@functools.lru_cache(maxsize=8)
def _data(questions_path: str, corpus_path: str, hotpotqa_path: str) -> tuple[tuple[Question, ...], BM25Index]:
    """The questions and the index of one data choice, built once per process (keyed by the paths, so a
    large corpus is neither re-read nor re-hashed for every episode)."""
    if hotpotqa_path:
        questions, corpus = load_hotpotqa(hotpotqa_path)
        corpus = load_corpus(corpus_path) if corpus_path else corpus
    else:
        questions = load_questions(questions_path or QUESTIONS_PATH)
        corpus = load_corpus(corpus_path or CORPUS_PATH)
    return questions, BM25Index(corpus)


class SearchQAEnv:
    """One episode of SearchQA (``envs.host.HostEnv``). See the module docstring for the parameters."""

    def __init__(self, questions_path: str = "", corpus_path: str = "", hotpotqa_path: str = "",
                 prompt_style: str = "ragen", max_response_tokens: int = MAX_RESPONSE_TOKENS, max_steps: int = 10,
                 top_k: int = 5, max_total_chars: int = 4000, f1_threshold: float = 0.3) -> None:
        self.questions, self.index = _data(questions_path, corpus_path, hotpotqa_path)
        self.prompt = HostPrompt(INSTRUCTION, prompt_style, max_response_tokens)
        self.max_steps, self.top_k = max_steps, top_k
        self.max_total_chars, self.f1_threshold = max_total_chars, f1_threshold
        self.question: Question | None = None
        self.state = ""
        self.turn = self.steps = 0
        self.last_score: AnswerScore | None = None

    def system_text(self) -> str:
        return self.prompt.system_text()

    def reset(self, seed: int) -> str:
        self.question = self.questions[seed % len(self.questions)]
        self.state = f"Question: {self.question.question}\n{ACTIONS_LINE}"
        self.turn, self.steps, self.last_score = 1, 0, None
        return self.prompt.turn_text(1, self.state, self.max_steps)

    def search(self, query: str) -> str:
        """The formatted top-k results of ``query`` (what a search action shows)."""
        return format_results(self.index.search(query, self.top_k), self.max_total_chars)

    def step(self, response_text: str) -> HostStep:
        assert self.question is not None, "reset before step"
        _, pieces = parse_answer(response_text, max_actions=1)
        self.turn += 1
        if not pieces:
            next_text = self.prompt.reward_text(0.0) + self.prompt.turn_text(
                self.turn, self.state, self.max_steps - self.steps, warning=True)
            return HostStep(0.0, False, False, False, 0, 0, next_text)
        action = pieces[0]
        self.steps += 1
        reward, done, success = 0.0, True, False
        if action.startswith("search[") and action.endswith("]"):
            query = action[len("search["):-1]
            done = self.steps >= self.max_steps
            tail = "Maximum search steps reached. Episode ended without an answer." if done else ACTIONS_LINE
            self.state = f"Search results for '{query}':\n{self.search(query)}\n\n{tail}"
        else:
            finished = action.startswith("finish[") and action.endswith("]")
            answer = action[len("finish["):-1] if finished else extract_answer(action)
            self.last_score = score_answer(answer, self.question.answers, self.f1_threshold)
            reward, success = self.last_score.reward, self.last_score.success
            label = "Your answer" if finished else "Your answer (extracted)"
            self.state = f"{label}: {answer}. Reward: {reward:.2f}"
        done = done or self.steps >= self.max_steps
        next_text = self.prompt.reward_text(reward) + self.prompt.turn_text(self.turn, self.state,
                                                                            self.max_steps - self.steps)
        return HostStep(reward, done, success, True, 1, 1, next_text)
