"""The English analyzer of the embedded BM25 index: text -> index terms.

It follows Lucene's `EnglishAnalyzer` (also Elasticsearch's `english` analyzer) step by step, so the embedded
index and an Elasticsearch index see nearly the same terms:

1. split into word tokens (Unicode letters/digits/underscore; inner apostrophes kept, so "walker's" is one token),
2. lowercase,
3. drop the English possessive "'s",
4. drop Lucene's 33 English stopwords,
5. Porter stemming (the Porter 1 algorithm Lucene's `PorterStemFilter` implements, via PyStemmer).

Lucene's tokenizer implements full Unicode word breaking (UAX #29); the regular expression here agrees with it on
plain prose and differs on edge cases (e.g. "3.14" is two tokens here, one in Lucene).
"""
from __future__ import annotations

import re
import threading

import Stemmer

# Lucene's EnglishAnalyzer.ENGLISH_STOP_WORDS_SET (also Elasticsearch's `_english_` stop list).
ENGLISH_STOPWORDS = frozenset((
    "a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "if", "in", "into", "is", "it", "no", "not",
    "of", "on", "or", "such", "that", "the", "their", "then", "there", "these", "they", "this", "to", "was",
    "will", "with",
))
# Recorded in every index so a reader can refuse an index built by a different analyzer.
ANALYZER_NAME = "lucene-english-v1"

_TOKEN_RE = re.compile(r"\w+(?:['\u2019]\w+)*")
# PyStemmer objects are not thread-safe: one per thread.
_local = threading.local()


def _stemmer() -> Stemmer.Stemmer:
    stemmer = getattr(_local, "stemmer", None)
    if stemmer is None:
        stemmer = _local.stemmer = Stemmer.Stemmer("porter")
    return stemmer


def analyze(text: str) -> list[str]:
    """Index terms of `text`, in order, duplicates kept (their count is the term frequency)."""
    words = []
    for token in _TOKEN_RE.findall(text.lower()):
        if token.endswith(("'s", "\u2019s")):
            token = token[:-2]
        if token not in ENGLISH_STOPWORDS:
            words.append(token)
    return _stemmer().stemWords(words)
