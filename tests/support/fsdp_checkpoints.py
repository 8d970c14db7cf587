"""verl's FSDP checkpoint of a tiny Qwen2 written and read by gloo ranks, for ``tests/test_reshard.py``.

Each rank (a spawned process on the CPU backend) wraps the CPU demo's tiny Qwen2 with FSDP2 (``fully_shard`` per
decoder layer, then the root, as verl's FSDP2 engine does), an AdamW and a warm-up scheduler, and uses verl 0.9.1's
own ``FSDPCheckpointManager`` to save or load: the files are the ones a training run writes, read the way its resume
reads them.

* ``save``: ``TRAIN_STEPS`` AdamW steps on fixed data, then ``save_checkpoint``; rank 0 reports the full
  parameters, both AdamW moments, the optimizer's step and the learning rate.
* ``load``: a model built from another seed, ``load_checkpoint``, the same report, then one more step on rank 0's
  row of the fixed data, reporting the learning rate after it.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import torch

TRAIN_STEPS = 2
LR = 1e-2
WARMUP = 4


def _model(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from gtpo.cpu.demo_task import MODEL_RECIPE

    # 37 tokens: the embedding's rows split unevenly over 2, 3 and 4 ranks (torch.chunk's cut, an empty-free tail)
    config = Qwen2Config(**{**MODEL_RECIPE, "vocab_size": 37, "tie_word_embeddings": False})
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).to(torch.float32)


def _wrap(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _optimizer(model):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / WARMUP))
    return opt, sched


def _step(model, opt, sched, rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, 37, (2, 9), generator=gen)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def _report(model, opt, sched) -> dict:
    """Full tensors (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    names = {p: n for n, p in model.named_parameters()}
    report = {"params": {n: full(p) for n, p in model.named_parameters()}, "exp_avg": {}, "exp_avg_sq": {}, "step": {}}
    for p, state in opt.state.items():
        report["exp_avg"][names[p]] = full(state["exp_avg"])
        report["exp_avg_sq"][names[p]] = full(state["exp_avg_sq"])
        report["step"][names[p]] = float(state["step"])
    report["lr"] = sched.get_last_lr()[0]
    report["last_epoch"] = sched.last_epoch
    return report


def _manager(model, opt, sched):
    from omegaconf import OmegaConf
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    contents = ["model", "optimizer", "extra"]
    config = OmegaConf.create({"save_contents": contents, "load_contents": contents})
    return FSDPCheckpointManager(model, opt, sched, processing_class=None, checkpoint_config=config)


def _rank_main(rank: int, world_size: int, port: int, action: str, folder: str, out: str) -> None:
    try:
        from tests.support.dp import rank_environment

        rank_environment(rank, world_size, port)  # the CPU backend's platform, one torch thread
        import verl  # noqa: F401 - loads the CPU platform before verl's checkpoint manager asks for a device

        torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
        model = _wrap(_model(seed=0 if action == "save" else 99))
        opt, sched = _optimizer(model)
        manager = _manager(model, opt, sched)
        if action == "save":
            for step in range(TRAIN_STEPS):
                _step(model, opt, sched, rank, step)
            manager.save_checkpoint(folder, global_step=TRAIN_STEPS)
            report = _report(model, opt, sched)
        else:
            manager.load_checkpoint(folder)
            report = _report(model, opt, sched)
            _step(model, opt, sched, rank, TRAIN_STEPS)
            report["lr_after_step"] = sched.get_last_lr()[0]
            report["rng"] = torch.get_rng_state()
        if rank == 0:
            torch.save(report, out)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except BaseException:
        Path(f"{out}.rank{rank}.error").write_text(traceback.format_exc())
        raise


def run_ranks(world_size: int, action: str, folder: Path, out: Path, timeout: float = 300) -> dict:
    """Run ``action`` (``save`` / ``load``) on ``world_size`` gloo ranks over the checkpoint ``folder``; rank 0's
    report."""
    import multiprocessing

    from tests.support.dp import _free_port, wait_processes

    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, action, str(folder), str(out)), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    wait_processes({world_size: procs}, lambda _: out.parent, timeout)
    return torch.load(out, weights_only=False)
