"""One rank of Hugging Face accelerate's FSDP2 path on a tiny Llama, run by ``torchrun``.

``--impl fsdp2`` swaps fsdp2's names into ``torch.distributed.fsdp`` before accelerate looks them
up (it imports them inside its functions, so the patched module is all it sees); ``--impl torch``
runs torch's own ``fully_shard``. Everything else is identical: the model init (one seed on every
rank), the data (the global batch of each step is drawn from a seeded generator and each rank
takes its rows), AdamW, accelerate's gradient clipping. accelerate only takes its FSDP path on
accelerators; on CPU the script opts in by setting its distributed type by hand.

Printed lines (rank 0 only), parsed by ``test_accelerate.py``:

    MODEL <module>.<class>                          the prepared model's class: whose FSDP it is
    LOSS step=<i> value=<float> grad_norm=<float>   mean loss over the global batch, before step i
                                                    (step == --steps: after the checkpoint, no norm)
    RESUMED step=<i> value=<float>                  the same step rerun after accelerate.load_state
    SAVED <path>                                    accelerate.get_state_dict, torch.save'd
    DONE                                            the script finished (not its exit code: gloo
                                                    may abort a rank after python is done)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script by torchrun: make `fsdp2` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

VOCAB, SEQ, ROWS_PER_RANK = 96, 16, 2
LR = 5e-3


def build_model(tied: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def global_batch(step: int, world: int) -> torch.Tensor:
    """Counting sequences from random starts: learnable, so the loss falls within a few steps."""
    gen = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(0, VOCAB, (ROWS_PER_RANK * world, 1), generator=gen)
    return (starts + torch.arange(SEQ)) % VOCAB


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    return global_batch(step, world)[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK]


def train_step(accelerator: Any, model: Any, optimizer: Any, step: int) -> tuple[float, float]:
    ids = batch(step, accelerator.process_index, accelerator.num_processes)
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / accelerator.num_processes, float(grad_norm)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=("fsdp2", "torch"), required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tied", action="store_true", help="tie_word_embeddings=True")
    parser.add_argument(
        "--cpu-ram-efficient-loading",
        action="store_true",
        help="accelerate broadcasts rank 0's weights; the other ranks start from garbage",
    )
    parser.add_argument(
        "--full-state-dict",
        action="store_true",
        help="save_state/load_state with FULL_STATE_DICT (rank 0 saves, loading broadcasts)",
    )
    parser.add_argument("--out", type=Path, required=True, help="a directory for checkpoints")
    args = parser.parse_args()
    if args.impl == "fsdp2":
        import fsdp2

        fsdp2.patch_torch_fsdp()  # the one-line switch a framework needs

    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        state_dict_type="FULL_STATE_DICT" if args.full_state_dict else "SHARDED_STATE_DICT",
        reshard_after_forward=True,
        cpu_ram_efficient_loading=args.cpu_ram_efficient_loading,
    )
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
    # accelerate takes its FSDP path only on accelerators (a CPU run is MULTI_CPU, i.e. DDP);
    # everything FSDP2 does after this point is device-agnostic, so opt in by hand.
    # (Both singletons: each new AcceleratorState() re-copies PartialState's fields.)
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    rank = accelerator.process_index
    model = build_model(args.tied)
    if args.cpu_ram_efficient_loading and rank != 0:
        with torch.no_grad():  # only rank 0's weights may reach the sharded model
            for param in model.parameters():
                param.fill_(float("nan"))
    # eps as in tests/parity/build.py: bounds how far Adam amplifies rounding noise in ~0 gradients.
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=1e-5)
    model, optimizer = accelerator.prepare(model, optimizer)
    if not accelerator.is_fsdp2:
        raise AssertionError("accelerate did not take its FSDP2 path")

    def say(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    say(f"MODEL {type(model).__module__}.{type(model).__qualname__}")
    for step in range(args.steps):
        loss, grad_norm = train_step(accelerator, model, optimizer, step)
        say(f"LOSS step={step} value={loss:.10f} grad_norm={grad_norm:.10f}")

    state_dict = accelerator.get_state_dict(model)  # full, on rank 0's CPU
    if rank == 0:
        path = args.out / "full_state_dict.pt"
        torch.save(state_dict, path)
        say(f"SAVED {path}")
    accelerator.save_model(model, args.out / "model")
    accelerator.save_state(args.out / "state")
    accelerator.wait_for_everyone()

    # One step past the checkpoint, then back to it and the same step again: the load must
    # restore parameters and optimizer state exactly (same arithmetic: bitwise equal).
    loss, _ = train_step(accelerator, model, optimizer, args.steps)
    say(f"LOSS step={args.steps} value={loss:.10f}")
    accelerator.load_state(args.out / "state")
    loss, _ = train_step(accelerator, model, optimizer, args.steps)
    say(f"RESUMED step={args.steps} value={loss:.10f}")
    accelerator.wait_for_everyone()
    say("DONE")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
