"""eviback: search-agent RL with evidence-constrained teacher backoff (EviBack) and E2E-APE.

The package reads top-down as the method does:

- `types`: the records passed between modules; `protocol`: the Search-R1 text protocol; `data`: files;
- `retrieval`: BM25 / dense indexes, the `/retrieve` service and its client;
- `policy`, `generation`, `rollout`: the model, its generation engines, the multi-turn search agent;
- `metrics`, `evaluate`: answer metrics, trajectory statistics, benchmark evaluation;
- `teacher`: the two-stage evidence-constrained teacher; `backoff`: rewards and advantages (pure);
- `train`: warm-start SFT and GRPO on TRL; `ape`: E2E-APE, building the teacher policy automatically.
"""

__version__ = "0.1.0"
