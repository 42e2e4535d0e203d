"""Document shape (Search-R1 title/text split) and the English analyzer."""
import pytest

from llds_jax.search import Document
from llds_jax.search.analyzer import ENGLISH_STOPWORDS, analyze
from llds_jax.search.types import check_k


def test_document_title_and_text_follow_search_r1():
    doc = Document(id="7", contents='"Paul Walker"\nPaul William Walker IV\nwas an actor.', score=1.5)
    assert doc.title == '"Paul Walker"'
    assert doc.text == "Paul William Walker IV\nwas an actor."
    assert Document(id="8", contents='"Only Title"', score=0.0).text == ""


def test_analyzer_tokenizes_lowercases_drops_possessives_and_stopwords_and_stems():
    assert analyze("The Walker's dogs were running quickly to Paris, in 1999!") == [
        "walker", "dog", "were", "run", "quickli", "pari", "1999"]
    assert analyze("the of and to a") == []
    assert len(ENGLISH_STOPWORDS) == 33


@pytest.mark.parametrize("bad", [0, -1, 1.0, True, "3"])
def test_k_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="k \\(documents per query\\)"):
        check_k(bad)
