"""BM25 retrieval over a local passage corpus (``bm25s``), and RAGEN's formatting of the results.

RAGEN-2 retrieves with a dense E5 + FAISS server over 21M Wikipedia passages (``ragen/env/search/
retrieval_client.py``); a local BM25 index is the self-contained stand-in: no server, no GPU, no
download, deterministic. The index (title + text, lower-cased, English stop words removed, no
stemming, bm25s's Lucene BM25 with k1 = 1.5, b = 0.75) is built once per corpus and process
(``envs/search_qa.py`` caches it).

Results are written as RAGEN's client writes them: "[Document i] (ID: {id}, Score: {score:.3f})\\n{text}",
each text cut at 800 characters (+ "..."), joined by blank lines, the whole cut at ``max_total_chars``
(4000, + "..."); no hit: "No relevant documents found for the query." Passages that share no term with
the query (score 0) are not hits.
"""

from __future__ import annotations

import bm25s
import numpy as np

from envs.search_data import Passage

NO_RESULTS = "No relevant documents found for the query."
MAX_DOC_CHARS = 800


class BM25Index:
    """``BM25Index(passages).search(query, k) -> [(passage, score)]``, best first, ties by corpus order."""

    def __init__(self, passages: tuple[Passage, ...]) -> None:
        self.passages = passages
        self.tokenizer = bm25s.tokenization.Tokenizer(stopwords="en")
        texts = [f"{p.title}\n{p.text}" if p.title else p.text for p in passages]
        ids = self.tokenizer.tokenize(texts, update_vocab=True, return_as="ids", show_progress=False)
        self.retriever = bm25s.BM25()
        self.retriever.index(ids, show_progress=False)
        self.unknown = self.tokenizer.get_vocab_dict().get("", -1)

    def search(self, query: str, k: int = 5) -> list[tuple[Passage, float]]:
        # Query words outside the corpus vocabulary map to bm25s's empty-string placeholder: drop them.
        ids = self.tokenizer.tokenize([query], update_vocab=False, return_as="ids", show_progress=False)[0]
        ids = [i for i in ids if i != self.unknown]
        if not ids:
            return []
        scores = np.asarray(self.retriever.get_scores(ids), np.float64)
        order = np.lexsort((np.arange(len(scores)), -scores))[:k]
        return [(self.passages[i], float(scores[i])) for i in order if scores[i] > 0]


def format_results(hits: list[tuple[Passage, float]], max_total_chars: int = 4000) -> str:
    if not hits:
        return NO_RESULTS
    blocks = []
    for i, (passage, score) in enumerate(hits, 1):
        text = f"{passage.title}: {passage.text}" if passage.title else passage.text
        if len(text) > MAX_DOC_CHARS:
            text = text[:MAX_DOC_CHARS] + "..."
        blocks.append(f"[Document {i}] (ID: {passage.id}, Score: {score:.3f})\n{text}")
    output = "\n\n".join(blocks)
    return output[:max_total_chars] + "..." if len(output) > max_total_chars else output
