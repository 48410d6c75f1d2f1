"""Render trajectories as a self-contained HTML page to read rollouts turn by turn.

  eviback report runs/eval/baseline                 an eval directory -> its viewer.html (and summary)
  eviback report runs/eval/baseline/items.jsonl -o page.html
  eviback report results/baseline_eval/items.jsonl.gz -o page.html
"""

from __future__ import annotations

import argparse
from pathlib import Path

from eviback.evaluate import ITEMS_FILE, VIEWER_FILE, read_items
from eviback.viewer import write_viewer

HELP = "render evaluation trajectories as an HTML page (turn by turn, with filters)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="an `eviback eval` output directory or its items.jsonl (.gz accepted)")
    parser.add_argument("-o", "--out", help="HTML file to write (default: viewer.html next to the items)")
    parser.add_argument("--title", help="page title")


def run(args: argparse.Namespace) -> int:
    path = Path(args.path)
    items_path = path / ITEMS_FILE if path.is_dir() else path
    if not items_path.exists():
        raise FileNotFoundError(f"{items_path} does not exist: pass an `eviback eval` output directory or its {ITEMS_FILE}")
    items = read_items(items_path)
    out = Path(args.out) if args.out else items_path.parent / VIEWER_FILE
    write_viewer(items, out, title=args.title or f"Trajectories: {items_path.parent.name}")
    print(f"{len(items)} trajectories -> {out}")
    return 0
