"""eviback: search-agent RL with evidence-constrained teacher backoff (EviBack) and E2E-APE.

The package reads top-down as the method does:

- `types`: the records passed between modules; `protocol`: the Search-R1 text protocol; `data`: files;
- `retrieval`: BM25 / dense indexes, the `/retrieve` service and its client;
- `policy`, `generation`, `rollout`: the model, its generation engines, the multi-turn search agent;
- `metrics`, `evaluate`: answer metrics, trajectory statistics, benchmark evaluation;
- `teacher`: the two-stage evidence-constrained teacher; `backoff`: rewards and advantages (pure);
- `train`: warm-start SFT and GRPO on TRL; `ape`: E2E-APE, building the teacher policy automatically.
"""

import os as _os

__version__ = "0.1.0"

# `datasets` (under TRL) imports JAX where it is installed, and JAX takes 75% of a GPU's memory the moment it
# starts. On a GPU machine with JAX, that left a 4B training step 33 GB of a 141 GB H200 and it ran out of
# memory (results/gpu.md); eviback never computes with JAX, so it allocates on demand (a user's setting wins).
_os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
