"""A trajectory viewer: one self-contained HTML page that shows rollouts turn by turn.

People debug search agents by reading rollouts. The page shows, per question: the gold answers, the
model's answer and scores, and every turn (the model's own text, its action and query, the passages that
came back, the invalid-action message); filters by benchmark, correctness, stop reason, number of searches
and free text. No server and no network: the data is embedded in the page.

    eviback report runs/eval/baseline            # writes runs/eval/baseline/viewer.html
    write_viewer(items, "viewer.html")           # from EvalItems
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from eviback.metrics import AnswerScores, TrajectoryStats
from eviback.templates import Markup, render
from eviback.types import Trajectory


class ScoredTrajectory(Protocol):
    """What the viewer shows of an evaluated question (an :class:`eviback.evaluate.EvalItem` is one): the
    viewer sits above evaluation and names no evaluation type."""

    benchmark: str
    trajectory: Trajectory
    scores: AnswerScores
    stats: TrajectoryStats


def _trajectory_record(benchmark: str, trajectory: Trajectory, em: float, f1: float, valid: bool) -> dict[str, Any]:
    q = trajectory.question
    return {
        "benchmark": benchmark,
        "id": q.id,
        "question": q.question,
        "gold": list(q.golden_answers),
        "answer": trajectory.answer,
        "em": em,
        "f1": round(f1, 3),
        "valid": valid,
        "stop": trajectory.stop_reason.value,
        "sample": trajectory.sample_index,
        "turns": [
            {
                "text": t.text,
                "action": t.action.kind.value,
                "content": t.action.content,
                "executed": t.executed,
                "passages": [{"id": p.id, "title": p.title, "text": p.text, "score": p.score} for p in t.passages],
                # A search's observation is shown through its passages; other observations as text.
                "observation": "" if t.passages or t.executed else t.observation,
            }
            for t in trajectory.turns
        ],
    }


def render_viewer(records: list[dict[str, Any]], title: str = "Trajectories") -> str:
    """The HTML page for `records` (see :func:`write_viewer`)."""
    data = json.dumps(records, ensure_ascii=False).replace("</", "<\\/")  # never close the script tag early
    return render("viewer.html.j2", title=title, data=Markup(data))


def write_viewer(items: Iterable[ScoredTrajectory], path: str | os.PathLike, title: str = "Trajectories") -> Path:
    """Write the viewer page of evaluation items to `path`."""
    records = [_trajectory_record(i.benchmark, i.trajectory, i.scores.em, i.scores.f1, i.stats.valid_answer)
               for i in items]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render_viewer(records, title), encoding="utf-8")
    os.replace(tmp, path)
    return path

