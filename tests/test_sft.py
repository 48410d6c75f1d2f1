"""Warm-start data and caching: example construction, exact loss masks, the eval guard, the cache key.

Fast: a character-level tokenizer and a keyword retriever over a handful of passages stand in for the
model's tokenizer and BM25 (the real ones are exercised in test_sft_model.py)."""

import json
import re

import pytest

from eviback.data import eval_question_keys, load_suite
from eviback.metrics import exact_match, normalize_answer
from eviback.protocol import render_observation
from eviback.queries import QueryForm, contains_words, hop_query, query_forms, query_terms
from eviback.train import sft
from eviback.train import warmstart_data as wsd
from eviback.types import ActionKind, Passage, Question


class CharTokenizer:
    """One token per character; the chat template wraps the user message in visible markers."""

    eos_token_id = 0
    eos_token = "\x00"
    pad_token = "\x00"
    chat_template = "<role>content</role>"  # it has one (apply_chat_template below): a prompt style checks for it

    def __call__(self, text, add_special_tokens=False):
        if isinstance(text, list):
            return {"input_ids": [[ord(c) for c in t] for t in text]}
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        assert not tokenize and add_generation_prompt
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<assistant>"


STOP = {"who", "what", "where", "when", "was", "is", "of", "on", "in", "a", "the", "from", "to"}


class KeywordRetriever:
    """Ranks passages by shared normalised words with the query (ties: corpus order); records queries."""

    def __init__(self, passages):
        self.passages = list(passages)
        self.queries = []

    def search(self, queries, topk=3):
        out = []
        for query in queries:
            self.queries.append(query)
            words = set(normalize_answer(query).split()) - STOP
            scored = [(len(words & set(normalize_answer(p.contents).split())), -i, p)
                      for i, p in enumerate(self.passages)]
            scored = [s for s in scored if s[0] > 0]
            scored.sort(key=lambda s: (s[0], s[1]), reverse=True)
            out.append([Passage(p.id, p.contents, float(s)) for s, _, p in scored[:topk]])
        return out

    def close(self):
        pass


CORPUS = [
    Passage.from_title_text("p1", "Ada Lovelace", "Ada Lovelace was an English mathematician and writer, "
                            "chiefly known for her work on Charles Babbage's Analytical Engine."),
    Passage.from_title_text("p2", "Analytical Engine", "The Analytical Engine was a proposed mechanical "
                            "computer designed by Charles Babbage. It was first described in 1837."),
    Passage.from_title_text("p3", "Charles Babbage", "Charles Babbage was born in London. He was an English "
                            "polymath who originated the concept of a digital programmable computer."),
    Passage.from_title_text("p4", "Lovelace Road", "Lovelace Road is a street in a town. A writer lived there."),
    Passage.from_title_text("p5", "Blue whale", "The blue whale is a marine mammal. It is the largest animal."),
]


def q(qid, text, golds, dataset="nq", **metadata):
    return Question(qid, text, tuple(golds), dataset=dataset, metadata=metadata)


TOK = CharTokenizer()


def build(questions, corpus=CORPUS, **kwargs):
    retriever = KeywordRetriever(corpus)
    examples, report = wsd.build_examples(questions, retriever, TOK, **kwargs)
    return examples, report, retriever


def model_texts(example):
    return [t.text for t in example.trajectory.turns]


# ---------------------------------------------------------------- finding answers


def test_find_answer_whole_words_and_surface_form():
    text = "It was first described in 1837. The Beatles were a band."
    assert wsd.find_answer(["1837"], text)[0] == "1837"
    surface, start, end = wsd.find_answer(["Beatles"], text)
    assert surface == "Beatles" and text[start:end] == "Beatles"
    assert wsd.find_answer(["the beatles"], text)[0] == "Beatles"  # articles are dropped by normalisation
    assert wsd.find_answer(["183"], text) is None  # never part of a word
    assert wsd.find_answer(["band"], text)[0] == "band"  # trailing punctuation is not part of the answer


# ---------------------------------------------------------------- single-search examples


def test_single_hop_example_is_grounded_and_protocol_exact():
    question = q("n1", "who designed the analytical engine", ["Charles Babbage"], gold_passage_ids=["p2"])
    (example,), report, retriever = build([question])
    assert example.kind is wsd.ExampleKind.SINGLE and report.kept == {"single": 1}
    first, last = example.trajectory.turns
    # The model's turns end exactly at the closing tags; the first is a search for the question, in the
    # form the build drew for it.
    assert first.text.endswith("</search>") and last.text.endswith("</answer>")
    assert first.action.kind is ActionKind.SEARCH
    assert first.action.content == query_forms(question)[example.forms[0]]
    assert report.drawn == {example.forms[0].value: 1}
    assert report.forms == {"single": {"first": {example.forms[0].value: 1}}}
    assert first.executed and last.action.kind is ActionKind.ANSWER and not last.observation
    # The observation is exactly what the retriever returned for that query, rendered by the protocol.
    assert retriever.queries[0] == first.action.content
    assert first.observation == render_observation(retriever.search([first.action.content])[0])
    # The answer is a gold answer, found in the passage the <think> cites.
    assert exact_match(example.trajectory.answer, question.golden_answers) == 1.0
    assert last.action.content == example.trajectory.answer
    cited = re.search(r"\(Doc (\d)\) says", last.text).group(1)  # the title first, then the number
    assert first.passages[int(cited) - 1].id == "p2"
    assert "Charles Babbage" in first.passages[int(cited) - 1].text


def test_no_example_when_the_answer_is_not_retrieved():
    question = q("n2", "what is the largest fish", ["whale shark"])
    examples, report, _ = build([question])
    assert examples == [] and report.rejected == {"answer_not_retrieved": 1}


def test_only_gold_passages_are_cited_when_known():
    # "writer" appears in p1 (the gold) and p4 (a distractor ranked first): the distractor is never cited.
    question = q("n3", "lovelace road writer", ["writer"], gold_passage_ids=["p1"])
    (example,), _, _ = build([question])
    first, last = example.trajectory.turns
    assert first.passages[0].id == "p4"
    assert "Ada Lovelace (Doc 2) says" in last.text
    # Without the gold passage among the results the question yields nothing.
    nothing, report, _ = build([q("n4", "lovelace road writer", ["writer"], gold_passage_ids=["p9"])])
    assert nothing == [] and report.rejected == {"answer_not_retrieved": 1}


def test_subject_must_be_mentioned_by_the_cited_passage():
    question = q("pq1", "What is Ada Lovelace's occupation?", ["writer"], dataset="popqa", subj="Ada Lovelace",
                 prop="occupation")
    (example,), _, _ = build([question])
    assert "Ada Lovelace (Doc " in example.trajectory.turns[-1].text
    stranger = q("pq2", "What is Lovelace Road's occupation?", ["writer"], dataset="popqa", subj="Jane Roe",
                 prop="occupation")
    examples, _, _ = build([stranger])
    assert examples == []


def test_observation_cap_hides_answers_past_it():
    question = q("n5", "charles babbage born", ["London"], gold_passage_ids=["p3"])
    (example,), _, _ = build([question], max_obs_tokens=500)
    assert len(example.trajectory.turns[0].observation) <= 500
    # With a cap that cuts the passage before "London", the answer is not visible: no example.
    full = render_observation(KeywordRetriever(CORPUS).search(["charles babbage born"])[0])
    cap = full.index("London") - 5
    examples, _, _ = build([question], max_obs_tokens=cap)
    assert examples == []
    capped = wsd.cap_observation(full, TOK, cap)
    assert capped == full[:cap] and len(TOK(capped)["input_ids"]) == cap


# ---------------------------------------------------------------- multi-search examples


def test_multi_hop_example_searches_an_entity_found_by_the_first_search():
    question = q("h1", "What city was the designer of the engine Ada Lovelace worked on from?", ["London"],
                 dataset="hotpotqa", supporting_titles=["Ada Lovelace", "Charles Babbage"],
                 gold_passage_ids=["p1", "p3"])
    (example,), report, _ = build([question])
    assert example.kind is wsd.ExampleKind.MULTI and report.kept == {"multi": 1}
    first, second, last = example.trajectory.turns
    assert [t.action.kind for t in (first, second, last)] == [ActionKind.SEARCH, ActionKind.SEARCH, ActionKind.ANSWER]
    assert first.executed and second.executed
    entity = re.search(r"\(Doc \d\) mentions (.+?)\. I need", second.text).group(1)  # the title first
    # The second query names something the first results mention, not in the question, in the drawn form...
    assert contains_words(first.observation, entity) and not contains_words(question.question, entity)
    assert second.action.content == hop_query(entity, question, example.forms[1])
    # ...and it brought a gold passage the first search had not, which holds the answer.
    new = {p.id for p in second.passages} - {p.id for p in first.passages}
    assert new & {"p1", "p3"}
    assert "London" in second.observation and exact_match(example.trajectory.answer, ["London"]) == 1.0


def test_supporting_passages_named_by_title_only_are_matched_by_title():
    """The release's multi-hop training files name their support by title, without passage ids: the hop must
    bring a passage of one of those titles (builder 4 looked for ids only and built no multi-hop example)."""
    question = q("h3", "What city was the designer of the engine Ada Lovelace worked on from?", ["London"],
                 dataset="hotpotqa", supporting_titles=["Ada Lovelace", "Charles Babbage"])
    assert not question.gold_passage_ids
    (example,), report, _ = build([question])
    assert example.kind is wsd.ExampleKind.MULTI and report.kept == {"multi": 1}
    first, second, _ = example.trajectory.turns
    brought = [p for p in second.passages if p.id not in {f.id for f in first.passages}]
    assert "Charles Babbage" in {p.title for p in brought}
    entity = re.search(r"\(Doc \d\) mentions (.+?)\. I need", second.text).group(1)
    assert any(p.title == "Charles Babbage" and contains_words(p.contents, entity) for p in brought)


def test_an_answer_outside_the_named_support_is_not_cited():
    """Support named by title only: a passage of another title that happens to hold the answer is not cited."""
    question = q("h4", "Which city was Charles Babbage born in?", ["London"], dataset="hotpotqa",
                 supporting_titles=["Blue whale"])
    examples, report, _ = build([question])
    assert examples == [] and sum(report.rejected.values()) == 1
    assert wsd.support_ids(question, CORPUS) == {"p5"}
    assert wsd.support_ids(q("n9", "x", ["y"]), CORPUS) is None  # no support named: any passage may be cited


def test_a_hop_is_kept_only_when_the_passage_it_brought_names_the_entity_searched():
    """A supporting passage that a hop query retrieved through its other words, without naming the entity,
    came by chance: keeping it would teach "Acme Widgets mentions Rover Club, I need more about Rover Club"
    as the way to the answer."""
    corpus = [Passage.from_title_text("a1", "Acme Widgets", "Acme Widgets is a company. Its sponsor is Rover Club."),
              Passage.from_title_text("a2", "Birth records", "The founder of the company was born in Paris.")]
    question = q("h5", "Where was the founder of Acme Widgets born?", ["Paris"], dataset="hotpotqa",
                 supporting_titles=["Acme Widgets", "Birth records"], gold_passage_ids=["a1", "a2"])
    # seed 6 draws the entity as the first query and the entity with the question's keywords as the hop
    examples, report, retriever = build([question], corpus=corpus, topk=2, seed=6)
    assert retriever.queries == ["Acme Widgets", "Rover Club founder Acme"]  # the hop brought a2, by "founder"
    assert examples == [] and report.rejected == {"no_second_hop": 1}


def test_multi_hop_question_without_a_useful_second_hop_falls_back_to_single():
    question = q("h2", "who designed the analytical engine", ["Charles Babbage"], dataset="hotpotqa",
                 supporting_titles=["Analytical Engine"], gold_passage_ids=["p2"])
    (example,), _, _ = build([question])
    assert example.kind is wsd.ExampleKind.SINGLE


def test_retry_example_searches_again_after_a_miss():
    corpus = [*CORPUS, Passage.from_title_text("p6", "Grace Hopper", "Hopper was born in New York City."),
              Passage.from_title_text("p7", "Admiral", "An admiral of the navy of a country, a city or grace.")]
    question = q("pq3", "In what city was Grace Hopper, the admiral of the navy of the country, born?",
                 ["New York City"], dataset="popqa", subj="Hopper", prop="place of birth")
    kinds = set()
    for seed in range(30):  # the forms drawn differ by seed: some first searches find it, some do not
        examples, _, retriever = build([question], corpus=corpus, topk=1, seed=seed)
        for example in examples:
            kinds.add(example.kind)
            if example.kind is wsd.ExampleKind.SINGLE:
                assert "New York City" in example.trajectory.turns[0].observation
                continue
            assert example.kind is wsd.ExampleKind.RETRY
            first, second, last = example.trajectory.turns
            assert "New York" not in first.observation and "New York City" in second.observation
            # The search again is another form of the question, with other terms than the first search's, by
            # one rule: the question as written after any other form, the shorter query after the question.
            forms = query_forms(question)
            assert [first.action.content, second.action.content] == [forms[f] for f in example.forms]
            assert query_terms(first.action.content) != query_terms(second.action.content)
            assert retriever.queries == [first.action.content, second.action.content]
            if example.forms[0] is QueryForm.QUESTION:
                assert example.forms[1] is QueryForm.SUBJECT_RELATION
                assert "search again with a shorter query" in second.text
            else:
                assert example.forms[1] is QueryForm.QUESTION
                assert "search again with the whole question" in second.text
    assert kinds == {wsd.ExampleKind.SINGLE, wsd.ExampleKind.RETRY}


def test_retry_form_follows_one_rule():
    question = q("r1", "In what country is the city of Ulm?", ["Germany"], dataset="popqa", subj="Ulm",
                 prop="country")
    forms = query_forms(question)
    assert {QueryForm.QUESTION, QueryForm.SUBJECT_RELATION, QueryForm.ENTITY} <= set(forms)
    others = {form: query for form, query in forms.items() if form is not QueryForm.ENTITY}
    assert wsd.retry_form(QueryForm.ENTITY, others, 0, question) is QueryForm.QUESTION
    after_question = {form: query for form, query in forms.items() if form is not QueryForm.QUESTION}
    assert wsd.retry_form(QueryForm.QUESTION, after_question, 0, question) is QueryForm.SUBJECT_RELATION
    no_subject = {form: query for form, query in after_question.items() if form is not QueryForm.SUBJECT_RELATION}
    assert wsd.retry_form(QueryForm.QUESTION, no_subject, 0, question) is QueryForm.ENTITY
    # Neither shorter form: a seeded draw from what is left, the same for the same seed.
    rest = {form: query for form, query in no_subject.items() if form is not QueryForm.ENTITY}
    drawn = {wsd.retry_form(QueryForm.QUESTION, rest, seed, question) for seed in range(20)}
    assert drawn <= set(rest) and len(drawn) > 1
    assert wsd.retry_form(QueryForm.QUESTION, rest, 3, question) is wsd.retry_form(QueryForm.QUESTION, rest, 3, question)


def test_query_forms_are_drawn_per_question_and_seed():
    """The form of a question's queries depends on the build seed and the question alone: the same in any
    build, whatever other questions it holds and in whatever order; another seed draws others."""
    questions = [
        q("n1", "who designed the analytical engine", ["Charles Babbage"], gold_passage_ids=["p2"]),
        q("n2", "Who designed the Analytical Engine?", ["Charles Babbage"], gold_passage_ids=["p2"]),
        q("n3", "Charles Babbage was born in which city?", ["London"], gold_passage_ids=["p3"]),
        q("n4", "When was the Analytical Engine first described?", ["1837"], gold_passage_ids=["p2"]),
        q("pq1", "What is Ada Lovelace's occupation?", ["writer"], dataset="popqa", subj="Ada Lovelace",
          prop="occupation"),
    ]

    def first_queries(qs, seed):
        examples, report, _ = build(qs, seed=seed)
        assert sum(report.drawn.values()) == len(qs)
        kept_forms = sum(n for by in report.forms.values() for n in by["first"].values())
        assert kept_forms == len(examples)
        return {e.question.id: e.trajectory.turns[0].action.content for e in examples}

    zero = first_queries(questions, 0)
    assert len(zero) == len(questions)
    assert first_queries(questions, 0) == zero
    assert first_queries(questions[::-1], 0) == zero
    assert first_queries(questions[2:3], 0) == {"n3": zero["n3"]}
    others = [first_queries(questions, seed) for seed in (1, 2, 3)]
    assert any(o != zero for o in others)
    for queries in (zero, *others):
        for question in questions:
            assert queries[question.id] in query_forms(question).values()
    # Over seeds, more than one form of the same question is searched.
    assert len({first_queries(questions[4:], seed)["pq1"] for seed in range(12)}) > 1


# ---------------------------------------------------------------- masks


def test_masks_train_exactly_the_models_own_tokens():
    question = q("h1", "What city was the designer of the engine Ada Lovelace worked on from?", ["London"],
                 dataset="hotpotqa", supporting_titles=["Ada Lovelace", "Charles Babbage"],
                 gold_passage_ids=["p1", "p3"])
    (example,), _, _ = build([question])
    trace = wsd.tokenize_trajectory(example.trajectory, TOK, max_obs_tokens=1000)
    prompt = TOK.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True)
    assert TOK.decode(trace.prompt_ids).startswith("<user>Answer the given question.")
    assert TOK.decode(trace.prompt_ids).endswith(prompt[-len("<assistant>"):])
    assert len(trace.ids) == len(trace.mask)
    # Walk the response: turn text (mask 1), observation (mask 0), ..., final turn, then EOS (mask 1).
    expected_mask = []
    for turn in example.trajectory.turns:
        expected_mask += [1] * len(turn.text) + [0] * len(turn.observation)
    expected_mask.append(1)
    assert list(trace.mask) == expected_mask
    assert TOK.decode(trace.ids[:-1]) == example.trajectory.response and trace.ids[-1] == TOK.eos_token_id
    input_ids, labels = wsd.labels_for(trace)
    assert input_ids == list(trace.prompt_ids) + list(trace.ids)
    assert labels[: len(trace.prompt_ids)] == [wsd.IGNORE_INDEX] * len(trace.prompt_ids)
    trained = "".join(chr(t) for t in labels if t != wsd.IGNORE_INDEX)
    assert trained == "".join(t.text for t in example.trajectory.turns) + "\x00"
    for turn in example.trajectory.turns:
        assert "<information>" not in turn.text


def test_tokenize_caps_observations_like_the_rollout_engine():
    question = q("n1", "who designed the analytical engine", ["Charles Babbage"], gold_passage_ids=["p2"])
    (example,), _, _ = build([question])
    trace = wsd.tokenize_trajectory(example.trajectory, TOK, max_obs_tokens=40, end_with_eos=False)
    first, last = example.trajectory.turns
    assert trace.mask == (1,) * len(first.text) + (0,) * 40 + (1,) * len(last.text)
    assert TOK.decode(trace.ids[len(first.text): len(first.text) + 40]) == first.observation[:40]


# ---------------------------------------------------------------- selection


def fake_example(i, kind, dataset="nq"):
    question = q(f"{dataset}-{kind}-{i}", f"question {i}", ["a"], dataset=dataset)
    from eviback.types import StopReason, Trajectory

    return wsd.WarmStartExample(Trajectory(question, (), "a", StopReason.ANSWERED), kind)


def test_select_examples_respects_the_multi_search_share_and_is_deterministic():
    pool = ([fake_example(i, wsd.ExampleKind.SINGLE, "nq") for i in range(50)]
            + [fake_example(i, wsd.ExampleKind.SINGLE, "popqa") for i in range(50)]
            + [fake_example(i, wsd.ExampleKind.MULTI, "hotpotqa") for i in range(30)]
            + [fake_example(i, wsd.ExampleKind.RETRY, "nq") for i in range(3)])
    chosen = wsd.select_examples(pool, 40, 0.25, seed=1)
    assert len(chosen) == 40 and len({e.question.id for e in chosen}) == 40
    assert sum(e.kind is not wsd.ExampleKind.SINGLE for e in chosen) == 10
    singles = [e for e in chosen if e.kind is wsd.ExampleKind.SINGLE]
    assert {e.question.dataset for e in singles} == {"nq", "popqa"}  # spread over the data sets
    assert [e.question.id for e in chosen] == [e.question.id for e in wsd.select_examples(pool, 40, 0.25, seed=1)]
    # Not enough multi-search examples: the rest is filled with single-search ones.
    assert len(wsd.select_examples(pool, 200, 0.9)) == len(pool)


# ---------------------------------------------------------------- never evaluation questions


def test_embedded_training_files_hold_no_evaluation_question():
    suite = load_suite()
    config = sft.WarmStartConfig()
    questions = sft.training_questions(config, suite)
    ids, texts = eval_question_keys(suite)
    assert len(questions) >= 500
    assert not {x.id for x in questions} & ids
    assert not {normalize_answer(x.question) for x in questions} & texts
    assert {x.dataset for x in questions} == {"nq", "popqa", "hotpotqa", "musique"}


# ---------------------------------------------------------------- config and cache


def test_config_validation_names_the_fix():
    with pytest.raises(ValueError, match="max_examples must be >= 1"):
        sft.WarmStartConfig(max_examples=0)
    with pytest.raises(ValueError, match="dtype must be one of auto, bfloat16, float32, got .float16."):
        sft.WarmStartConfig(dtype="float16")
    with pytest.raises(ValueError, match="multi_search_share"):
        sft.WarmStartConfig(multi_search_share=1.5)
    assert "learning_rate" in sft.describe_fields()


def test_cache_key_settings_are_taken_by_value_not_by_type():
    """`epochs: 1` from a YAML file and 1.0 from the command line are the same warm start (one cache key)."""
    as_int = sft.WarmStartConfig(epochs=1, multi_search_share=0, learning_rate=1e-4).key_fields()
    as_float = sft.WarmStartConfig(epochs=1.0, multi_search_share=0.0, learning_rate=1e-4).key_fields()
    assert json.dumps(as_int, sort_keys=True) == json.dumps(as_float, sort_keys=True)
    assert as_int["max_examples"] == 200 and isinstance(as_int["max_examples"], int)
    assert sft.WarmStartConfig(epochs=2).key_fields() != as_float


def test_the_rollout_settings_have_the_rollouts_names_and_defaults_and_keep_their_key():
    """`topk` and `max_observation_tokens` are RolloutConfig's settings; the key still names the observation cap
    `max_obs_tokens`, so a warm start saved before the rename is reused."""
    from eviback.rollout import RolloutConfig

    config = sft.WarmStartConfig()
    assert (config.topk, config.max_observation_tokens) == (RolloutConfig.topk, RolloutConfig.max_observation_tokens)
    key = sft.WarmStartConfig(max_observation_tokens=300).key_fields()
    assert key["max_obs_tokens"] == 300 and "max_observation_tokens" not in key


def write_suite(root):
    """A tiny data suite: the corpus above, two training questions and one evaluation question."""
    root.mkdir()
    with open(root / "corpus.jsonl", "w") as f:
        for p in CORPUS:
            f.write(json.dumps({"id": p.id, "contents": p.contents}) + "\n")
    train = [
        {"id": "t1", "question": "who designed the analytical engine", "golden_answers": ["Charles Babbage"],
         "dataset": "nq", "metadata": {"gold_passage_ids": ["p2"]}},
        {"id": "t2", "question": "where was charles babbage born", "golden_answers": ["London"],
         "dataset": "nq", "metadata": {"gold_passage_ids": ["p3"]}},
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(x) + "\n" for x in train))
    (root / "eval.jsonl").write_text(json.dumps({"id": "e1", "question": "what is the largest animal",
                                                 "golden_answers": ["blue whale"]}) + "\n")
    (root / "suite.json").write_text(json.dumps({"corpus": "corpus.jsonl", "train": ["train.jsonl"],
                                                 "eval": {"nq": "eval.jsonl"}}))
    return root


@pytest.fixture
def offline_warm_start(tmp_path, monkeypatch):
    """warm_start on the tiny suite with the fine-tuning replaced by a stub that counts its calls."""
    model = tmp_path / "base"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    monkeypatch.setenv("EVIBACK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sft, "load_tokenizer", lambda *a, **k: TOK)
    calls = []

    def fake_finetune(examples, tokenizer, base_dir, out_dir, config):
        calls.append(len(examples))
        (out_dir / "config.json").write_text("{}")
        return sft.TrainStats(len(examples), 1, 10, 5, 1.0, 10.0, 0.1, 0.75, 1.0, 0.5, (1.0, 0.5))

    monkeypatch.setattr(sft, "finetune", fake_finetune)
    suite = write_suite(tmp_path / "suite")

    def run(**overrides):
        config = sft.WarmStartConfig(model=str(model), data=str(suite), progress=False, **overrides)
        return sft.warm_start(config, retriever=KeywordRetriever(CORPUS))

    return run, calls, tmp_path


def test_warm_start_is_cached_by_model_data_and_settings(offline_warm_start):
    run, calls, tmp_path = offline_warm_start
    first = run()
    assert calls == [2]
    assert first.parent == tmp_path / "cache" / "warmstart"
    saved = json.loads((first / sft.CONFIG_FILE).read_text())
    assert saved["key"] == first.name and saved["learning_rate"] == 1e-4  # the resolved config is written
    report = json.loads((first / sft.REPORT_FILE).read_text())
    assert report["examples"] == {"total": 2, "single": 2, "multi": 0, "retry": 0}
    # The build counts the first query's form of every question, and the forms of the examples it kept.
    assert sum(report["build"]["drawn"].values()) == 2
    assert sum(report["build"]["forms"]["single"]["first"].values()) == 2
    assert len((first / sft.EXAMPLES_FILE).read_text().splitlines()) == 2
    # Same inputs: reused without training, whatever the settings outside the key.
    assert run(threads=1, logging_steps=1) == first and calls == [2]
    # Another setting that shapes training: a new key and a new model.
    other = run(learning_rate=5e-5)
    assert other != first and calls == [2, 2]
    # Fewer examples are different training data: a new key.
    assert run(max_examples=1) not in (first, other) and calls == [2, 2, 1]
    assert run(force=True) == first and calls == [2, 2, 1, 2]
    # Another base model: a new key.
    (tmp_path / "base" / "model.safetensors").write_bytes(b"other weights")
    assert run() != first


def test_warm_start_output_directory(offline_warm_start):
    run, calls, tmp_path = offline_warm_start
    out = tmp_path / "ws"
    assert run(output=str(out)) == out and (out / sft.REPORT_FILE).exists()
    assert run(output=str(out)) == out and calls == [2]
    stranger = tmp_path / "not-a-model"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a warm start"):
        run(output=str(stranger))


def test_cli_sft_help_and_bad_setting():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "eviback.cli", "sft", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for option in ("--model", "--data", "--train-files", "--max-examples", "--epochs", "--lr", "--output"):
        assert option in out
    bad = subprocess.run([sys.executable, "-m", "eviback.cli", "sft", "--set", "nope=1"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "expected KEY=VALUE with KEY one of" in bad.stderr
