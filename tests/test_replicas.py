"""Data-parallel training (train.replicas) on two gloo CPU processes: the replicas draw different
samples, yet take the same steps and end with the same weights (the averaged gradient, replica 0's
clock and LR); replica 0 alone writes the checkpoint."""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.multiprocessing as mp

from engine.parallel.groups import free_port


def _replica(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from train.train import Run, export_tensors, main_args

    run = Run(main_args(["--out", out, "--batch-scale", "0.03", "--workers", "0", "--max-vae-steps", "2",
                         "--max-tf-steps", "2", "--probe", "0"]))
    run.run()
    torch.save({"weights": export_tensors(run.model), "state": run.state}, Path(out) / f"replica{rank}.pt")


def test_two_replicas_draw_different_samples():
    from train.train import SeqBatches
    from train.config import model_config
    from train.tokenizer import build_tokenizer, padded_vocab
    import tempfile

    tok = build_tokenizer()
    with tempfile.TemporaryDirectory() as d:
        tok.save(f"{d}/tokenizer.json")
        cfg = model_config(padded_vocab(tok))
        a, b = (SeqBatches(f"{d}/tokenizer.json", cfg, 0, 0.03, rank=r, world=2)[5] for r in (0, 1))
    assert a["ids"].shape[0] == b["ids"].shape[0]                # same group: same batch size
    assert not torch.equal(a["ids"], b["ids"])                    # different scenes and prompts


def test_two_replicas_train_in_step(tmp_path):
    out = tmp_path / "run"
    mp.start_processes(_replica, args=(2, free_port(), str(out)), nprocs=2, start_method="spawn")
    r0, r1 = (torch.load(out / f"replica{r}.pt") for r in (0, 1))
    assert r0["state"]["tf_step"] == r1["state"]["tf_step"] == 2
    assert r0["state"]["scaling_factor"] == r1["state"]["scaling_factor"]
    assert r0["weights"].keys() == r1["weights"].keys()
    for k, v in r0["weights"].items():
        assert torch.equal(v, r1["weights"][k]), k
    from safetensors.torch import load_file
    stored = {}
    for f in sorted(out.glob("model/model-*.safetensors")):
        stored |= load_file(f)
    assert stored.keys() == r0["weights"].keys()
    for k, v in stored.items():                                    # the checkpoint is what the replicas hold
        assert torch.equal(v, r0["weights"][k].to(v.dtype)), k
