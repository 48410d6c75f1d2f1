"""A trajectory viewer: one self-contained HTML page that shows rollouts turn by turn.

People debug search agents by reading rollouts. The page shows, per question: the gold answers, the
model's answer and scores, and every turn (the model's own text, its action and query, the passages that
came back, the invalid-action message); filters by benchmark, correctness, stop reason, number of searches
and free text. No server and no network: the data is embedded in the page.

    eviback report runs/eval/baseline            # writes runs/eval/baseline/viewer.html
    write_viewer(items, "viewer.html")           # from EvalItems
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eviback.types import Trajectory

if TYPE_CHECKING:
    from eviback.evaluate import EvalItem


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
    return _PAGE.replace("__TITLE__", html.escape(title)).replace("__DATA__", data)


def write_viewer(items: Iterable[EvalItem], path: str | os.PathLike, title: str = "Trajectories") -> Path:
    """Write the viewer page of evaluation items to `path`."""
    records = [_trajectory_record(i.benchmark, i.trajectory, i.scores.em, i.scores.f1, i.stats.valid_answer)
               for i in items]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render_viewer(records, title), encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_trajectory_viewer(trajectories: Iterable[Trajectory], path: str | os.PathLike,
                            title: str = "Trajectories", benchmark: str = "") -> Path:
    """Write the viewer page of raw trajectories (e.g. a training step's groups)."""
    from eviback.metrics import score_answer

    records = []
    for t in trajectories:
        s = score_answer(t.answer, t.question.golden_answers)
        records.append(_trajectory_record(benchmark or t.question.dataset, t, s.em, s.f1, t.answer is not None))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_viewer(records, title), encoding="utf-8")
    return path


_PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body{font:14px/1.45 system-ui,sans-serif;margin:0;background:#f6f6f4;color:#222}
header{position:sticky;top:0;background:#fff;border-bottom:1px solid #ddd;padding:8px 16px;z-index:2}
h1{font-size:17px;margin:0 0 6px}
.filters{display:flex;gap:10px;flex-wrap:wrap;align-items:center}
.filters select,.filters input{font:inherit;padding:2px 4px}
#count{color:#666}
main{padding:12px 16px;max-width:1100px}
.item{background:#fff;border:1px solid #ddd;border-radius:6px;margin:0 0 12px;padding:10px 12px}
.item.ok{border-left:5px solid #3a3}.item.bad{border-left:5px solid #c44}
.meta{color:#555;font-size:12px}
.q{font-weight:600;margin:4px 0}
.tag{display:inline-block;border-radius:3px;padding:0 5px;font-size:12px;margin-right:4px;background:#eee}
.tag.answered{background:#dfd}.tag.forced{background:#fdd}.tag.length{background:#fec}
.turn{border-top:1px dashed #ccc;margin-top:8px;padding-top:6px}
.model{white-space:pre-wrap;background:#f3f7ff;border-radius:4px;padding:6px;font-family:ui-monospace,monospace;font-size:12.5px}
.obs{white-space:pre-wrap;background:#fff6e6;border-radius:4px;padding:6px;font-family:ui-monospace,monospace;font-size:12.5px;margin-top:4px}
.act{font-size:12.5px;margin:4px 0}
.act b{color:#124}
.passage{background:#fffbea;border:1px solid #eee2b8;border-radius:4px;padding:4px 6px;margin:3px 0;font-size:12.5px}
.passage .t{font-weight:600}
details summary{cursor:pointer;color:#345;font-size:12.5px}
.more{margin:8px 0}
</style></head><body>
<header><h1>__TITLE__</h1>
<div class="filters">
 <label>benchmark <select id="f-bench"><option value="">all</option></select></label>
 <label>result <select id="f-em"><option value="">all</option><option value="1">correct (EM)</option><option value="0">wrong</option></select></label>
 <label>stop <select id="f-stop"><option value="">all</option><option>answered</option><option>forced</option><option>length</option></select></label>
 <label>searches <select id="f-search"><option value="">any</option><option value="0">none</option><option value="1">at least one</option><option value="2">two or more</option></select></label>
 <label>text <input id="f-text" placeholder="question, answer, query..." size="28"></label>
 <span id="count"></span>
</div></header>
<main id="list"></main>
<script id="data" type="application/json">__DATA__</script>
<script>
const DATA = JSON.parse(document.getElementById('data').textContent);
const PAGE = 100;
let shown = PAGE;
const el = (tag, cls, text) => { const e = document.createElement(tag); if (cls) e.className = cls; if (text !== undefined) e.textContent = text; return e; };
const benches = [...new Set(DATA.map(r => r.benchmark))];
for (const b of benches) { const o = el('option', '', b); o.value = b; document.getElementById('f-bench').appendChild(o); }
function searches(r) { return r.turns.filter(t => t.executed).length; }
function matches(r) {
  const b = document.getElementById('f-bench').value, em = document.getElementById('f-em').value;
  const st = document.getElementById('f-stop').value, se = document.getElementById('f-search').value;
  const tx = document.getElementById('f-text').value.toLowerCase();
  if (b && r.benchmark !== b) return false;
  if (em !== '' && String(r.em ? 1 : 0) !== em) return false;
  if (st && r.stop !== st) return false;
  if (se !== '' && (se === '0' ? searches(r) !== 0 : searches(r) < Number(se))) return false;
  if (tx) {
    const hay = [r.id, r.question, r.answer || '', r.gold.join(' '), ...r.turns.map(t => t.text + ' ' + t.content)].join(' ').toLowerCase();
    if (!hay.includes(tx)) return false;
  }
  return true;
}
function renderItem(r) {
  const box = el('div', 'item ' + (r.em ? 'ok' : 'bad'));
  const meta = el('div', 'meta', `${r.benchmark} · ${r.id}` + (r.sample ? ` · sample ${r.sample}` : ''));
  box.appendChild(meta);
  box.appendChild(el('div', 'q', r.question));
  const line = el('div');
  line.appendChild(el('span', 'tag ' + r.stop, r.stop));
  line.appendChild(el('span', 'tag', `EM ${r.em} · F1 ${r.f1}`));
  line.appendChild(el('span', 'tag', `${searches(r)} search(es)`));
  if (!r.valid) line.appendChild(el('span', 'tag', 'no valid answer'));
  box.appendChild(line);
  const ans = el('div', 'act');
  ans.appendChild(el('b', '', 'answer: ')); ans.appendChild(document.createTextNode(r.answer === null ? '(none)' : r.answer));
  ans.appendChild(el('b', '', '   gold: ')); ans.appendChild(document.createTextNode(r.gold.join(' | ')));
  box.appendChild(ans);
  r.turns.forEach((t, i) => {
    const turn = el('div', 'turn');
    turn.appendChild(el('div', 'meta', `turn ${i + 1}`));
    turn.appendChild(el('div', 'model', t.text));
    const act = el('div', 'act');
    act.appendChild(el('b', '', t.action + (t.action === 'search' && !t.executed ? ' (not executed: final turn)' : '') + ': '));
    act.appendChild(document.createTextNode(t.content));
    turn.appendChild(act);
    if (t.passages.length) {
      const d = el('details'); d.open = true;
      d.appendChild(el('summary', '', `${t.passages.length} passage(s) retrieved`));
      for (const p of t.passages) {
        const pe = el('div', 'passage');
        pe.appendChild(el('span', 't', p.title + ' ')); pe.appendChild(el('span', 'meta', `[${p.id}${p.score !== null ? ', ' + Number(p.score).toFixed(2) : ''}] `));
        pe.appendChild(document.createTextNode(p.text));
        d.appendChild(pe);
      }
      turn.appendChild(d);
    }
    if (t.observation) turn.appendChild(el('div', 'obs', t.observation));
    box.appendChild(turn);
  });
  return box;
}
function render() {
  const list = document.getElementById('list');
  list.replaceChildren();
  const rows = DATA.filter(matches);
  const correct = rows.filter(r => r.em).length;
  document.getElementById('count').textContent = `${rows.length} of ${DATA.length} shown · EM ${(rows.length ? correct / rows.length : 0).toFixed(3)}`;
  for (const r of rows.slice(0, shown)) list.appendChild(renderItem(r));
  if (rows.length > shown) {
    const b = el('button', 'more', `show ${Math.min(PAGE, rows.length - shown)} more`);
    b.onclick = () => { shown += PAGE; render(); };
    list.appendChild(b);
  }
}
for (const id of ['f-bench', 'f-em', 'f-stop', 'f-search']) document.getElementById(id).onchange = () => { shown = PAGE; render(); };
document.getElementById('f-text').oninput = () => { shown = PAGE; render(); };
render();
</script></body></html>
"""
