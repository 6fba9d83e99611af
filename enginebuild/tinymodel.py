"""A tiny llama-architecture GGUF model with random weights, for a real engine to load in a second.

A real checkpoint is gigabytes from a model hub, which CI cannot reach; the engine does not care what
the weights mean, only that the file is a complete llama model. So: llama.cpp's own tokenizer-only
``ggml-vocab-llama-spm.gguf`` (32,000 SentencePiece tokens, shipped in the sdist we build from),
plus the hyperparameters and tensors of a 2-layer, 64-wide llama drawn from a seeded generator,
plus a chat template so ``/v1/chat/completions`` works. About 17 MB, nearly all of it the two
32,000 x 64 f32 matrices (token embeddings and output); the text it generates is nonsense, but it
is generated, token by token, by the engine's real code path.

Names and shapes come from the vendored source, not from memory: the tensor names are gguf-py's
``TENSOR_NAMES`` for ``MODEL_ARCH.LLAMA`` (``gguf-py/gguf/constants.py``), the required keys and
ggml shapes are ``llama_model_base::load_hparams`` (``src/llama-model.cpp``) and
``llama_model_llama::load_arch_tensors`` (``src/models/llama.cpp``). ggml lists dimensions fastest
first, numpy slowest first, so ggml's ``{n_embd, n_vocab}`` is numpy's ``(n_vocab, n_embd)``.

Only this module imports ``gguf`` (and numpy), so finding the model needs neither.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import attrs

#: A ChatML template. Its text does not matter to random weights, only that llama-server can
#: render a conversation (it renders with its Jinja engine, and recognises ChatML without it).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@attrs.frozen
class TinyLlama:
    """The model's shape and seed; the file name carries a digest of all of it, so a changed shape
    is a new file rather than a stale one."""

    embedding: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 4
    feed_forward: int = 256
    context: int = 2048
    seed: int = 20240611
    rms_eps: float = 1e-5
    rope_base: float = 10000.0
    #: Standard deviation of the random weights. Larger than a trained model's: it makes the
    #: output distribution peaked, so greedy decoding settles on a few tokens rather than noise.
    scale: float = 0.5

    def __attrs_post_init__(self) -> None:
        if self.embedding % self.heads or self.heads % self.kv_heads:
            raise ValueError("embedding must divide into heads, and heads into kv_heads")

    @property
    def file_name(self) -> str:
        digest = hashlib.sha256(repr(attrs.astuple(self)).encode() + CHAT_TEMPLATE.encode()).hexdigest()
        return f"tiny-llama-{self.layers}x{self.embedding}-{digest[:10]}.gguf"


DEFAULT = TinyLlama()


def model_path(models_dir: Path, spec: TinyLlama = DEFAULT) -> Path:
    return models_dir / spec.file_name


def write(vocab: Path, dest: Path, spec: TinyLlama = DEFAULT) -> Path:
    """Write the model to ``dest`` (via a temporary file and a rename: it exists only complete)."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType

    reader = GGUFReader(vocab)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{vocab} has no tokenizer.ggml.tokens: not a tokenizer GGUF")
    n_vocab = len(tokens.data)

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".partial")
    writer = GGUFWriter(tmp, "llama")
    writer.add_name("llmgw tiny llama (random weights)")
    writer.add_context_length(spec.context)
    writer.add_embedding_length(spec.embedding)
    writer.add_block_count(spec.layers)
    writer.add_feed_forward_length(spec.feed_forward)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_layer_norm_rms_eps(spec.rms_eps)
    writer.add_rope_dimension_count(spec.embedding // spec.heads)
    writer.add_rope_freq_base(spec.rope_base)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(LlamaFileType.ALL_F32)
    # The tokenizer, key by key and type by type, exactly as llama.cpp's own file has it.
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub)
    writer.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(spec.seed)
    head = spec.embedding // spec.heads

    def weights(*shape: int) -> np.ndarray[tuple[int, ...], np.dtype[np.float32]]:
        # Scaled by fan-in, so every layer's output keeps about the scale of its input.
        out: np.ndarray[tuple[int, ...], np.dtype[np.float32]] = (
            rng.standard_normal(shape) * spec.scale / np.sqrt(shape[-1])
        ).astype(np.float32)
        return out

    def ones(n: int) -> np.ndarray[tuple[int, ...], np.dtype[np.float32]]:
        return np.ones(n, dtype=np.float32)

    emb, ff = spec.embedding, spec.feed_forward
    # Embeddings are looked up, not multiplied, so they keep unit scale.
    writer.add_tensor("token_embd.weight", rng.standard_normal((n_vocab, emb)).astype(np.float32))
    writer.add_tensor("output_norm.weight", ones(emb))
    writer.add_tensor("output.weight", weights(n_vocab, emb) * np.float32(np.sqrt(emb)))
    for i in range(spec.layers):
        blk = f"blk.{i}"
        writer.add_tensor(f"{blk}.attn_norm.weight", ones(emb))
        writer.add_tensor(f"{blk}.attn_q.weight", weights(spec.heads * head, emb))
        writer.add_tensor(f"{blk}.attn_k.weight", weights(spec.kv_heads * head, emb))
        writer.add_tensor(f"{blk}.attn_v.weight", weights(spec.kv_heads * head, emb))
        writer.add_tensor(f"{blk}.attn_output.weight", weights(emb, spec.heads * head))
        writer.add_tensor(f"{blk}.ffn_norm.weight", ones(emb))
        writer.add_tensor(f"{blk}.ffn_gate.weight", weights(ff, emb))
        writer.add_tensor(f"{blk}.ffn_up.weight", weights(ff, emb))
        writer.add_tensor(f"{blk}.ffn_down.weight", weights(emb, ff))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dest)
    return dest


def ensure(vocab: Path, models_dir: Path, spec: TinyLlama = DEFAULT) -> Path:
    """The model file, written first if absent (a fixed seed makes every write the same bytes)."""
    path = model_path(models_dir, spec)
    if not path.exists():
        write(vocab, path, spec)
    return path


__all__ = ["CHAT_TEMPLATE", "DEFAULT", "TinyLlama", "ensure", "model_path", "write"]
