"""Loss and perplexity on held-out data, token-weighted."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tunesmith.data import IGNORE, Example, collate


@dataclass
class EvalResult:
    loss: float  # mean negative log-likelihood per supervised token (nats)
    perplexity: float
    tokens: int  # supervised tokens scored
    scored: str = ""  # what was scored (source, split, examples, tokens), when the caller names it


def loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over supervised tokens, and their count.

    Summing (not averaging) per micro-batch lets the caller divide by the tokens of the whole optimizer step, so
    the loss is the same however the step is split into micro-batches.
    """
    logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                   position_ids=batch.get("position_ids"), use_cache=False).logits
    labels = batch["labels"][:, 1:]
    logits = logits[:, :-1].float()
    n = int((labels != IGNORE).sum())
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE, reduction="sum")
    return loss, n


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    examples: Sequence[Example],
    batch_size: int = 4,
    max_batches: int = 0,
    pad_id: int = 0,
    shard: tuple[int, int] = (0, 1),
    all_sum: Callable[[list[float]], list[float]] | None = None,
    advance: Callable[[], None] | None = None,
    loss_fn: Callable = loss_sum,
) -> EvalResult:
    """Token-weighted loss and perplexity of `model` on `examples` (all of them, or the first max_batches batches).

    Under several processes, `shard` (rank, world) gives each its every world-th example and `all_sum` adds up
    their sums: the result is the one a single process gets. Every process runs the same number of forwards, an
    unscored one where its share ran out, since a sharded (FSDP) model gathers its weights collectively.
    `advance` is called after each batch (a progress bar's); `loss_fn` is the trainer's (its fused loss keeps a
    large vocabulary's logits from peaking above training's memory)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    if max_batches:
        examples = examples[: max_batches * batch_size]
    rank, world = shard
    mine = examples[rank::world]
    total, count = 0.0, 0
    for i in range(eval_rounds(len(examples), batch_size, 0, world)):
        chunk = mine[i * batch_size : (i + 1) * batch_size]
        batch = collate(chunk or examples[:1], pad_id)
        s, n = loss_fn(model, {k: v.to(device) for k, v in batch.items()})
        if chunk:
            total += float(s)
            count += n
        if advance is not None:
            advance()
    if all_sum is not None:
        total, count = all_sum([total, float(count)])
        count = int(count)
    model.train(was_training)
    if count == 0:
        return EvalResult(float("nan"), float("nan"), 0)
    mean = total / count
    return EvalResult(mean, math.exp(min(mean, 80.0)), count)


def eval_rounds(n: int, batch_size: int, max_batches: int = 0, world: int = 1) -> int:
    """The forward passes `evaluate` runs on each process for `n` examples: the most batches any process has."""
    if max_batches:
        n = min(n, max_batches * batch_size)
    return math.ceil(math.ceil(n / world) / batch_size)


def evaluate_from_config(cfg) -> EvalResult:
    """The `eval` verb: loss and perplexity of a model (+ adapter) on one split of a dataset (cfg.split: the
    held-out part by default, the training part, or all of it); the result names what was scored."""
    import dataclasses

    from tunesmith.data import check_data_spec, describe_part, load_data, no_held_out, split_examples
    from tunesmith.device import resolve_device, resolve_precision, weight_dtype
    from tunesmith.errors import TunesmithError
    from tunesmith.lora import load_with_adapter

    check_data_spec(cfg.data)  # before the model loads
    device = resolve_device(cfg.device)
    model, tokenizer, _ = load_with_adapter(cfg.model, cfg.adapter, device,
                                            weight_dtype(device, resolve_precision(device, cfg.precision)),
                                            cfg.trust_remote_code)
    data = load_data(cfg.data, tokenizer, cfg.seq_len, cfg.val_fraction)
    examples = split_examples(data, cfg.split)
    if not examples:
        if cfg.split == "valid":
            raise TunesmithError(no_held_out(data, cfg.seq_len, cfg.val_fraction))
        raise TunesmithError(f"{data.source} has no {cfg.split} examples of --seq-len {cfg.seq_len}; lower --seq-len")
    if cfg.max_batches:
        examples = examples[: cfg.max_batches * cfg.batch_size]
    result = evaluate(model, examples, cfg.batch_size, 0, tokenizer.pad_token_id)
    return dataclasses.replace(result, scored=describe_part(data, f"{cfg.split} split", [ids for ids, _ in examples]))
