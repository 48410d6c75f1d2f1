"""The HTML pages' templates (jinja2), packaged beside this module.

:func:`render` fills one template. Every value is HTML-escaped unless the caller marks it as markup
(:class:`markupsafe.Markup`: an HTML fragment built by another template, or JSON made safe for a script
tag). Templates: ``eval_table.html.j2`` (a metrics table of `eviback eval`), ``viewer.html.j2`` (the
trajectory viewer), ``training_report.html.j2`` (`eviback.train.plots`), ``experiment.html.j2`` (the
comparison of `eviback experiment`).
"""

from __future__ import annotations

import functools
from typing import Any

import jinja2
from markupsafe import Markup

__all__ = ["Markup", "render"]


@functools.cache
def _environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.PackageLoader("eviback", "templates"), autoescape=True, keep_trailing_newline=True,
                              undefined=jinja2.StrictUndefined)


def render(name: str, **context: Any) -> str:
    """The template `name` filled with `context` (a missing variable is an error, not an empty string)."""
    return _environment().get_template(name).render(**context)
