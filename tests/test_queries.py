"""Search queries written by rule (eviback/queries.py): the first query, the reformulation, the entities a
second hop may search, and the forms the warm start draws its queries from."""

from collections import Counter

import pytest

from eviback.queries import (
    QueryForm,
    contains_words,
    draw_form,
    entity_candidates,
    hop_query,
    query_forms,
    query_terms,
    question_entity,
    retry_query,
    search_query,
)
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


def test_the_forms_of_a_first_query():
    popqa = Question("p", "In what city was Rogers McKee born?", ("Shelby",),
                     metadata={"subj": "Rogers McKee", "prop": "place of birth"})
    assert query_forms(popqa) == {
        QueryForm.QUESTION: "In what city was Rogers McKee born",
        QueryForm.KEYWORDS: "city Rogers McKee born",
        QueryForm.NO_WH: "city was Rogers McKee born",
        QueryForm.SUBJECT_RELATION: "Rogers McKee born",
        QueryForm.ENTITY: "Rogers McKee",
        QueryForm.ENTITY_FIRST: "Rogers McKee city born",
    }
    # Without a subject: the longest capitalised run (the wh-word that starts the question is not a name, a
    # number alone is none); a form whose text repeats an earlier one's is left out ("Who wrote Hamlet"
    # without its wh-word is its keywords).
    hotpot = Question("h", "Who directed the film that starred Tom Hanks in 1994?", ("x",))
    assert query_forms(hotpot) == {
        QueryForm.QUESTION: "Who directed the film that starred Tom Hanks in 1994",
        QueryForm.KEYWORDS: "directed film starred Tom Hanks 1994",
        QueryForm.NO_WH: "directed the film that starred Tom Hanks in 1994",
        QueryForm.ENTITY: "Tom Hanks",
        QueryForm.ENTITY_FIRST: "Tom Hanks directed film starred 1994",
    }
    assert query_forms(Question("s", "Who wrote Hamlet?", ("Shakespeare",))) == {
        QueryForm.QUESTION: "Who wrote Hamlet", QueryForm.KEYWORDS: "wrote Hamlet", QueryForm.ENTITY: "Hamlet",
        QueryForm.ENTITY_FIRST: "Hamlet wrote"}


def test_a_lower_cased_question_names_its_topic_by_its_longest_phrase():
    nq = Question("n", "what part of the brain is in the middle cranial fossa", ("temporal lobe",))
    assert question_entity(nq) == "middle cranial fossa"  # "part", right after the wh-word, is the relation
    assert query_forms(nq)[QueryForm.ENTITY_FIRST] == "middle cranial fossa part brain"
    assert question_entity(Question("n2", "who won the world cup in cricket 2017", ("x",))) == "cricket 2017"
    assert question_entity(Question("n3", "who wrote hamlet", ("x",))) == ""  # no phrase of two words
    assert QueryForm.ENTITY not in query_forms(Question("n3", "who wrote hamlet", ("x",)))


def test_a_second_hop_is_the_entity_alone_or_with_the_questions_first_keywords():
    question = Question("h", "What is the name of the airport in the city where WILM is licensed?", ("x",))
    assert hop_query("Wilmington", question, QueryForm.ENTITY) == "Wilmington"
    assert hop_query("Wilmington", question, QueryForm.ENTITY_KEYWORDS) == "Wilmington name airport"
    with pytest.raises(ValueError, match="entity, entity_keywords"):
        hop_query("Wilmington", question, QueryForm.KEYWORDS)


def test_query_terms_are_what_bm25_searches_with():
    # lower-cased, stopwords and one-letter words dropped, order ignored
    assert query_terms("Who wrote the Hamlet of a Prince?") == {"who", "wrote", "hamlet", "prince"}
    assert query_terms("city Rogers McKee born") == query_terms("Rogers McKee city born")
    assert query_terms("In what city was Rogers McKee born") != query_terms("city Rogers McKee born")


def test_draw_form_is_seeded_by_the_build_seed_and_the_question():
    question = Question("p", "In what city was Rogers McKee born?", ("Shelby",),
                        metadata={"subj": "Rogers McKee", "prop": "place of birth"})
    forms = query_forms(question)
    draws = [draw_form(forms, seed, question, "first") for seed in range(600)]
    assert draws == [draw_form(forms, seed, question, "first") for seed in range(600)]  # deterministic
    counts = Counter(draws)
    assert set(counts) == set(forms) and min(counts.values()) > 60  # uniform: 100 each expected
    # a second search is a draw of its own, and another question with the same seed draws on its own
    assert [draw_form(forms, s, question, "second") for s in range(50)] != draws[:50]
    other = Question("p2", "In what city was Mick Flynn born?", ("Cardiff",))
    assert [draw_form(forms, s, other, "first") for s in range(50)] != draws[:50]
    with pytest.raises(ValueError, match="no query form"):
        draw_form({}, 0, question, "first")


def test_draw_form_gives_the_preferred_form_its_share():
    question = Question("p", "In what city was Rogers McKee born?", ("Shelby",),
                        metadata={"subj": "Rogers McKee", "prop": "place of birth"})
    forms = query_forms(question)
    draws = Counter(draw_form(forms, seed, question, "first", (QueryForm.QUESTION,), 0.5) for seed in range(1000))
    assert 440 <= draws[QueryForm.QUESTION] <= 560  # 500 expected; this draw is fixed by the seeds
    others = [draws[form] for form in forms if form is not QueryForm.QUESTION]
    assert len(others) == len(forms) - 1 and min(others) > 60  # the rest uniform: 100 each expected
    # the first preferred form the draw can give; none of them: uniform, as without a preference
    no_subject = {form: q for form, q in forms.items() if form is not QueryForm.SUBJECT_RELATION}
    prefer = (QueryForm.SUBJECT_RELATION, QueryForm.ENTITY)
    assert Counter(draw_form(no_subject, s, question, "second", prefer, 1.0) for s in range(20)) == {
        QueryForm.ENTITY: 20}
    assert [draw_form(forms, s, question, "first", (QueryForm.ENTITY_KEYWORDS,), 0.9) for s in range(50)] == [
        draw_form(forms, s, question, "first") for s in range(50)]
    with pytest.raises(ValueError, match="share"):
        draw_form(forms, 0, question, "first", (QueryForm.QUESTION,), 1.5)
