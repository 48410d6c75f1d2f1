"""LoRA training through PEFT: its settings, the adapter TRL trains, and the weights the engines load.

    eviback train --preset eviback --set lora_rank=16 --output runs/lora      # docs/training.md, "LoRA"

With `lora_rank` > 0 the policy's own weights stay frozen and TRL trains a low-rank adapter beside them (GRPOTrainer's
`peft_config`: PEFT puts `lora_A` (r x in) and `lora_B` (out x r) beside each target linear layer, in place, and
wraps the model in a `PeftModel`). What each part of a run does with it:

- The optimiser holds the adapter alone (:func:`adapter_parameters`), built once TRL has wrapped the model.
- Precision: the frozen base is loaded in the run's dtype (bf16 where the run computes in bf16) and PEFT keeps the
  adapter in fp32 (`autocast_adapter_dtype`), so AdamW updates fp32 weights directly: the adapter is its own
  master copy. Full training's fp32 masters (:mod:`eviback.train.precision`) are not needed, and a bf16 base is
  exact for what it is: it never changes.
- The reference of the KL term is the same model with its adapters disabled (TRL 1.16 builds no second copy when
  the model is a PeftModel): the starting policy, at no memory cost.
- The generation engines load merged weights, `W + scale * B @ A` per target layer, under the base model's names
  (:class:`MergedWeights`), computed one layer at a time as the push reads them. PEFT's
  `merge_adapter`/`unmerge_adapter` around the push would cost the same `B @ A` per layer but write the trained
  model twice: on a bf16 base `(W + dW) - dW` is not `W`, so every push would move the frozen weights a little.
  Computing the merged tensor apart never touches the trained model, and holds one layer's tensor at a time on a
  streamed push (vLLM in process; the HF engine and the policy server take the whole set at once).
- Checkpoints hold the adapter (transformers' Trainer saves a PeftModel's adapter and loads it back on resume) and
  its optimiser state: megabytes, not the model. The final model (:func:`save_final`) is the adapter in
  `final/adapter/`, and with `lora_save_merged` (the default) the merged model in fp32 in `final/` itself, so
  that `eviback eval --model RUN/final` and `eviback serve-policy` read it as any other run's.

torch and PEFT are imported by the functions that use them: the settings are read by `eviback train` before any of
that loads.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eviback.settings import check_fields

if TYPE_CHECKING:
    import torch
    from peft import LoraConfig

    from eviback.disk import RunFootprint

ALL_LINEAR = "all-linear"  # PEFT's name for every linear layer of the model but its output layer
ADAPTER_DIR = "adapter"  # the final adapter, inside the run's final model directory
# Module names LoRA may not go on here, with why.
REFUSED_TARGETS = {
    "lm_head": "TRL scores tokens with the LM head's weight directly, so an adapter there would never train",
    "embed_tokens": "an embedding's adapter is not a linear layer's W + B A, which eviback merges for its engines",
}
ADAPTER_NAME = "default"  # the adapter TRL's peft_config makes and trains


@dataclass(frozen=True)
class LoraSettings:
    """LoRA of a training run (`lora_rank` > 0): the adapter TRL trains instead of the whole model."""

    rank: int = field(default=0, metadata={"help": "LoRA rank r: train a rank-r adapter beside each target layer "
                      "instead of every weight (0: off, full training). 16-64 is usual for 7B models; the adapter "
                      "has r x (in + out) parameters per layer"})
    alpha: float = field(default=0.0, metadata={"help": "LoRA alpha: the adapter's update is scaled by alpha / r "
                         "(0: twice the rank, a scale of 2)"})
    dropout: float = field(default=0.0, metadata={"help": "dropout on the adapter's input while training; 0 keeps "
                           "the trainer's log-probabilities those of the policy the engine samples"})
    target_modules: list[str] = field(default_factory=lambda: [ALL_LINEAR], metadata={"help": "the layers that "
                                      "get an adapter, by module name (q_proj, k_proj, v_proj, o_proj, gate_proj, "
                                      "up_proj, down_proj in Llama/Qwen models), or all-linear: every linear "
                                      "layer of the decoder (never the LM head)"})
    save_merged: bool = field(default=True, metadata={"help": "save the final model merged (W + scale x B A, in "
                              "fp32) in RUN/final, where `eviback eval` reads it, beside the adapter in "
                              "RUN/final/adapter; false: the adapter alone"})

    def __post_init__(self) -> None:
        check_fields(self)
        # The messages name the settings as they are set (`lora_rank`, ...: config.SECTION_SETTINGS).
        if self.rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0: full training, no adapter), got {self.rank}")
        if not math.isfinite(self.alpha) or self.alpha < 0:
            raise ValueError(f"lora_alpha must be a number >= 0 (0: twice lora_rank), got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1) (0: none, what RL usually runs), got {self.dropout}")
        targets = self.target_modules
        if not targets or any(not t.strip() for t in targets):
            raise ValueError(f"lora_target_modules must name at least one module (e.g. [q_proj, v_proj]) or be "
                             f"[{ALL_LINEAR}], got {targets!r}")
        if ALL_LINEAR in targets and len(targets) > 1:
            raise ValueError(f"lora_target_modules: {ALL_LINEAR} already covers every linear layer; give it alone "
                             f"or list the modules instead, got {targets!r}")
        for target in targets:
            why = REFUSED_TARGETS.get(target.rsplit(".", 1)[-1])
            if why:
                raise ValueError(f"lora_target_modules may not name {target}: {why}; remove it (e.g. "
                                 f"lora_target_modules=[{ALL_LINEAR}])")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def lora_alpha(self) -> float:
        """alpha as PEFT takes it (the setting, or twice the rank when 0)."""
        return self.alpha or 2.0 * self.rank

    def peft_config(self) -> LoraConfig:
        """PEFT's LoraConfig of these settings (GRPOTrainer's `peft_config`). Raises ValueError when LoRA is off."""
        from peft import LoraConfig

        if not self.enabled:
            raise ValueError("LoRA is off (lora_rank=0): there is no adapter to configure")
        targets = ALL_LINEAR if self.target_modules == [ALL_LINEAR] else list(self.target_modules)
        return LoraConfig(r=self.rank, lora_alpha=self.lora_alpha, lora_dropout=self.dropout, target_modules=targets,
                          bias="none", task_type="CAUSAL_LM")

    def describe(self) -> str:
        return (f"LoRA rank {self.rank}, alpha {self.lora_alpha:g} (scale {self.lora_alpha / self.rank:g}), dropout "
                f"{self.dropout:g}, on {', '.join(self.target_modules)}")


# --------------------------------------------------------------------------------------------------
# The adapter on a model


def causal_lm(model: Any) -> Any:
    """The transformers model of a PeftModel (its LoRA layers in place: its decoder computes with the adapters,
    or without them inside PEFT's `disable_adapter()`), or `model` itself."""
    if "peft" not in sys.modules:  # no adapter can exist: a full run needs no PEFT installed
        return model
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


def lora_layers(model: Any) -> dict[str, Any]:
    """The LoRA layers of `model` (a PeftModel or the model inside it) by module name, names as in the base
    model (`model.layers.0.self_attn.q_proj`). Empty for a model without adapters. Raises ValueError for an
    adapter that is not on a linear layer (the merge below is a linear layer's)."""
    if "peft" not in sys.modules:
        return {}
    from peft.tuners.lora import Linear, LoraLayer

    layers = {}
    for name, module in causal_lm(model).named_modules():
        if isinstance(module, LoraLayer):
            if not isinstance(module, Linear) or any(module.use_dora.get(a, False) for a in module.active_adapters):
                raise ValueError(f"LoRA on {name} ({type(module).__name__}) is not a plain linear layer's adapter, "
                                 "which is all eviback merges for its engines: set lora_target_modules to linear "
                                 f"layers (e.g. [{ALL_LINEAR}])")
            layers[name] = module
    return layers


def adapters_enabled(model: Any) -> bool:
    """Whether `model` computes as the policy being trained: True without LoRA layers, or when they compute with
    their adapter; False inside PEFT's `disable_adapter()` (what TRL's reference pass runs under LoRA)."""
    if "peft" not in sys.modules:
        return True
    from peft.tuners.tuners_utils import BaseTunerLayer

    return not any(m.disable_adapters for m in causal_lm(model).modules() if isinstance(m, BaseTunerLayer))


def adapter_parameters(model: Any) -> list[torch.nn.Parameter]:
    """The parameters an optimiser of a LoRA run holds: the trainable ones, which must all be the adapter's
    (TRL's peft_config freezes the rest). Raises ValueError when there are none, or when a base weight is
    trainable."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters: LoRA's adapter was not put on it")
    stray = [name for name, _ in trainable if ".lora_" not in name]
    if stray:
        raise ValueError(f"a LoRA run trains the adapter alone, but {stray[:3]} are trainable too")
    return [p for _, p in trainable]


def delta_weight(layer: Any) -> torch.Tensor | None:
    """scale x B @ A of `layer`'s active adapters, shaped like its base weight (out, in), in the adapter's dtype;
    None when the adapters add nothing to the weight (disabled, or already merged into it)."""
    if layer.disable_adapters or layer.merged:
        return None
    deltas = [layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A]
    if not deltas:
        return None
    return deltas[0] if len(deltas) == 1 else sum(deltas[1:], deltas[0])


class MergedWeights:
    """A model's weights as the generation engines load them: with LoRA layers, each target layer's merged
    `W + scale x B @ A` under the base model's name (`...q_proj.weight`, not `...q_proj.base_layer.weight`) and
    none of the adapter's own tensors; every other parameter as it is. The trained model is never modified.

    `named_parameters()` gives the (name, tensor) pairs, so an instance goes wherever a model's parameters are
    pushed (:func:`eviback.generation.base.push_weights`). Each merged tensor is computed when the iteration
    reaches it, in the base weight's dtype and on its device (one layer-sized tensor at a time, for a consumer
    that streams them)."""

    def __init__(self, model: Any) -> None:
        self.model = causal_lm(model)
        self.layers = lora_layers(self.model)

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        import torch

        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                owner, _, leaf = name.rpartition(".")
                layer_name, _, part = owner.rpartition(".")
                if part == "base_layer" and layer_name in self.layers:  # a target layer's own weight or bias
                    delta = delta_weight(self.layers[layer_name]) if leaf == "weight" else None
                    tensor = parameter.detach()
                    if delta is not None:
                        tensor = (tensor.to(delta.dtype) + delta).to(parameter.dtype)
                    yield f"{layer_name}.{leaf}", tensor
                elif not self._in_adapter(name):
                    yield name, parameter.detach()

    def _in_adapter(self, name: str) -> bool:
        """Whether `name` is one of a LoRA layer's own tensors (lora_A, lora_B, ...)."""
        parts = name.split(".")
        return any(".".join(parts[:i]) in self.layers for i in range(1, len(parts)))


def engine_weights(model: Any) -> Any:
    """What to push into a generation engine for `model`: the model itself, or its :class:`MergedWeights`
    when it carries LoRA layers. Either has `named_parameters()` giving names the base model's checkpoint uses."""
    return MergedWeights(model) if lora_layers(model) else model


# --------------------------------------------------------------------------------------------------
# Sizes before anything is loaded, and the final model


def adapter_parameter_count(model_path: str, settings: LoraSettings) -> int:
    """The number of parameters of `settings`' adapter on the model at `model_path` (its config.json): the
    model is built on the meta device and the adapter put on it, so nothing is allocated or loaded. Raises
    ValueError, naming the model's linear layers, when a target module is not one of them (checked before a run
    does any work)."""
    import torch
    from peft import inject_adapter_in_model
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    try:
        inject_adapter_in_model(settings.peft_config(), model)
    except ValueError as e:  # PEFT's NoMatchingPeftModuleError: a target the model does not have
        layers = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                         if isinstance(module, torch.nn.Linear)} - set(REFUSED_TARGETS))
        raise ValueError(f"lora_target_modules={list(settings.target_modules)} does not fit {model_path}: {e} Its "
                         f"linear layers: {', '.join(layers)} (or {ALL_LINEAR})") from None
    return sum(p.numel() for name, p in model.named_parameters() if ".lora_" in name)


def trainer_resident_bytes(parameters: int, adapter: int, *, base_bytes: int) -> int:
    """What a LoRA trainer keeps on its device while the engine generates: the frozen base (`base_bytes` a
    parameter: 2 in bf16), and the fp32 adapter with AdamW's two fp32 moments (12 bytes a parameter of the
    adapter). No reference model: it is the base with the adapters disabled. The update adds the adapter's fp32
    gradients (4 bytes) and the activations."""
    return base_bytes * parameters + (4 + 8) * adapter


def run_footprint(parameters: int, adapter: int, *, merged: bool, steps_left: int, save_steps: int,
                  save_total_limit: int) -> RunFootprint:
    """What a LoRA run writes (:class:`eviback.disk.RunFootprint`): checkpoints of the fp32 adapter and its AdamW
    moments (12 bytes an adapter parameter); the final adapter, and with `merged` the merged model in fp32."""
    from eviback.disk import RunFootprint

    footprint = RunFootprint.planned(adapter, masters=False, steps_left=steps_left, save_steps=save_steps,
                                     save_total_limit=save_total_limit)
    return dataclasses.replace(footprint, final=4 * adapter + (4 * parameters if merged else 0))


def save_final(model: Any, out: Path, *, base_path: str, merged: bool) -> None:
    """The final model of a LoRA run: the adapter of `model` (TRL's PeftModel) in `out/adapter` (PEFT's own
    files, loadable with `peft.PeftModel.from_pretrained` on the base at `base_path`), and with `merged` the
    merged model in `out` itself: the base's stored weights (read again from `base_path` in fp32, not the
    trainer's bf16 copy) plus each layer's fp32 scale x B @ A, saved in fp32 as a full run's final model is."""
    import torch
    from transformers import AutoModelForCausalLM

    model.save_pretrained(out / ADAPTER_DIR)
    if not merged:
        return
    final = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    with torch.no_grad():
        for name, layer in lora_layers(model).items():
            delta = delta_weight(layer)
            if delta is not None:
                final.get_submodule(name).weight.add_(delta.to(device="cpu", dtype=torch.float32))
    final.save_pretrained(out)
