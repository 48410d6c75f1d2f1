"""The log of the command line and of the processes it starts (training workers, experiment runs): its format,
and the third-party lines it leaves out.

A user should be able to tell which lines matter. The log holds eviback's own lines
(`HH:MM:SS LEVEL eviback.<module>: ...`, and what a command prints), its progress bars, and the warnings of
third-party code that are *not* known to be harmless. The ones known to be harmless here are listed in
:data:`KNOWN_NOISE`, each with where it comes from and why it does not matter, and each is silenced where it
is emitted and nowhere else:

- a log record by a filter on the logger that emits it, matching its message (never a library's whole logger);
- a Python warning by a filter on its category and message, for the duration of the call that emits it
  (:func:`quiet`), never for the whole process;
- a line a C++ extension writes to the process's stderr by capturing that file descriptor for the duration of
  the one call that writes it (:func:`quiet_stderr`), and writing back every other line.

`-v` (:func:`configure_logging` at DEBUG) turns all of it off: every line of every library is shown.
:func:`foreign_lines` is the other side: the lines of a log that are neither eviback's nor a progress bar
(what a test of a clean log looks for); :func:`log_lines` the log lines that went to stdout, where a command
writes its results only, and :func:`foreign_records` the third-party records of a command run in process.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATEFMT = "%H:%M:%S"

_verbose = False  # set by configure_logging: -v shows every third-party line
# vLLM's level as the user set it, read when eviback is imported before TRL: TRL's import sets ERROR where
# nobody had set one, and that ERROR is not the user's choice (configure_logging)
_USERS_VLLM_LEVEL = None if "trl" in sys.modules else os.environ.get("VLLM_LOGGING_LEVEL")


@dataclass(frozen=True)
class Noise:
    """A third-party message known to be harmless here: who emits it, how to recognise it, why it is harmless.

    Exactly one of `logger` (a log record of that logger), `category` (a Python warning) or `stderr` (a line a
    C++ extension writes to the process's stderr) says what it is; `pattern` is searched in its message, and
    `check`, when given, must hold too. A log record with `per_call` False is dropped wherever it is emitted
    (by :func:`configure_logging`: it says the same harmless thing whenever it comes); every other noise only
    inside :func:`quiet` or :func:`quiet_stderr`, around the one call known to emit it harmlessly."""

    pattern: str
    why: str
    logger: str | None = None
    category: type[Warning] | None = None
    stderr: bool = False
    per_call: bool = True
    check: Callable[[str], bool] | None = None

    def matches(self, message: str) -> bool:
        return re.search(self.pattern, message) is not None and (self.check is None or self.check(message))


def _only_new_classifier_keys(report: str) -> bool:
    """A transformers load report whose every listed key is the new classification head, MISSING from the
    checkpoint (an encoder loaded to be fine-tuned as a classifier): no other key missing, unexpected or
    mismatched."""
    rows = [[cell.strip() for cell in line.split("|")] for line in report.splitlines() if "|" in line]
    keys = [(row[0], row[1]) for row in rows if len(row) >= 2 and row[0] not in ("Key", "") and set(row[0]) != {"-"}]
    return bool(keys) and all(key.startswith("classifier.") and status == "MISSING" for key, status in keys)


KNOWN_NOISE: dict[str, Noise] = {
    # vLLM, on a CPU
    "vllm-triton": Noise(
        logger="vllm.triton_utils.importing", pattern=r"^Triton (is installed|not installed)", per_call=False,
        why="vLLM says at import that Triton cannot run on this device; the CPU engine does not use it"),
    "vllm-deepselect": Noise(
        logger="vllm.model_executor.layers.indexer_topk", per_call=False,
        pattern=r"^Failed to import the DeepSelect extension",
        why="vLLM's CPU build has no DeepSelect kernel (a GPU top-k for sparse-attention indexers), and says so "
            "at import; the models eviback runs do not use it"),
    "vllm-reduce-op": Noise(
        category=FutureWarning, pattern=r"`torch\.distributed\.reduce_op` is deprecated",
        why="vLLM's start scans every loaded module's attributes and touches torch's deprecated alias; eviback "
            "never uses it"),
    "vllm-numa": Noise(
        stderr=True, pattern=r"NUMA binding: Using \w+ policy for memory allocation",
        why="vLLM's CPU worker binds its memory to the NUMA node of its cores, as it should, and says so from C++"),
    "vllm-global-seed": Noise(
        logger="vllm.engine.arg_utils", per_call=False,
        pattern=r"^The global random seed is set to \d+\. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to False",
        why="an engine in this process (eviback's default executor) seeds the process's random generators as it "
            "starts, and vLLM says so at every start whatever the seed; eviback's rollouts sample from a stream "
            "of their own (generation.base.SamplerRNG), and a trainer seeds the generators again after the "
            "engine has started (TrainingArguments.seed)"),
    "vllm-cpu-triton": Noise(
        logger="vllm.platforms.cpu", per_call=False,
        pattern=r"^Triton is not installed\. triton-cpu is expected on x86 CPUs",
        why="vLLM's CPU build does not install triton-cpu and runs without it (its C++ kernels, the V1 model "
            "runner), as every CPU figure of eviback was measured; it says so at every engine start"),
    "vllm-ld-preload": Noise(
        logger="vllm.v1.worker.cpu_worker", per_call=False,
        pattern=r"^(libtcmalloc|libiomp) is not found in LD_PRELOAD",
        why="vLLM's CPU worker advises preloading tcmalloc and Intel's OpenMP for speed at every engine start; a "
            "preload has to be in the environment before the process starts, which a command cannot do for "
            "itself, and every CPU figure of eviback was measured without it"),
    "vllm-reload-rotary": Noise(
        logger="vllm.model_executor.model_loader.reload.layerwise", per_call=False,
        pattern=r"^\w*RotaryEmbedding: Failed to load weights$",
        why="vLLM's weight reload (a weight push after each optimiser step) expects the rotary embedding's "
            "cos/sin table among the weights, which no checkpoint holds (it is computed from the model's config), "
            "and keeps the table it has, which is the right one"),
    "vllm-reload-tied-head": Noise(
        logger="vllm.model_executor.model_loader.reload.layerwise",
        pattern=r"^ParallelLMHead: Failed to load weights$",
        why="a model whose output head is tied to its input embeddings (SmolLM2, Qwen3-0.6B) has no head weights "
            "of its own to push: the head is the embeddings' tensor, which the push loads (measured: after a "
            "push the engine's head equals the pushed embeddings). Silenced around the push of such a model "
            "only: an untied head that loaded nothing keeps stale weights, and must say so"),
    # transformers
    "bpe-cleanup": Noise(
        logger="transformers.tokenization_utils_tokenizers", per_call=False,
        pattern=r"^Ignoring clean_up_tokenization_spaces=True for BPE tokenizer",
        why="SmolLM2's converted tokenizer asks for a WordPiece clean-up that transformers skips for a BPE "
            "tokenizer, which is what eviback wants: the decoded text is the same either way"),
    "new-classifier-head": Noise(
        logger="transformers.modeling_utils", pattern=r"LOAD REPORT", check=_only_new_classifier_keys,
        why="the evidence judge's build starts a new classification head on the encoder: the head is MISSING "
            "from the encoder's checkpoint because it is what the build trains (silenced around that load only: "
            "a trained judge that lacks its head must still say so)"),
    "trainer-process-group": Noise(
        logger="transformers.training_args", per_call=False,
        pattern=r"^torch\.distributed process group is initialized, but parallel_mode != ParallelMode\.DISTRIBUTED",
        why="vLLM's in-process engine opens a process group of one; the trainer of that one process needs no DDP"),
    # matplotlib (a run's plots)
    "matplotlib-font-cache": Noise(
        logger="matplotlib.font_manager", per_call=False, pattern=r"^generated new fontManager$",
        why="matplotlib builds its font cache the first time it is imported on a machine (a training run's "
            "plots), and says so at INFO once"),
    # httpx (the retrieval client, the policy server's backend)
    "httpx-request": Noise(
        logger="httpx", per_call=False, pattern=r"^HTTP Request: ",
        why="httpx logs every request it makes at INFO, thousands a run against a retrieval service or a policy "
            "server; a failed request is logged by eviback with its error"),
    # TRL
    "trl-rollout-func": Noise(
        category=UserWarning, pattern=r"You are using 'rollout_func', which is an experimental feature",
        why="eviback drives TRL's GRPO through rollout_func on purpose, with TRL pinned to the version it is "
            "tested with"),
}

# The progress bars eviback draws (tqdm descriptions); the trainers' step bars have none.
OWN_PROGRESS = ("", "eval", "building warm-start examples", "embed passages", "read training sample", "add vectors",
                "read corpus")


def configure_logging(level: int) -> None:
    """The command line's log format (also used by the child processes it starts), on stderr, vLLM's lines
    included (stdout is a command's results). Below DEBUG (`-v`), the known third-party noise is silenced at
    its loggers, and libraries that set their own logger below the command's level (bm25s sets DEBUG) are held
    to it; at DEBUG nothing is silenced."""
    global _verbose
    logging.basicConfig(level=level, format=FORMAT, datefmt=DATEFMT)
    _verbose = level <= logging.DEBUG
    for noise in KNOWN_NOISE.values():
        if noise.logger is not None and not noise.per_call:
            _install(logging.getLogger(noise.logger), _NoiseFilter(noise))
    _install(logging.getLogger("bm25s"), _LevelFloor())
    # vLLM's own log handler: on stderr, in the log with every other line (it writes to stdout by default, where
    # a command's results go: `eviback eval`'s table, what a user redirects to a file), at WARNING like every
    # other library (DEBUG with -v): TRL, once imported, sets it to ERROR where nobody has, which hid every
    # vLLM warning of a training run, unknown ones too. vLLM reads both when an engine starts, in this process
    # or one it starts; a value the user set wins.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    vllm_level = os.environ.get("VLLM_LOGGING_LEVEL")
    if vllm_level is None or (vllm_level == "ERROR" and "trl" in sys.modules and _USERS_VLLM_LEVEL != "ERROR"):
        vllm_level = os.environ["VLLM_LOGGING_LEVEL"] = "DEBUG" if _verbose else "WARNING"
        if "vllm.logger" in sys.modules:  # vLLM configured its logger when imported: hold it to the level now
            vllm_logger = logging.getLogger("vllm")
            vllm_logger.setLevel(vllm_level)
            for handler in vllm_logger.handlers:
                handler.setLevel(vllm_level)
    if not _verbose and "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ:
        # transformers' and huggingface_hub's own bars (loading weights, writing shards, converting a GGUF
        # file): steps inside a load that eviback logs itself. A value the user set wins. Both read the variable
        # when imported; where one already is (a program that imported it first), it is told directly.
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        if "transformers.utils.logging" in sys.modules:
            sys.modules["transformers.utils.logging"].disable_progress_bar()  # huggingface_hub's too
        elif "huggingface_hub.utils" in sys.modules:
            sys.modules["huggingface_hub.utils"].disable_progress_bars()


def verbose() -> bool:
    """Whether the command runs with `-v`: every third-party line is shown."""
    return _verbose


def _install(logger: logging.Logger, new: logging.Filter) -> None:
    """Add `new` to `logger` once (configure_logging may run more than once in a process)."""
    if not any(type(f) is type(new) and getattr(f, "key", None) == getattr(new, "key", None) for f in logger.filters):
        logger.addFilter(new)


class _NoiseFilter(logging.Filter):
    """Drops a known noise record of its logger (unless -v)."""

    def __init__(self, noise: Noise) -> None:
        super().__init__()
        self.noise = noise
        self.key = noise.pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return _verbose or not self.noise.matches(record.getMessage())


class _LevelFloor(logging.Filter):
    """Drops records below the root logger's level, for a library that lowers its own logger's level."""

    key = "level-floor"

    def filter(self, record: logging.LogRecord) -> bool:
        return _verbose or record.levelno >= logging.getLogger().level


@contextlib.contextmanager
def quiet(*names: str) -> Iterator[None]:
    """Silence the Python warnings and log records of :data:`KNOWN_NOISE` named by `names` for the duration of
    the block (the call that emits them); every other warning and record still shows. With `-v`, nothing is
    silenced."""
    noises = [KNOWN_NOISE[name] for name in names]
    if any(n.stderr for n in noises):
        raise ValueError(f"{names}: lines written to stderr by C++ code are silenced by quiet_stderr")
    if _verbose:
        yield
        return
    filters = [(logging.getLogger(n.logger), _NoiseFilter(n)) for n in noises if n.logger is not None]
    with warnings.catch_warnings():
        for noise in noises:
            if noise.category is not None:
                warnings.filterwarnings("ignore", message=".*" + noise.pattern, category=noise.category)
        for logger, new in filters:
            logger.addFilter(new)
        try:
            yield
        finally:
            for logger, new in filters:
                logger.removeFilter(new)


@contextlib.contextmanager
def quiet_stderr(*names: str) -> Iterator[None]:
    """Capture what is written to file descriptor 2 (C++ code writes there directly) for the duration of the
    block, then write back every line that is not a known noise line of :data:`KNOWN_NOISE` named by `names`.
    Lines are written back however the block ends. With `-v`, nothing is captured."""
    noises = [KNOWN_NOISE[name] for name in names]
    if _verbose or not all(n.stderr for n in noises):
        if not all(n.stderr for n in noises):
            raise ValueError(f"not all of {names} are stderr lines")
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode("utf-8", "replace")
            kept = [line for line in text.splitlines(keepends=True)
                    if not any(n.matches(line) for n in noises)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


@contextlib.contextmanager
def without_bars(module: ModuleType) -> Iterator[None]:
    """Hide the tqdm bars that `module` (a third-party module that imported `tqdm` by name) draws, for the
    duration of the block: a step inside a call that eviback logs itself (a GGUF file's conversion). With
    `-v`, the bars show."""
    original = getattr(module, "tqdm", None)
    if _verbose or original is None:
        yield
        return
    module.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        module.tqdm = original


def call_quietly(function: Callable, names: Sequence[str]) -> Callable:
    """`function` wrapped so that each call runs inside :func:`quiet_stderr` of `names`."""
    def wrapper(*args: object, **kwargs: object) -> object:
        with quiet_stderr(*names):
            return function(*args, **kwargs)

    return wrapper


# --------------------------------------------------------------------------------------------------
# Reading a log: which lines are not eviback's


OWN_LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) eviback(\.[\w.]+)?: ")
OWN_PRINTED_LINE = re.compile(r"^eviback( [\w-]+)?: ")  # `eviback demo: ...`, `eviback train: error: ...`
PROGRESS_BAR = re.compile(r"^(?P<desc>.*?):?\s*\d+%\|[^|]*\|\s*\d+/\d+")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def foreign_lines(log: str, own_progress: Sequence[str] = OWN_PROGRESS) -> list[str]:
    """The lines of `log` (a command's stderr) that are neither eviback's log lines, lines its commands print
    (`eviback NAME: ...`), nor its progress bars (descriptions in `own_progress`): third-party lines. Progress
    bars redrawn with carriage returns count line by line; a line that continues a log line (indented) belongs
    to the line it continues."""
    foreign: list[str] = []
    previous_own = False
    for raw in re.split(r"\r\n|\r|\n", _ANSI.sub("", log)):
        line = raw.rstrip()
        if not line.strip():
            continue
        if line[0].isspace() and not PROGRESS_BAR.search(line):
            if not previous_own:
                foreign.append(line)
            continue
        bar = PROGRESS_BAR.match(line)
        own = bool(OWN_LOG_LINE.match(line) or OWN_PRINTED_LINE.match(line)
                   or (bar and bar.group("desc").strip() in own_progress))
        if not own:
            foreign.append(line)
        previous_own = own
    return foreign


LOG_RECORD = re.compile(r"\b(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b|\w*Warning: ")


def log_lines(output: str) -> list[str]:
    """The lines of `output` (a command's stdout) that look like a log record or a warning of any library,
    eviback's included: a level name in capitals, or a Python warning (`FutureWarning: ...`). A command's
    stdout holds its results (a table, paths, a summary); its log goes to stderr, where :func:`foreign_lines`
    reads it."""
    return [line.rstrip() for line in _ANSI.sub("", output).splitlines() if LOG_RECORD.search(line)]


def foreign_records(records: Iterable[logging.LogRecord]) -> list[str]:
    """`LEVEL logger: message` of each of `records` logged outside eviback: for a command run in the caller's
    process (a test's `main([...])`), whose log records a capture takes before any handler writes them, what
    :func:`foreign_lines` finds in a command's stderr. A known noise record dropped at its logger never
    reaches a capture."""
    return [f"{r.levelname} {r.name}: {r.getMessage()}" for r in records
            if r.name != "eviback" and not r.name.startswith("eviback.")]
