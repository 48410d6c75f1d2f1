"""The log's filters: known third-party noise is silenced where it is emitted and only there, `-v` shows it,
and :func:`foreign_lines` tells eviback's own lines from everything else."""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from pathlib import Path

import pytest

from eviback import log_format
from eviback.log_format import (
    KNOWN_NOISE,
    OWN_PROGRESS,
    foreign_lines,
    foreign_records,
    log_lines,
    quiet,
    quiet_stderr,
)

SRC = Path(log_format.__file__).parent


# What configure_logging sets in the environment where the user has not: restored after each test, so that no
# later test, nor a command it starts, inherits a test's choice (-v's DEBUG for vLLM).
SET_BY_CONFIGURE = ("VLLM_LOGGING_STREAM", "VLLM_LOGGING_LEVEL", "HF_HUB_DISABLE_PROGRESS_BARS")


@pytest.fixture
def restored_environment(monkeypatch):
    for name in SET_BY_CONFIGURE:
        monkeypatch.delenv(name, raising=False)  # noted, and put back as it was after the test
    return monkeypatch


@pytest.fixture
def quiet_mode(restored_environment):
    """The command line's default level (INFO), then -v's (DEBUG) restored to whatever it was."""
    before = log_format._verbose
    log_format.configure_logging(logging.INFO)
    log_format._verbose = False
    yield
    log_format._verbose = before


def test_foreign_lines_keeps_eviback_lines_and_progress_bars():
    log = "\n".join([
        "15:24:41 INFO eviback.retrieval.index: built bm25 index of 6004 passages in /cache (1.1 s)",
        "15:24:41 WARNING eviback.train.judge_builder: the evidence judge x is weak",
        "  a continuation of the warning above",
        "eviback demo: warm start (cached after the first run), 4 EviBack GRPO steps",
        "building warm-start examples:  12%|█▏        | 80/650 [00:00<00:00, 793.54question/s]\r"
        "building warm-start examples: 100%|██████████| 650/650 [00:00<00:00, 681.67question/s]",
        " 25%|██▌       | 1/4 [00:47<02:22, 47.40s/it]15:40:36 INFO eviback.train.step_log: step 1/4",
        "eval: 100%|██████████| 90/90 [01:28<00:00,  1.02q/s]",
        "",
    ])
    assert foreign_lines(log) == [], foreign_lines(log)


def test_foreign_lines_finds_each_kind_of_third_party_line():
    """The lines of a `make demo` log before the log was cleaned (results/demo), one of each kind."""
    lines = [
        "./.venv/lib/python3.11/site-packages/vllm/triton_utils/dispatcher.py:138: FutureWarning: "
        "`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead",
        '  if hasattr(value, "__dict__"):',
        "15:24:38 WARNING vllm.triton_utils.importing: Triton is installed, but doesn't include CPU backend.",
        "15:24:40 DEBUG bm25s: Building index from IDs objects",
        "[W1202 15:33:00.027318566 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory allocation",
        "[transformers] Ignoring clean_up_tokenization_spaces=True for BPE tokenizer TokenizersBackend.",
        "(MainProcess pid=3976) WARNING 12-05 12:12:24 [cpu_worker.py:114] libtcmalloc is not found in LD_PRELOAD.",
        "classifier.weight | MISSING | ",
        "{'loss': '8.478e-08', 'grad_norm': '6.469e-05', 'learning_rate': '1e-06'}",
        "Writing model shards: 100%|██████████| 1/1 [00:01<00:00,  1.05s/it]\x1b[A",
    ]
    assert foreign_lines("\n".join(lines)) == [re.sub(r"\x1b\[A", "", line).rstrip() for line in lines]


def test_every_progress_bar_eviback_draws_is_known_to_the_filter():
    descriptions = {m.group(1) for path in SRC.rglob("*.py")
                    for m in re.finditer(r"tqdm\([^)]*desc=\"([^\"]+)\"", path.read_text(encoding="utf-8"))}
    assert descriptions and descriptions <= set(OWN_PROGRESS), descriptions - set(OWN_PROGRESS)


def test_a_known_warning_is_silenced_inside_the_call_only(quiet_mode):
    message = "You are using 'rollout_func', which is an experimental feature. This API may change"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet("trl-rollout-func"):
            warnings.warn(message, UserWarning, stacklevel=1)
            warnings.warn("another UserWarning", UserWarning, stacklevel=1)  # not known: shown
        warnings.warn(message, UserWarning, stacklevel=1)  # outside the call: shown
    assert [str(w.message) for w in seen] == ["another UserWarning", message]


def test_a_known_log_record_is_dropped_at_its_logger_and_only_there(quiet_mode, caplog):
    caplog.set_level(logging.INFO)
    tokenizer = logging.getLogger("transformers.tokenization_utils_tokenizers")
    tokenizer.warning("Ignoring clean_up_tokenization_spaces=True for BPE tokenizer TokenizersBackend. The ...")
    tokenizer.warning("a tokenizer warning nobody knows")
    logging.getLogger("bm25s").debug("Building index from IDs objects")  # bm25s lowers its own level to DEBUG
    assert [r.getMessage() for r in caplog.records] == ["a tokenizer warning nobody knows"]


# What vLLM 0.31's CPU engine logged at every start of `eviback eval` before they were known (`arg_utils`,
# `cpu.py`, `cpu_worker`); the others of that log (the SSM cache type, the model runner, `set_num_threads`) are
# no longer said: eviback passes what vLLM would pick.
VLLM_START = [
    ("vllm.engine.arg_utils", "The global random seed is set to 0. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to "
                              "False, this may affect the random state of the Python process that launched vLLM."),
    ("vllm.platforms.cpu", "Triton is not installed. triton-cpu is expected on x86 CPUs."),
    ("vllm.v1.worker.cpu_worker", "libtcmalloc is not found in LD_PRELOAD. For best performance, please follow the "
                                  "section `set LD_PRELOAD` in https://docs.vllm.ai/en/latest/getting_started/"
                                  "installation/cpu/ to setup required pre-loaded libraries."),
    ("vllm.v1.worker.cpu_worker", "libiomp is not found in LD_PRELOAD. For best performance, please follow ..."),
]


def test_a_vllm_engine_start_says_nothing_known_and_everything_else(quiet_mode, caplog):
    caplog.set_level(logging.INFO)
    for name, message in VLLM_START:
        logging.getLogger(name).warning(message)
    logging.getLogger("vllm.engine.arg_utils").warning("The global random seed is set to 7. Since "
                                                        "VLLM_ENABLE_V1_MULTIPROCESSING is set to False, ...")
    unknown = "Available memory on node 0 is less than desired CPU memory utilization"
    logging.getLogger("vllm.v1.worker.cpu_worker").warning(unknown)
    assert [r.getMessage() for r in caplog.records] == [unknown]


def test_a_weight_push_says_only_what_did_not_load(quiet_mode, caplog):
    """The rotary table is never among a checkpoint's weights; a tied head is silenced around the push of a
    model that ties it (VllmBackend.update_weights), and a layer that loaded nothing says so."""
    caplog.set_level(logging.INFO)
    reload = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    with quiet("vllm-reload-tied-head"):
        reload.warning("RotaryEmbedding: Failed to load weights")
        reload.warning("ParallelLMHead: Failed to load weights")
        reload.warning("QKVParallelLinear: Failed to load weights")  # a layer with weights of its own: shown
    reload.warning("Llama3RotaryEmbedding: Failed to load weights")
    reload.warning("ParallelLMHead: Failed to load weights")  # an untied head's push: shown
    assert [r.getMessage() for r in caplog.records] == ["QKVParallelLinear: Failed to load weights",
                                                        "ParallelLMHead: Failed to load weights"]


def test_vllms_own_lines_go_to_stderr_at_warning_unless_the_user_chose(quiet_mode, monkeypatch):
    for name in ("VLLM_LOGGING_STREAM", "VLLM_LOGGING_LEVEL"):
        monkeypatch.delenv(name, raising=False)  # quiet_mode set them
    log_format.configure_logging(logging.INFO)
    # stdout is a command's results; WARNING, not the ERROR that TRL's import would set
    assert os.environ["VLLM_LOGGING_STREAM"] == "ext://sys.stderr" and os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stdout")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    log_format.configure_logging(logging.INFO)
    assert os.environ["VLLM_LOGGING_STREAM"] == "ext://sys.stdout" and os.environ["VLLM_LOGGING_LEVEL"] == "INFO"


def test_a_process_that_imported_trl_vllm_and_transformers_first_gets_the_commands_levels(restored_environment):
    """`main([...])` in a process that imported the libraries before configure_logging ran (a test session, a
    user's script): TRL's import left vLLM at ERROR, which hid every vLLM warning, and transformers had read the
    environment for its progress bars already. configure_logging tells each directly."""
    import transformers.utils.logging as hf_logging
    import trl  # noqa: F401  (its import sets VLLM_LOGGING_LEVEL=ERROR where nobody has)
    import vllm.logger  # noqa: F401

    vllm_logger = logging.getLogger("vllm")
    restored_environment.setenv("VLLM_LOGGING_LEVEL", "ERROR")  # as TRL's import leaves it
    restored_environment.setattr(vllm_logger, "level", logging.ERROR)  # as vLLM configured itself from it
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    before = log_format._verbose
    try:
        log_format.configure_logging(logging.INFO)
        assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING" and vllm_logger.level == logging.WARNING
        assert not hf_logging.is_progress_bar_enabled() and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    finally:
        log_format._verbose = before
        (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()


def test_log_lines_finds_a_log_on_a_commands_stdout():
    results = ["| benchmark | n | EM | F1 |", "|---|---:|---:|---:|", "| nq | 4 | 0.000 | 0.000 |",
               "items: /runs/eval/items.jsonl", "## What happened (the top of the report)", "{", '  "total": 10']
    logged = ["(MainProcess pid=3976) WARNING 12-05 12:12:10 [arg_utils.py:1910] The global random seed is set",
              "12:12:10 INFO eviback.evaluate: 4 questions in 1 benchmarks",
              "/x/trl/trainer/grpo_trainer.py:12: UserWarning: You are using 'rollout_func'",
              "\x1b[33mERROR\x1b[0m something"]
    assert log_lines("\n".join(results + logged)) == [line.replace("\x1b[33m", "").replace("\x1b[0m", "")
                                                      for line in logged]


def test_foreign_records_are_the_records_of_other_loggers():
    records = [logging.LogRecord(name, logging.WARNING, __file__, 1, message, None, None)
               for name, message in [("eviback.train.runner", "ours"), ("eviback", "ours too"),
                                     ("evibackish", "not ours"), ("vllm.platforms.cpu", "theirs")]]
    assert foreign_records(records) == ["WARNING evibackish: not ours", "WARNING vllm.platforms.cpu: theirs"]


def test_the_new_classifier_head_report_is_dropped_around_the_build_only(quiet_mode, caplog):
    caplog.set_level(logging.INFO)
    loader = logging.getLogger("transformers.modeling_utils")
    head = ("BertForSequenceClassification LOAD REPORT from: model\nKey               | Status  | \n"
            "------------------+---------+-\nclassifier.bias   | MISSING | \nclassifier.weight | MISSING | \n")
    other = head.replace("classifier.bias  ", "bert.pooler.dense")
    with quiet("new-classifier-head"):
        loader.warning(head)
        loader.warning(other)  # a key of the encoder itself missing: a real problem, shown
    loader.warning(head)  # a trained judge without its head: shown
    assert [r.getMessage() for r in caplog.records] == [other, head]


def test_verbose_shows_everything(caplog, restored_environment):
    before = log_format._verbose
    log_format.configure_logging(logging.DEBUG)
    try:
        caplog.set_level(logging.DEBUG)
        logging.getLogger("transformers.tokenization_utils_tokenizers").warning(
            "Ignoring clean_up_tokenization_spaces=True for BPE tokenizer X")
        logging.getLogger("bm25s").debug("Building index from IDs objects")
        with warnings.catch_warnings(record=True) as seen, quiet("vllm-reduce-op"):
            warnings.simplefilter("always")
            warnings.warn("`torch.distributed.reduce_op` is deprecated", FutureWarning, stacklevel=1)
        assert len(caplog.records) == 2 and len(seen) == 1
    finally:
        log_format._verbose = before


def test_quiet_stderr_filters_what_c_code_writes_to_the_file_descriptor(quiet_mode, capfd):
    with quiet_stderr("vllm-numa"):
        os.write(2, b"[W1202 15:33:00.027318566 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for "
                    b"memory allocation on the NUMA nodes (0).\n")
        os.write(2, b"a line that is not known\n")
    print("after", file=sys.stderr)
    assert capfd.readouterr().err == "a line that is not known\nafter\n"


def test_every_known_noise_says_why_and_what_it_is():
    for name, noise in KNOWN_NOISE.items():
        assert noise.why and sum([noise.logger is not None, noise.category is not None, noise.stderr]) == 1, name
    with pytest.raises(ValueError, match="quiet_stderr"), quiet("vllm-numa"):
        pass
