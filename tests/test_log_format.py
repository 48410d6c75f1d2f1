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
from eviback.log_format import KNOWN_NOISE, OWN_PROGRESS, foreign_lines, quiet, quiet_stderr

SRC = Path(log_format.__file__).parent


@pytest.fixture
def quiet_mode():
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


def test_verbose_shows_everything(caplog):
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
