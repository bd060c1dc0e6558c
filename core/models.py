"""Load a Llama-family causal LM (Llama, Mistral, Qwen2; SmolLM2 is Llama) for the engine.

>>> lm = load_model()  # doctest: +SKIP  (default model, pulled on first use)
>>> lm.spec.num_layers, lm.spec.num_kv_heads  # doctest: +SKIP
(30, 3)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from chunkcache.core.model_files import (
    ModelLoadError,
    fingerprint,
    is_default_copy,
    one_line,
    resolve_model_path,
    state_dict_digest,
    tokenizer_digest,
    weights_digest,
)
from chunkcache.kernels.kv import SeqKV
from chunkcache.kernels.rope import Rope

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# RoPE types whose frequencies change with the sequence length cannot move cached keys.
UNSUPPORTED_ROPE_TYPES = ("dynamic", "longrope")
# PyTorch's oneDNN (ideep) path keeps one compiled primitive per matmul shape in an LRU of
# LRU_CACHE_CAPACITY entries, 1024 by default. Prompt lengths and recompute row counts vary
# per request, so a server's memory grows until 1024 shapes are cached: measured here on
# bfloat16 SmolLM2, ~1.2 MiB per new prompt length, flat with a small cap, at no measurable
# cost per forward (a prefill uses under ten shapes, decode one more).
ONEDNN_SHAPE_CACHE_ENTRIES = "64"
# Files that hold a tokenizer's vocabulary, in the formats transformers reads.
_VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a model as the engine sees it."""

    architecture: str  # e.g. "LlamaForCausalLM"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    rope_parameters: Mapping[str, Any]  # transformers' standardised form, incl. rope_type
    sliding_window: int | None  # None: every layer attends to the whole sequence

    @property
    def context_window(self) -> int:
        """The most tokens a sequence may hold here: ``max_positions``, or the sliding window
        when the model has one (this engine's attention is full, so past the window it would
        no longer compute what the model does)."""
        if self.sliding_window is None:
            return self.max_positions
        return min(self.max_positions, self.sliding_window)

    @classmethod
    def from_config(cls, config: Any, architecture: str | None) -> ModelSpec:
        """The spec of ``config``; ``architecture`` names the model class in errors (a GGUF's
        config has none)."""
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(unsupported_message(config.model_type, architecture))
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        return cls(
            architecture=architecture or config.model_type,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            max_positions=config.max_position_embeddings,
            rope_parameters=dict(config.rope_parameters),
            sliding_window=_sliding_window(config),
        )


def unsupported_message(model_type: str, architecture: str | None) -> str:
    """Why a checkpoint of ``model_type`` (its model class ``architecture``, if known) is
    refused, naming the types that run."""
    named = f"model_type {model_type!r}"
    return (
        f"{f'{architecture} ({named})' if architecture else named} is not supported; "
        f"chunkcache runs {', '.join(SUPPORTED_MODEL_TYPES)} checkpoints"
    )


def _sliding_window(config: Any) -> int | None:
    """The window transformers' attention applies for ``config``'s model type, None for none.

    Each type reads its own keys: Llama never slides (a ``sliding_window`` in its config
    is kept as an attribute and ignored), Mistral slides every layer by ``sliding_window``
    (any ``layer_types`` ignored), Qwen2 only the layers its ``layer_types`` mark.
    """
    if config.model_type == "llama":
        return None
    layer_types = getattr(config, "layer_types", None) or ()
    if config.model_type == "qwen2" and "sliding_attention" not in layer_types:
        return None  # e.g. use_sliding_window=False
    return getattr(config, "sliding_window", None)


def rope_from_config(config: Any, head_dim: int, device: torch.device | str = "cpu") -> Rope:
    """The model's RoPE, using transformers' init functions for scaled variants (e.g. llama3)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type in UNSUPPORTED_ROPE_TYPES or (
        rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS
    ):
        raise ModelLoadError(f"RoPE type {rope_type!r} is not supported")
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, device=device).float() / head_dim
        return Rope(1.0 / (params["rope_theta"] ** exponents))
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device)
    return Rope(inv_freq.float(), float(scaling))


@dataclass(frozen=True)
class LoadedModel:
    """A Hugging Face causal LM with what the engine needs to run it and to key its caches."""

    hf: Any  # the Hugging Face *ForCausalLM (nn.Module), eval mode, no gradients
    tokenizer: Any | None
    spec: ModelSpec
    rope: Rope  # on the model's device
    fingerprint: str  # architecture + weights + dtype + tokenizer

    @classmethod
    def from_hf(
        cls, hf: Any, tokenizer: Any | None = None, weights: str | None = None
    ) -> LoadedModel:
        """Wrap a model already in memory; ``weights`` defaults to a digest of its tensors."""
        bound_onednn_shape_cache()
        hf.eval().requires_grad_(False)
        spec = ModelSpec.from_config(hf.config, type(hf).__name__)
        rope = rope_from_config(hf.config, spec.head_dim, next(hf.parameters()).device)
        weights = weights or state_dict_digest(hf)
        return cls(hf, tokenizer, spec, rope, fingerprint(hf, weights, tokenizer_digest(tokenizer)))

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    @property
    def eos_ids(self) -> frozenset[int]:
        """Token ids that end the assistant's turn: generation config and tokenizer EOS."""
        configured = getattr(self.hf.generation_config, "eos_token_id", None)
        ids = list(configured) if isinstance(configured, list) else [configured]
        ids.append(getattr(self.tokenizer, "eos_token_id", None))
        return frozenset(i for i in ids if i is not None)

    @property
    def decoder(self) -> Any:
        """The decoder stack: ``embed_tokens``, ``layers``, ``norm``."""
        return self.hf.model

    @property
    def lm_head(self) -> Any:
        return self.hf.lm_head

    def new_kv(self, capacity: int) -> SeqKV:
        """An empty merged KV for one sequence of up to ``capacity`` tokens (it can grow)."""
        s = self.spec
        return SeqKV.empty(
            s.num_layers, s.num_kv_heads, s.head_dim, capacity, self.dtype, self.device
        )


def bound_onednn_shape_cache() -> None:
    """Cap oneDNN's per-shape primitive cache unless the user set ``LRU_CACHE_CAPACITY``.

    ideep reads the variable at its first matmul, so this works after ``import torch`` as long
    as no bfloat16 matmul has run yet in the process.
    """
    os.environ.setdefault("LRU_CACHE_CAPACITY", ONEDNN_SHAPE_CACHE_ENTRIES)


def default_device() -> torch.device:
    """CUDA when present, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_model(
    path_or_name: str | Path | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
) -> LoadedModel:
    """Load a local checkpoint directory or GGUF file (``None``: the default model).

    Never reaches a model hub. Weights must be safetensors or GGUF (no pickles). Raises
    :class:`ModelLoadError` for a missing path, an unsupported architecture or RoPE type, or
    corrupt files.
    """
    directory, gguf_file = resolve_model_path(path_or_name)
    try:
        return _load(directory, gguf_file, dtype, device or default_device())
    except ModelLoadError as error:
        if gguf_file is not None or not is_default_copy(directory):
            raise
        # Damage the copy's cheap check did not see; that check then finds nothing to redo.
        raise ModelLoadError(
            f"{error}; this is the converted copy of the default model: delete {directory} "
            "and run `chunkcache models pull` to convert it again"
        ) from error


def _declared_type(directory: Path, gguf_file: str | None) -> tuple[str | None, str | None]:
    """The model type and model class a checkpoint declares, read without transformers: a
    GGUF file's ``general.architecture`` (no class), else config.json's ``model_type`` and
    first ``architectures``.  None for what cannot be read."""
    try:
        if gguf_file:
            from gguf import GGUFReader

            field = GGUFReader(directory / gguf_file).get_field("general.architecture")
            declared = field.contents() if field is not None else None
            return (declared if isinstance(declared, str) else None), None
        config = json.loads((directory / "config.json").read_bytes())
        model_type, classes = config.get("model_type"), config.get("architectures")
    except Exception:  # gguf's parser and a damaged config raise whatever they hit
        return None, None
    first = classes[0] if isinstance(classes, list) and classes else None
    return (
        model_type if isinstance(model_type, str) else None,
        first if isinstance(first, str) else None,
    )


def _load(
    directory: Path, gguf_file: str | None, dtype: torch.dtype, device: torch.device | str
) -> LoadedModel:
    """:func:`load_model` of a resolved checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    where = directory / gguf_file if gguf_file else directory
    files: dict[str, Any] = {"gguf_file": gguf_file, "local_files_only": True}
    try:
        config = AutoConfig.from_pretrained(directory, **files)
    except Exception as e:
        # transformers refuses a type it does not know (or cannot map from GGUF) with advice
        # that misleads here: "upgrade transformers", or for GGUF the truncation hint below.
        model_type, architecture = _declared_type(directory, gguf_file)
        if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(unsupported_message(model_type, architecture)) from e
        if gguf_file:  # gguf's parser fails on a short file with whatever it was reading
            raise ModelLoadError(
                f"cannot read the GGUF file {where}: {one_line(e)} (if it is truncated or "
                "corrupt, download it again)"
            ) from e
        raise ModelLoadError(f"cannot read the model config at {where}: {one_line(e)}") from e
    # Refuse an unsupported architecture or RoPE before reading any weights.
    spec = ModelSpec.from_config(config, (getattr(config, "architectures", None) or [None])[0])
    rope_from_config(config, spec.head_dim)
    weights = weights_digest(directory, gguf_file)
    try:  # before the weights: it fails faster
        tokenizer = AutoTokenizer.from_pretrained(directory, **files)
    except Exception as e:
        if gguf_file is None and not any((directory / n).exists() for n in _VOCABULARY_FILES):
            # transformers' message then is about sentencepiece, which would not help
            raise ModelLoadError(
                f"cannot load the tokenizer at {where}: no tokenizer files there "
                "(tokenizer.json): copy them from where the model came from"
            ) from e
        raise ModelLoadError(f"cannot load the tokenizer at {where}: {one_line(e)}") from e
    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            directory,
            dtype=dtype,
            attn_implementation="sdpa",
            use_safetensors=gguf_file is None,
            output_loading_info=True,
            **files,
        )
    except Exception as e:
        raise ModelLoadError(f"cannot load the model at {where}: {one_line(e)}") from e
    hf, info = loaded  # output_loading_info=True: (model, loading info)
    # Unexpected keys too: a config with fewer layers than its weights loads "fine" and
    # answers garbage.
    problems = [
        *(f"missing {key}" for key in sorted(info["missing_keys"])),
        *(f"unexpected {key}" for key in sorted(info["unexpected_keys"])),
        *(f"mismatched {key}" for key in info["mismatched_keys"]),
    ]
    if problems:
        raise ModelLoadError(
            f"weights at {where} do not match its config ({len(problems)} tensors): "
            + ", ".join(map(str, problems[:5]))
        )
    return LoadedModel.from_hf(hf.to(device), tokenizer, weights)
