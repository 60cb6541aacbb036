"""One process of a multi-process training run, for tests/test_distributed.py (started by torch's launcher, gloo on
the CPU): trains the tiny Llama through tunesmith.train.train and writes what this process saw and did to
<out>/rank<R>.json -- its losses, the examples of each step, its trained weights' digest, and which of the run
folder's writers it called.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist_worker.py SPEC.json
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402  -- (the repository root is on PYTHONPATH: test_distributed's _env)

torch.set_num_threads(1)  # the same reduction order in every process, and no oversubscribed cores


def main(spec_path: str) -> int:
    import tunesmith.train as T
    from tests.conftest import make_model, make_tokenizer
    from tunesmith.config import TrainConfig
    from tunesmith.data import load_data
    from tunesmith.errors import TunesmithError
    from tunesmith.evaluate import loss_sum
    from tunesmith.kernels import lora_mlp

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ["RANK"])
    overrides = spec.get("rank_overrides", {}).get(str(rank), {})
    cfg = TrainConfig(**{**spec["config"], **overrides})
    calls: list[str] = []
    for name in ("save_adapter", "save_config"):  # the run folder's writers, as train.py calls them
        real = getattr(T, name)
        setattr(T, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    fused_mlps: list[int] = []  # how many MLPs each fuse_mlp call routed through the LoRA-aware function
    real_fuse = lora_mlp.fuse_mlp
    lora_mlp.fuse_mlp = lambda model: (fused_mlps.append(n := real_fuse(model)), n)[1]
    if spec.get("force_mlp"):  # the LoRA-aware MLP off CUDA: its plain-PyTorch reference
        lora_mlp.LoraMLP.applies = lambda self, setting, model: setting.lora
    real_save = T.Checkpointer.save
    T.Checkpointer.save = lambda self, *a, **k: (calls.append("checkpoint"), real_save(self, *a, **k))[1]

    steps: list[list[list[int]]] = [[]]

    def recording_loss(model, batch):
        steps[-1].extend(batch["input_ids"].tolist())
        return loss_sum(model, batch)

    tok = make_tokenizer()
    data = load_data(cfg.data, tok, cfg.seq_len, cfg.val_fraction)
    out = Path(spec["out"])
    record = {"rank": rank, "calls": calls, "fused_mlps": fused_mlps}
    try:
        loss = None if spec.get("default_loss") else recording_loss  # None: the loss the fast paths choose
        result = T.train(cfg, model=make_model(tok), tokenizer=tok, data=data, loss=loss,
                         callback=lambda r: steps.append([]), progress=False)
    except TunesmithError as e:
        record["error"] = str(e)
        (out / f"rank{rank}.json").write_text(json.dumps(record))
        return 1
    weights = {n: p.detach().cpu() for n, p in result.model.named_parameters() if p.requires_grad}
    digest = hashlib.sha256(b"".join(weights[n].numpy().tobytes() for n in sorted(weights))).hexdigest()
    record |= {"losses": result.losses, "steps": steps[:-1], "weights": digest, "tokens": result.tokens,
               "evals": [(s, e.loss) for s, e in result.evals]}
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
