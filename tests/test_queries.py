"""Search queries written by rule (eviback/queries.py): the first query, the reformulation, the entities a
second hop may search."""

from eviback.queries import contains_words, entity_candidates, retry_query, search_query
from eviback.types import Question


def test_the_first_query_is_the_question_without_its_question_mark():
    assert search_query(Question("q", "  Who wrote Hamlet? ", ("Shakespeare",))) == "Who wrote Hamlet"


def test_the_reformulation_uses_subject_and_relation_else_the_keywords():
    popqa = Question("p", "What is Will Smith's occupation?", ("actor",), metadata={"subj": "Will Smith",
                                                                                     "prop": "occupation"})
    assert retry_query(popqa) == "Will Smith occupation"
    born = Question("b", "Where was Ada Lovelace born?", ("London",), metadata={"subj": "Ada Lovelace",
                                                                                "prop": "place of birth"})
    assert retry_query(born) == "Ada Lovelace born"
    assert retry_query(Question("n", "Who was the first president of the United States?", ("Washington",))) == \
        "first president United States"


def test_entities_are_capitalised_runs_the_question_does_not_name():
    text = "The Church of England appointed John Smith. He met Mary Jones in London."
    found = entity_candidates(text, "Who did John Smith meet?", exclude=["London"])
    assert found == ["Church of England", "Mary Jones"]  # "The" leads the run without being part of the name
    assert contains_words("He met Mary Jones.", "mary jones") and not contains_words("Maryjones", "Mary Jones")
    assert not contains_words("anything", "")
