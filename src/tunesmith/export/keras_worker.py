"""The Keras side of `export --format keras` and `parity --framework`, run as a script in its own process.

Keras picks its backend (KERAS_BACKEND) once, at import, so each backend gets a fresh process; this file imports
only numpy and keras / keras_hub (never torch or tunesmith), and talks to its parent through files:

    KERAS_BACKEND=jax python -P keras_worker.py request.json   (-P: its folder, which holds keras.py, off sys.path)

request.json: {"source": folder, "kind": "hf" | "preset", "dtype": "float32" | "bfloat16", "sequences": [[ids]],
"prompts": [[ids]], "max_tokens": n, "texts": [str], "save": folder | null, "config": {...} | null}.
"hf" builds the model from a Hugging Face folder (`config` are backbone arguments KerasHub's converter leaves out,
`preprocessor` the preprocessor's); "preset" loads a saved Keras preset with plain `CausalLM.from_preset`, as a
user would. The worker writes <request>.npz: logits_<i> (float32, one row per position of sequences[i]),
greedy_<i> (max_tokens greedy ids after prompts[i], from KerasHub's own cached `generate`), token_ids_<i> (texts[i]
through the Keras tokenizer), and <request>.out.json: backend, versions, decode seconds.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def load(request: dict):
    import keras_hub

    if request["kind"] == "preset":
        return fp32_logits(keras_hub.models.CausalLM.from_preset(request["source"], dtype=request["dtype"]))
    source, extra = request["source"], request.get("config") or {}
    backbone = keras_hub.models.Backbone.from_preset(source, dtype=request["dtype"], **extra.get("backbone", {}))
    preprocessor = keras_hub.models.CausalLMPreprocessor.from_preset(source, **extra.get("preprocessor", {}))
    task = keras_hub.models.CausalLM.from_preset(source, load_weights=False, backbone=backbone,
                                                 preprocessor=preprocessor)
    return fp32_logits(task)


def fp32_logits(model):
    """In bf16, the output projection in fp32 (ReversibleEmbedding's `reverse_dtype`): its bf16 weights and the
    bf16 hidden state go in as they are, and the logits come out unrounded. Rounding 49k-262k logits to bf16's 8
    bits flips near-tied top-1 tokens, which cost Keras bf16 its agreement with PyTorch fp32 (docs/EXPORT.md,
    "Keras: measured"). KerasHub's backbones do not save `reverse_dtype` in their config, so every load sets it."""
    embedding = getattr(model.backbone, "token_embedding", None)
    if embedding is not None and hasattr(embedding, "reverse_dtype") and embedding.reverse_dtype is None:
        if embedding.compute_dtype != "float32":
            embedding.reverse_dtype = "float32"
    return model


def logits(model, ids: list[int]):
    import keras
    import numpy as np

    x = np.asarray([ids], dtype="int32")
    hidden = model.backbone({"token_ids": x, "padding_mask": np.ones_like(x)})
    out = model.backbone.token_embedding(hidden, reverse=True)
    return np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(out[0], "float32")))


def greedy(model, prompts: list[list[int]], max_tokens: int, n: int) -> tuple[list, float]:
    """max_tokens greedy ids after each prompt through KerasHub's generate (KV cache, compiled), and the seconds
    spent in generate. Every call is padded to `n` positions: one shape, so JAX compiles once."""
    import keras
    import numpy as np

    model.compile(sampler="greedy")
    # The compiled function generate() calls, token ids in and token ids out, without generate()'s preprocessing
    # and its output normalizer (which fails on the `images: None` that Gemma 3's text-only generation returns)
    generate = model.make_generate_function()
    out, seconds = [], 0.0
    for ids in prompts:
        x = {"token_ids": np.zeros((1, n), "int32"), "padding_mask": np.zeros((1, n), bool)}
        x["token_ids"][0, : len(ids)] = ids
        x["padding_mask"][0, : len(ids)] = True
        t = time.perf_counter()
        tokens = np.asarray(keras.ops.convert_to_numpy(generate(x, None)["token_ids"]))
        seconds += time.perf_counter() - t
        out.append(tokens[0, len(ids) : len(ids) + max_tokens].astype("int64"))
    return out, seconds


def patch_configs(preset: Path, registered_name: str, values: dict) -> None:
    """Add `values` to the config of every object saved as `registered_name`: the backbone's and the tokenizer's
    configs are nested in config.json / tokenizer.json, preprocessor.json and task.json alike."""

    def patch(node) -> None:
        if isinstance(node, dict):
            if node.get("registered_name") == registered_name:
                node["config"].update(values)
            for value in node.values():
                patch(value)
        elif isinstance(node, list):
            for value in node:
                patch(value)

    for name in ("config.json", "tokenizer.json", "preprocessor.json", "task.json"):
        if (preset / name).is_file():
            config = json.loads((preset / name).read_text(encoding="utf-8"))
            patch(config)
            (preset / name).write_text(json.dumps(config, indent=4), encoding="utf-8")


def reloadable_backbone(preset: Path, model) -> None:
    """KerasHub 0.32's LlamaBackbone takes tie_word_embeddings but leaves it out of its saved config, so a model
    with tied embeddings (SmolLM2) reloads expecting an output matrix the file does not have."""
    backbone = model.backbone
    if hasattr(backbone, "tie_word_embeddings") and "tie_word_embeddings" not in backbone.get_config():
        patch_configs(preset, f"keras_hub>{type(backbone).__name__}",
                      {"tie_word_embeddings": bool(backbone.tie_word_embeddings)})


# Llama3Tokenizer's constructor adds these unless told otherwise, and its saved config does not tell it otherwise
LLAMA3_DEFAULT_SPECIALS = ("<|start_header_id|>", "<|end_header_id|>")


def reloadable_tokenizer(preset: Path, model) -> None:
    """Make a saved Llama3Tokenizer reload for a vocabulary that is not Llama 3's (SmolLM2's, for one).

    KerasHub 0.32's Llama3Tokenizer does not save its bos / eos tokens, so `from_preset` rebuilds it with
    Llama 3's <|begin_of_text|> / <|end_of_text|> and demands <|start_header_id|> / <|end_header_id|> in the
    vocabulary, which fails for any other BPE vocabulary. The saved configs get the real bos / eos written in,
    and the two header tokens, when the vocabulary lacks them, are entered at ids past the model's vocabulary:
    they only come out of text that spells them literally, which a model that never saw them cannot use anyway.
    """
    tokenizer = model.preprocessor.tokenizer if model.preprocessor is not None else None
    if type(tokenizer).__name__ != "Llama3Tokenizer":
        return
    vocab_file = preset / "assets" / "tokenizer" / "vocabulary.json"
    vocab = json.loads(vocab_file.read_text(encoding="utf-8"))
    next_id = max(model.backbone.vocabulary_size, max(vocab.values()) + 1)
    for token in LLAMA3_DEFAULT_SPECIALS:
        if token not in vocab:
            vocab[token], next_id = next_id, next_id + 1
    vocab_file.write_text(json.dumps(vocab), encoding="utf-8")
    patch_configs(preset, "keras_hub>Llama3Tokenizer",
                  {"bos_token": tokenizer.start_token, "eos_token": tokenizer.end_token})


def main(path: str) -> None:
    import keras
    import keras_hub
    import numpy as np

    request = json.loads(Path(path).read_text(encoding="utf-8"))
    model = load(request)
    arrays = {f"logits_{i}": logits(model, ids) for i, ids in enumerate(request.get("sequences", []))}
    for i, text in enumerate(request.get("texts", [])):
        arrays[f"token_ids_{i}"] = np.asarray(model.preprocessor.tokenizer(text)).astype("int64")
    seconds, prompts, max_tokens = None, request.get("prompts", []), request.get("max_tokens", 0)
    tokens = [np.zeros(0, "int64") for _ in prompts]
    if prompts and max_tokens > 0:
        n = max(map(len, prompts)) + max_tokens
        greedy(model, prompts[:1], 1, n)  # the first generate compiles; time the decoding apart from it
        tokens, seconds = greedy(model, prompts, max_tokens, n)
    arrays.update({f"greedy_{i}": t for i, t in enumerate(tokens)})
    if request.get("save"):
        model.save_to_preset(request["save"])
        reloadable_backbone(Path(request["save"]), model)
        reloadable_tokenizer(Path(request["save"]), model)
    np.savez(Path(path).with_suffix(".npz"), **arrays)
    info = {"backend": keras.backend.backend(), "keras": keras.__version__, "keras_hub": keras_hub.__version__,
            "decode_seconds": seconds, "task": type(model).__name__}
    Path(path).with_suffix(".out.json").write_text(json.dumps(info), encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1])
