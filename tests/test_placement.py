"""Every loader outside the policy honours the `device` setting: the evidence judge (inference and training),
the local teacher, the APE controller, the dense encoders and the warm start are put where their placement
says and recorded there, and the tensors they give their model follow the model.

On the CPU "inputs follow the model" is checked by moving the model to the `meta` device and catching its
forward pass: a tensor made on the CPU (instead of on the model's device) is seen there. The tests marked
for a GPU run the same loaders on `cuda` where there is one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from eviback import device as devices
from eviback import dtype as dtypes

META = torch.device("meta")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(devices.ENV_VAR, raising=False)
    devices.reset()
    yield
    devices.reset()


class Reached(Exception):
    """Raised by a probe once it has seen what it checks."""


def recorded(what: str) -> list[dict]:
    return [r for r in devices.placements() if r["what"] == what]


def tensor_devices(args, kwargs) -> set[torch.device]:
    return {v.device for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)}


# --------------------------------------------------------------------------------------------------
# Tiny models (random weights, real tokenizers)


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    """A one-layer Llama with SmolLM2's tokenizer and chat template, saved as a checkpoint directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eviback.policy import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m", "float32")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-lm")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_judge(tmp_path_factory):
    """A one-layer BERT with a 3-way head and all-MiniLM-L6-v2's tokenizer: a judge directory, and a base
    model for the judge builder."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from eviback.train.judge_builder import base_model_dir

    tokenizer = AutoTokenizer.from_pretrained(base_model_dir())
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=128, num_labels=3)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-judge")
    BertForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def local_request(fields, max_tokens: int = 3, temperature: float = 0.0):
    from eviback.teacher.policy import Decoding, Input, StageSpec
    from eviback.teacher.workflow import BlindView, build_blind_request

    stage = StageSpec(name="A", sees=(Input.QUESTION,), system_prompt="", user_template="Question: $question\nReply.",
                      outputs=fields, decoding=Decoding(temperature=temperature, max_tokens=max_tokens, seed=1))
    return build_blind_request(stage, BlindView(question="Who wrote Hamlet?", evidence=(), answer=None))


# --------------------------------------------------------------------------------------------------
# The local teacher


def test_local_teacher_is_placed_and_recorded(tiny_lm):
    from eviback.teacher.local import LocalBackendConfig, LocalClient
    from eviback.teacher.policy import OutputField

    client = LocalClient(LocalBackendConfig(model=str(tiny_lm), dtype="float32", threads=1, device="cpu"))
    assert recorded("local teacher") == [{"what": "local teacher", "device": "cpu", "placement": "cpu"}]
    assert client.model.device.type == "cpu" and client.backend_id.endswith(":float32")  # no device in the id
    reply = client.complete(local_request((OutputField.STATUS, OutputField.ANSWER)))
    assert '"status"' in reply.text and reply.completion_tokens > 0


def test_local_teacher_device_is_validated():
    from eviback.teacher.local import LocalBackendConfig

    with pytest.raises(ValueError, match="local teacher device must be auto, cpu, cuda or cuda:N"):
        LocalBackendConfig(device="gpu")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_local_teacher_inputs_follow_the_model(tiny_lm, monkeypatch, temperature):
    """Every forward pass of a reply (the prompt, the labels scored, the free text decoded) gets ids on the
    model's device: the model is on `meta` and answers with zero logits."""
    from transformers import LlamaForCausalLM
    from transformers.cache_utils import DynamicCache
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from eviback.teacher.local import LocalBackendConfig, LocalClient
    from eviback.teacher.policy import OutputField

    client = LocalClient(LocalBackendConfig(model=str(tiny_lm), dtype="float32", threads=1, device="cpu"))
    vocab = client.model.config.vocab_size
    client.model.to(META)
    seen: list[set[torch.device]] = []

    def probe(self, *args, **kwargs):
        seen.append(tensor_devices(args, {k: v for k, v in kwargs.items() if k != "past_key_values"}))
        ids = args[0] if args else kwargs["input_ids"]
        return CausalLMOutputWithPast(logits=torch.zeros(1, ids.shape[1], vocab), past_key_values=DynamicCache())

    monkeypatch.setattr(LlamaForCausalLM, "forward", probe)
    client.complete(local_request((OutputField.STATUS, OutputField.ANSWER), temperature=temperature))
    assert len(seen) >= 3 and all(s == {META} for s in seen), seen


# --------------------------------------------------------------------------------------------------
# The APE controller


def test_ape_controller_is_placed_and_its_prompt_follows_the_model(tiny_lm, monkeypatch):
    from eviback.ape.config import ControllerConfig
    from eviback.ape.controller import ChatController, ControllerSettings, LocalChatClient
    from eviback.teacher.chat import ChatMessage

    with pytest.raises(ValueError, match="controller device"):
        ControllerConfig(device="tpu")
    client = LocalChatClient(str(tiny_lm), "float32", device="cpu")
    assert recorded("APE controller") == [{"what": "APE controller", "device": "cpu", "placement": "cpu"}]
    request = ChatController(client, ControllerSettings(max_tokens=4)).request((ChatMessage("user", "Hello"),), 0)
    assert client.complete(request).completion_tokens > 0  # generates on the CPU

    client.model.to(META)
    seen = []

    def generate(ids, **kwargs):
        seen.append({ids.device, kwargs["attention_mask"].device})
        return torch.zeros(1, ids.shape[1] + 2, dtype=torch.long)

    monkeypatch.setattr(client.model, "generate", generate)
    client.complete(request)
    assert seen == [{META}]


# --------------------------------------------------------------------------------------------------
# The evidence judge: inference


PAIRS = [("who wrote hamlet", "Doc 1(Title: Hamlet) Hamlet is a tragedy by William Shakespeare."),
         ("who wrote hamlet", "Doc 1(Title: Paris) Paris is the capital of France.")]


def test_evidence_judge_is_placed_recorded_and_opened_once_per_device(tiny_judge, monkeypatch):
    from eviback.teacher import evidence_judge
    from eviback.teacher.evidence_judge import EvidenceJudgeClient, model_sha256, open_classifier, register

    client = EvidenceJudgeClient(tiny_judge, dtype="float32", device="cpu")
    assert recorded("evidence judge") == [{"what": "evidence judge", "device": "cpu", "placement": "cpu"}]
    assert len(client.classify(PAIRS)) == 2
    # a policy's classifier stage: loaded once per process and device
    monkeypatch.setattr(evidence_judge, "_LOADED", {})
    monkeypatch.setattr(evidence_judge, "_DIRECTORIES", {})
    sha = model_sha256(tiny_judge)
    register(tiny_judge, sha)
    opened = open_classifier(evidence_judge.CLASSIFIER_PREFIX + sha, "cpu")
    assert opened.placement.device == "cpu" and open_classifier(evidence_judge.CLASSIFIER_PREFIX + sha, "cpu") is opened


def test_evidence_judge_inputs_follow_the_model(tiny_judge, monkeypatch):
    from transformers import BertForSequenceClassification
    from transformers.modeling_outputs import SequenceClassifierOutput

    from eviback.teacher.evidence_judge import EvidenceJudgeClient

    client = EvidenceJudgeClient(tiny_judge, dtype="float32", device="cpu")
    client.model.to(META)
    seen = []

    def probe(self, *args, **kwargs):
        seen.append(tensor_devices(args, kwargs))
        return SequenceClassifierOutput(logits=torch.zeros(kwargs["input_ids"].shape[0], 3))

    monkeypatch.setattr(BertForSequenceClassification, "forward", probe)
    assert len(client.probabilities(PAIRS)) == 2
    assert seen == [{META}]


# --------------------------------------------------------------------------------------------------
# The evidence judge: training


def judge_examples():
    from eviback.train.judge_builder import JudgeExample
    from eviback.types import Status

    texts = ["Doc 1(Title: Hamlet) Hamlet is a tragedy by William Shakespeare.",
             "Doc 1(Title: Globe) The Globe Theatre staged plays in London.",
             "Doc 1(Title: Paris) Paris is the capital of France."]
    return [JudgeExample(f"q{i}", "who wrote hamlet", text, label, "search")
            for i in range(2) for text, label in zip(texts, (Status.SUFFICIENT, Status.AMBIGUOUS, Status.INSUFFICIENT),
                                                     strict=True)]


def judge_config(tiny_judge, **changes):
    from eviback.train.judge_builder import EvidenceJudgeConfig

    # the fine-tuned judge (the cross-encoder): the one whose training runs on the device
    return dataclasses.replace(EvidenceJudgeConfig(base_model=str(tiny_judge), epochs=1, batch_size=3, max_length=32,
                                                   dtype="float32", threads=1, device="cpu",
                                                   architecture="cross-encoder"), **changes)


def test_judge_training_is_placed_and_recorded(tiny_judge, tmp_path):
    from eviback.train.judge_builder import train_classifier

    stats = train_classifier(judge_examples(), judge_config(tiny_judge), tmp_path / "judge", progress=lambda m: None)
    assert stats["device"] == "cpu" and stats["dtype"] == "float32" and stats["steps"] == 2
    assert recorded("evidence judge (training)") == [
        {"what": "evidence judge (training)", "device": "cpu", "placement": "cpu"}]


def test_judge_training_inputs_follow_the_model(tiny_judge, tmp_path, monkeypatch):
    from transformers import BertForSequenceClassification

    from eviback.train.judge_builder import train_classifier

    meta = devices.Placement("meta", dtypes.choose("float32", "cpu"), "cpu", "a test's stand-in for a GPU")
    monkeypatch.setattr(devices, "place", lambda device, dtype="auto": meta)
    seen = []

    def probe(self, *args, **kwargs):
        seen.append((tensor_devices(args, kwargs), next(self.parameters()).device))
        raise Reached

    monkeypatch.setattr(BertForSequenceClassification, "forward", probe)
    with pytest.raises(Reached):
        train_classifier(judge_examples(), judge_config(tiny_judge), tmp_path / "judge", progress=lambda m: None)
    assert seen == [({META}, META)]
    assert recorded("evidence judge (training)")[0]["device"] == "meta"


def test_judge_cache_key_does_not_depend_on_the_device(tiny_judge):
    from eviback.train.judge_builder import EvidenceJudgeConfig, build_key

    examples = judge_examples()
    keys = {build_key(judge_config(tiny_judge, device=device), examples) for device in ("auto", "cpu", "cuda", "cuda:1")}
    assert len(keys) == 1
    assert build_key(judge_config(tiny_judge, seed=1), examples) not in keys  # the key still sees the recipe
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
        EvidenceJudgeConfig(device="gpu0")


# --------------------------------------------------------------------------------------------------
# The dense encoders (retrieval)


def test_dense_encoder_is_placed_and_not_in_the_index_parameters():
    pytest.importorskip("sentence_transformers")
    from eviback.retrieval.config import DenseConfig
    from eviback.retrieval.dense import load_encoder

    model = load_encoder(DenseConfig(device="cpu"))
    assert recorded("dense encoder") == [{"what": "dense encoder", "device": "cpu", "placement": "cpu"}]
    assert model.device.type == "cpu" and next(model.parameters()).dtype is torch.float32
    assert DenseConfig(device="cpu").index_params() == DenseConfig(device="cuda:3").index_params()
    assert "device" not in DenseConfig().index_params()
    with pytest.raises(ValueError, match="device must be"):
        DenseConfig(device="gpu")


def test_e5_query_encoder_is_placed_and_its_tokens_follow_the_model(tiny_judge, monkeypatch):
    from transformers import BertModel

    from eviback.retrieval.encoder import E5QueryEncoder

    encoder = E5QueryEncoder(tiny_judge, device="cpu")
    assert recorded("dense encoder") == [{"what": "dense encoder", "device": "cpu", "placement": "cpu"}]
    vectors = encoder.encode(["who wrote hamlet", "capital of france"])
    assert vectors.shape == (2, 16) and vectors.dtype.name == "float32"

    encoder._model.to(META)
    seen = []

    def probe(self, *args, **kwargs):
        seen.append(tensor_devices(args, kwargs))
        raise Reached

    monkeypatch.setattr(BertModel, "forward", probe)
    with pytest.raises(Reached):
        encoder.encode(["who wrote hamlet"])
    assert seen == [{META}]


def test_serve_device_makes_auto_mean_the_device_asked_for(monkeypatch):
    """`eviback serve --device cpu`: the index loaders place their encoder by `auto`, made to mean cpu."""
    import os

    from eviback.commands import serve

    def stop(*args, **kwargs):
        raise Reached

    monkeypatch.setenv(devices.ENV_VAR, "auto")  # restored after the test: the command sets it
    monkeypatch.setattr(serve, "load_suite", stop)
    args = serve.argparse.Namespace(device="cpu", index=None, suite=None, kind="bm25")
    with pytest.raises(Reached):
        serve.run(args)
    assert os.environ[devices.ENV_VAR] == "cpu" and devices.place("auto", "float32").device == "cpu"


# --------------------------------------------------------------------------------------------------
# The warm start


def test_warm_start_key_does_not_depend_on_the_device():
    from eviback.train import sft

    configs = [sft.WarmStartConfig(device=device) for device in ("auto", "cpu", "cuda", "cuda:1")]
    assert all("device" not in c.key_fields() for c in configs)
    assert len({sft.cache_key(c, "base", []) for c in configs}) == 1
    with pytest.raises(ValueError, match="device must be"):
        sft.WarmStartConfig(device="gpu")


def warm_start_examples():
    from eviback.train import warmstart_data as wsd
    from eviback.types import Question, StopReason, Trajectory

    question = Question("t1", "who wrote hamlet", ("William Shakespeare",))
    return [wsd.WarmStartExample(Trajectory(question, (), "William Shakespeare", StopReason.ANSWERED),
                                 wsd.ExampleKind.SINGLE)]


def test_warm_start_trainer_runs_on_the_cpu_when_placed_there(tiny_lm, tmp_path, monkeypatch):
    import trl

    from eviback.policy import load_tokenizer
    from eviback.train import sft

    built = {}

    class Trainer:
        def __init__(self, model, args, **kwargs):
            built.update(use_cpu=args.use_cpu, args_device=args.device, model_device=model.device)
            raise Reached

    monkeypatch.setattr(trl, "SFTTrainer", Trainer)
    config = sft.WarmStartConfig(model=str(tiny_lm), dtype="bfloat16", device="cpu", progress=False)
    with pytest.raises(Reached):
        sft.finetune(warm_start_examples(), load_tokenizer(str(tiny_lm)), str(tiny_lm), tmp_path, config)
    assert built == {"use_cpu": True, "args_device": torch.device("cpu"), "model_device": torch.device("cpu")}
    assert recorded("warm start") == [{"what": "warm start", "device": "cpu", "placement": "cpu"}]


def test_trainer_arguments_are_pinned_to_the_placements_gpu(tmp_path, monkeypatch):
    """In one process transformers takes cuda:0 and every visible GPU; a placement on cuda:1 pins both."""
    from trl import SFTConfig

    from eviback.device import pin_trainer as pin_trainer_device

    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    current = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    pin_trainer_device(args, devices.Placement("cpu", dtypes.choose("float32", "cpu")))
    assert args.device == torch.device("cpu") and current == []  # the CPU: nothing to pin
    pin_trainer_device(args, devices.Placement("cuda:1", dtypes.choose("float32", "cuda")))
    assert (args.device, args.n_gpu, current) == (torch.device("cuda:1"), 1, [torch.device("cuda:1")])


# --------------------------------------------------------------------------------------------------
# On a GPU (skipped without one)


@needs_gpu
def test_on_a_gpu_every_loader_lands_there(tiny_lm, tiny_judge, tmp_path):
    from eviback.ape.controller import LocalChatClient
    from eviback.retrieval.encoder import E5QueryEncoder
    from eviback.teacher.evidence_judge import EvidenceJudgeClient
    from eviback.teacher.local import LocalBackendConfig, LocalClient
    from eviback.teacher.policy import OutputField
    from eviback.train.judge_builder import train_classifier

    teacher = LocalClient(LocalBackendConfig(model=str(tiny_lm), device="cuda"))
    for temperature in (0.0, 1.0):  # sampling draws on the CPU from the GPU's logits
        assert '"status"' in teacher.complete(local_request((OutputField.STATUS, OutputField.ANSWER),
                                                            temperature=temperature)).text
    controller = LocalChatClient(str(tiny_lm), device="cuda")
    from eviback.ape.controller import ChatController, ControllerSettings
    from eviback.teacher.chat import ChatMessage

    request = ChatController(controller, ControllerSettings(max_tokens=4)).request((ChatMessage("user", "Hi"),), 0)
    assert controller.complete(request).completion_tokens > 0
    judge = EvidenceJudgeClient(tiny_judge, device="cuda")
    assert len(judge.classify(PAIRS)) == 2
    stats = train_classifier(judge_examples(), judge_config(tiny_judge, device="cuda", dtype="auto"),
                             tmp_path / "judge", progress=lambda m: None)
    assert stats["device"].startswith("cuda")
    encoder = E5QueryEncoder(tiny_judge, device="cuda")
    assert encoder.encode(["who wrote hamlet"]).shape == (1, 16)
    where = {r["what"]: r["device"] for r in devices.placements()}
    assert all(where[w].startswith("cuda") for w in ("local teacher", "APE controller", "evidence judge",
                                                     "evidence judge (training)", "dense encoder")), where
    assert devices.off_device() == []


@needs_gpu
def test_on_a_gpu_the_warm_start_trains_there(tiny_lm, tmp_path):
    from eviback.policy import load_tokenizer
    from eviback.train import sft

    for dtype in ("float32", "bfloat16"):
        config = sft.WarmStartConfig(model=str(tiny_lm), dtype=dtype, device="cuda", progress=False, max_grad_norm=1.0)
        stats = sft.finetune(warm_start_examples(), load_tokenizer(str(tiny_lm)), str(tiny_lm), tmp_path / dtype,
                             config)
        assert stats.optimizer_steps == 1 and (tmp_path / dtype / "config.json").exists()
    assert {r["device"] for r in recorded("warm start")} == {"cuda:0"}
