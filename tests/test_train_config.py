"""Training configuration (presets, files, overrides) and the run directory's resume rules."""

import json

import pytest
import yaml

from eviback.backoff import Mode
from eviback.train.config import TrainConfig, describe_fields, parse_override, preset_names, resolve_config
from eviback.train.run import RunDir


def test_presets_exist_and_resolve():
    assert {"eviback", "grpo", "dapo", "eviback-single-prompt", "demo"} <= set(preset_names())
    assert resolve_config("grpo").backoff.mode is Mode.GRPO
    assert resolve_config("dapo").backoff.mode is Mode.DAPO
    f1 = resolve_config("f1-fallback")
    assert f1.backoff.mode is Mode.F1_FALLBACK and f1.backoff.lam == 0.1
    single = resolve_config("eviback-single-prompt")
    assert single.teacher.policy == "single-prompt-dual-task" and single.backoff.lam == 0.1


def test_file_then_overrides_win(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lam: 0.5\ngroup_size: 3\n")
    config = resolve_config("eviback", path, ["lam=1", "eval-benchmarks=[nq, popqa]"])
    assert config.backoff.lam == 1 and config.rollout.group_size == 3 and config.eval_benchmarks == ["nq", "popqa"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["nonsense=1"], "unknown setting 'nonsense'"),
        (["mode=ppo"], r"setting 'mode' takes one of grpo, dapo, eviback, f1-fallback \(Mode\), got 'ppo'"),
        (["group_size=1"], "group_size must be >= 2"),
        (["teacher_backend=http"], "needs teacher_url"),
        (["lam"], "is not key=value"),
        (["group_size=5", "questions_per_step=4", "micro_batch_rows=3"], "must divide .* = 20"),
    ],
)
def test_bad_settings_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        resolve_config(None, None, overrides)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="presets: .*grpo"):
        resolve_config("nope")


def test_help_describes_every_field():
    text = describe_fields()
    assert "lam" in text and "after normalisation" in text


def test_run_dir_refuses_silent_reuse_and_changed_config(tmp_path):
    run = RunDir(tmp_path / "run")
    assert run.start(TrainConfig(), resume=False) is None
    with pytest.raises(FileExistsError, match="--resume"):
        run.start(TrainConfig(), resume=False)
    with pytest.raises(ValueError, match="lam: 0.1 -> 0.5") as refused:
        run.start(TrainConfig.from_settings(lam=0.5), resume=True)
    # the message names the overrides that continue the run as it ran, and they do
    hint = str(refused.value).split("as it ran: ")[1]
    assert hint == "--set lam=0.1"
    key, value = parse_override(hint.removeprefix("--set "))
    assert run.start(TrainConfig.from_settings(**{key: value}), resume=True) is None
    # a setting the earlier run's file does not name is compared with what ran then, and named so
    saved = run.config_path.read_text()
    config = yaml.safe_load(saved)
    del config["teacher_stage_b"]
    run.config_path.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError) as refused:
        run.start(TrainConfig(), resume=True)
    hint = str(refused.value).split("as it ran: ")[1]
    assert parse_override(hint.removeprefix("--set ")) == ("teacher_stage_b", "prompted")
    run.config_path.write_text(saved)
    # extending a run is allowed
    assert run.start(TrainConfig.from_settings(max_steps=50), resume=True) is None
    assert yaml.safe_load(run.config_path.read_text())["max_steps"] == 50


def test_resume_drops_log_records_after_the_last_checkpoint(tmp_path):
    run = RunDir(tmp_path / "run")
    run.start(TrainConfig(), resume=False)
    for step in (1, 2, 3):
        run.log_metrics({"step": step, "loss": step})
        run.log_groups([{"step": step, "question_id": "q"}])
    with open(run.metrics_path, "a") as f:
        f.write('{"step": 4, "lo')  # a line torn by SIGKILL
    (run.checkpoints / "checkpoint-2").mkdir(parents=True)
    (run.checkpoints / "checkpoint-2" / "trainer_state.json").write_text("{}")
    (run.checkpoints / "checkpoint-3").mkdir()  # incomplete: no trainer_state.json
    assert run.start(TrainConfig(), resume=True) == 2
    assert [r["step"] for r in run.read_metrics()] == [1, 2]
    assert [r["step"] for r in run.read_groups()] == [1, 2]
    assert all(json.loads(line) for line in run.metrics_path.read_text().splitlines())


def test_report_draws_curves_from_metrics(tmp_path):
    from eviback.train.plots import write_report

    runs = []
    for name, em in (("grpo", 0.1), ("eviback", 0.2)):
        run = RunDir(tmp_path / name)
        run.start(TrainConfig(), resume=False)
        for step in (1, 2, 3):
            run.log_metrics({"step": step, "rollout/em": em * step, "backoff/all_zero_share": 0.8,
                             "time/rollout": 3.0, "train/loss": 0.1})
        runs.append(run.root)
    single = write_report(runs[:1], runs[0])
    assert (runs[0] / "plots" / "training_curves.png").stat().st_size > 1000
    text = single.read_text()
    assert "data:image/png;base64," in text and "<td>0.200</td>" in text  # mean EM of steps 0.1, 0.2, 0.3
    both = write_report(runs, tmp_path / "cmp")
    assert (tmp_path / "cmp" / "plots" / "comparison.png").exists() and "eviback" in both.read_text()


def test_a_run_directory_is_trained_by_one_process_at_a_time(tmp_path):
    """A second `eviback train` on a directory being trained is refused (it would truncate the first one's
    logs on --resume); the lock is re-entrant in its process and goes with the process, SIGKILL included."""
    import subprocess
    import sys

    root = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom eviback.train.run import RunDir\nfrom eviback.train.config "
         f"import TrainConfig\nRunDir({str(root)!r}).start(TrainConfig(), resume=False)\nprint('locked', "
         "flush=True)\ntime.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RuntimeError, match=f"is being trained by pid {holder.pid}"):
            RunDir(root).start(TrainConfig(), resume=True)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    run = RunDir(root)
    try:
        assert run.start(TrainConfig(), resume=True) is None  # the killed holder's lock went with it
        assert RunDir(root).start(TrainConfig(), resume=True) is None  # re-entrant within this process
    finally:
        run.unlock()


# ---------------------------------------------------------------- one copy of each setting


# Every setting `eviback train` has taken by name (docs/training.md, presets, experiment files): each still
# takes it, and each lives in exactly one field of the nested config.
SETTING_NAMES = {
    "model", "warm_start", "warm_start_examples", "data", "train_files", "retriever", "backend", "policy_url",
    "policy_timeout_s", "group_size",
    "questions_per_step", "temperature", "top_p", "max_turns", "max_turn_tokens", "max_obs_tokens", "topk", "mode",
    "lam", "adv_eps", "teacher", "teacher_backend", "teacher_model", "teacher_url", "teacher_concurrency",
    "allow_leaky_teacher", "learning_rate", "max_grad_norm", "is_correction", "is_cap", "is_level", "beta",
    "lr_scheduler_type", "warmup_ratio",
    "loss_type", "max_steps", "save_steps", "save_total_limit", "micro_batch_rows", "gradient_checkpointing", "dtype",
    "seed", "build_seed", "report_to", "eval_benchmarks", "eval_limit", "eval_warm_start", "keep_rollout_steps",
    "teacher_stage_a", "judge_max_questions", "judge_epochs", "judge_rollouts", "teacher_stage_b", "teacher_span_words",
    "device", "judge_base_model", "accept_weak_judge", "retrieval_deadline_s", "judge_architecture",
    "gpu_memory_utilization", "vllm_sleep_level", "vllm_executor", "chat_template", "chat_template_kwargs",
    "val_every", "val_benchmarks", "val_limit",
    "lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_save_merged",
}


def test_each_setting_has_one_field_and_keeps_its_name():
    import dataclasses

    from eviback.train.config import SECTION_SETTINGS, SECTIONS, setting_types

    assert set(setting_types()) == SETTING_NAMES == set(TrainConfig().to_dict())
    places = list(SECTION_SETTINGS.values())
    assert len(places) == len(set(places))  # no two names for one field
    own = {f.name for f in dataclasses.fields(TrainConfig)} - set(SECTIONS)
    assert not own & set(SECTION_SETTINGS)  # no setting both in a section and at the top
    for section, cls in SECTIONS.items():  # a section's field is a setting, or deliberately none
        unset = {f.name for f in dataclasses.fields(cls)} - {f for s, f in places if s == section}
        assert unset <= {"max_context_tokens", "logprobs", "hit_threshold"}, (section, unset)
    values = {"group_size": 3, "lam": 0.5, "adv_eps": 1e-4, "teacher_url": "http://x/v1", "mode": "grpo",
              "max_obs_tokens": 300, "allow_leaky_teacher": True, "max_steps": 7}
    config = TrainConfig.from_settings(values)
    assert {k: config.to_dict()[k] for k in values} == values
    assert TrainConfig.from_settings(config.to_dict()) == config
    assert config.with_settings(lam=0.2).backoff.lam == 0.2 and config.with_settings(lam=0.2).rollout.group_size == 3


def test_a_setting_given_once_reaches_every_place_it_is_used(tmp_path):
    """group_size, the sampling settings and the rollout lengths are set once and read by the engine, TRL's
    arguments and the held-out evaluation; the engine's group size was a second copy that the trainer
    overrode."""
    from eviback.train.runner import (
        Precision,
        engine_rollout_config,
        held_out_eval_config,
        trl_arguments,
    )

    config = TrainConfig.from_settings(group_size=3, questions_per_step=2, temperature=0.7, top_p=0.9,
                                       max_turns=1, max_turn_tokens=100, max_obs_tokens=300, topk=4,
                                       teacher_concurrency=3, eval_benchmarks=["nq"])
    rollout = config.rollout
    assert (rollout.group_size, rollout.temperature, rollout.top_p, rollout.topk) == (3, 0.7, 0.9, 4)
    assert rollout.max_context_tokens == 100 * 2 + 300 + 512 and rollout.logprobs

    assert engine_rollout_config(config, 100_000) == rollout  # the engine runs the run's own settings
    capped = engine_rollout_config(config, 800)
    assert capped.max_context_tokens == 800 and capped.group_size == 3

    args = trl_arguments(config, tmp_path, Precision.FLOAT32, cuda=False)
    assert args.num_generations == 3 and args.per_device_train_batch_size == 1
    assert args.gradient_accumulation_steps == 2 * 3
    assert (args.temperature, args.top_p, args.max_completion_length) == (0.7, 0.9, rollout.max_context_tokens)

    held_out = held_out_eval_config(config, tmp_path / "eval", "m")
    limits = held_out.rollout
    assert (limits.topk, limits.max_turns, limits.max_turn_tokens, limits.max_observation_tokens) == (4, 1, 100, 300)
    assert limits.temperature == 0.0 and limits.max_context_tokens == 4096  # greedy, evaluation's context cap
    assert config.teacher.teacher_config(config.dtype, config.device).judge.concurrency == 3


def test_a_rollout_section_not_built_from_settings_is_refused():
    from eviback.rollout import RolloutConfig

    with pytest.raises(ValueError, match="TrainConfig.from_settings"):
        TrainConfig(rollout={"group_size": 3})
    with pytest.raises(ValueError, match="bounds the context by its settings"):
        TrainConfig(rollout=RolloutConfig(group_size=3))


def test_gradient_checkpointing_defaults_on_for_large_models_on_a_gpu(tmp_path):
    from eviback.train.runner import Precision, gradient_checkpointing, trl_arguments

    assert gradient_checkpointing(None, accelerator=True, parameters=1_700_000_000)
    assert not gradient_checkpointing(None, accelerator=True, parameters=600_000_000)
    assert not gradient_checkpointing(None, accelerator=False, parameters=4_000_000_000)  # a CPU: the setting only
    assert not gradient_checkpointing(False, accelerator=True, parameters=4_000_000_000)
    assert gradient_checkpointing(True, accelerator=False, parameters=1)
    config = TrainConfig()
    assert config.gradient_checkpointing is None
    assert trl_arguments(config, tmp_path, Precision.FLOAT32, cuda=False, checkpointing=True).gradient_checkpointing
    assert not trl_arguments(config, tmp_path, Precision.FLOAT32, cuda=False).gradient_checkpointing


def test_device_setting_is_checked():
    assert TrainConfig.from_settings(device="cuda:1").device == "cuda:1"
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
        TrainConfig.from_settings(device="gpu")


def test_save_steps_zero_means_no_checkpoints(tmp_path):
    from eviback.train.runner import Precision, trl_arguments

    args = trl_arguments(TrainConfig.from_settings(save_steps=0), tmp_path, Precision.FLOAT32, cuda=False)
    assert args.save_strategy == "no"
    assert trl_arguments(TrainConfig(), tmp_path, Precision.FLOAT32, cuda=False).save_strategy == "steps"
    with pytest.raises(ValueError, match="save_steps must be"):
        TrainConfig.from_settings(save_steps=-1)
