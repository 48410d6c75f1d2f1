"""The HTML pages come from packaged jinja2 templates: every value escaped, markup only where the caller
says so, and the templates shipped as package data."""

import fnmatch
import json
import tomllib
from pathlib import Path

import pytest

import eviback.templates
from eviback.evaluate import EvalItem, comparison_html, summarize
from eviback.templates import Markup, render
from eviback.types import Action, ActionKind, Passage, Question, StopReason, Trajectory, Turn
from eviback.viewer import _trajectory_record, render_viewer

HOSTILE = "</script><b onload='x'>\"&"
TEMPLATES = Path(eviback.templates.__file__).parent


def _trajectory():
    q = Question("q1", f"who wrote {HOSTILE}?", ("Shakespeare",), dataset="nq")
    search = Turn("<search> hamlet </search>", Action(ActionKind.SEARCH, "hamlet"),
                  (Passage("p1", f'"Hamlet"\nA play {HOSTILE}', score=1.0),),
                  "\n\n<information>Doc 1(Title: \"Hamlet\") A play</information>\n\n", True)
    answer = Turn("<answer> Shakespeare </answer>", Action(ActionKind.ANSWER, "Shakespeare"))
    return Trajectory(q, (search, answer), "Shakespeare", StopReason.ANSWERED)


def test_every_template_is_package_data():
    config = tomllib.loads((TEMPLATES.parents[2] / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["eviback"]
    files = [p.relative_to(TEMPLATES.parent).as_posix() for p in TEMPLATES.glob("*.j2")]
    assert len(files) == 4
    assert all(any(fnmatch.fnmatch(f, pattern) for pattern in patterns) for f in files)


def test_values_are_escaped_and_markup_is_not():
    assert render("eval_table.html.j2", named=True, columns=["a<b"], rows=[
        {"name": HOSTILE, "policy": "p", "bold": True, "cells": ["1"]}]).count("<script") == 0
    page = render("training_report.html.j2", runs=[HOSTILE], steps=[1], rows=[], image="",
                  summary={"sentences": [HOSTILE], "table": [(HOSTILE, HOSTILE)]}, extra_html=Markup("<h2>kept</h2>"))
    assert "<h2>kept</h2>" in page and HOSTILE not in page and "&lt;/script&gt;" in page
    with pytest.raises(Exception, match="undefined"):
        render("eval_table.html.j2", named=False)  # a missing value is an error, never an empty cell


def test_the_evaluation_table_has_one_row_per_benchmark_and_policy():
    summary = summarize([EvalItem.of("nq", _trajectory()), EvalItem.of("hotpotqa", _trajectory())])
    one = comparison_html({"": summary})
    two = comparison_html({"start": summary, "trained <b>": summary})
    assert one.startswith("<table><tr><th>benchmark</th><th>n</th>") and one.endswith("</table>")
    assert "<th>policy</th>" in two and "trained &lt;b&gt;" in two
    assert two.count("<tr") - 1 == 2 * (one.count("<tr") - 1)  # a row per benchmark and policy
    assert "style='font-weight:bold'" in one  # the macro averages


def test_the_viewer_embeds_its_data_without_closing_the_script_tag():
    page = render_viewer([_trajectory_record("nq", _trajectory(), 1.0, 1.0, True)], title=f"T {HOSTILE}")
    start = page.index('<script id="data" type="application/json">') + len('<script id="data" type="application/json">')
    data = page[start:page.index("</script>", start)]
    assert json.loads(data)[0]["question"] == f"who wrote {HOSTILE}?"
    assert "<title>T &lt;/script&gt;" in page and page.endswith("</html>\n")
