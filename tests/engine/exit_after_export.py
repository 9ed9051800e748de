"""One rank of a job whose last act is ``iter_full_weights``, then interpreter exit.

``python exit_after_export.py RANK WORLD_SIZE INIT_METHOD``: launched by
``test_handover.py::test_export_then_exit_exits_zero``, which counts the ranks that die of a
signal at exit ([Note: a backend thread's last reference] in fsdp2/engine/handover.py).
"""

import sys

import torch
import torch.distributed as dist

import fsdp2


def main() -> None:
    rank, world_size, init_method = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(3)))
    for layer in model:
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    model(torch.randn(2, 64)).sum().backward()
    for bucket in fsdp2.iter_full_weights(model, rank=0):
        del bucket
    # Nothing after the export: its closing exchange is the job's last collective.


if __name__ == "__main__":
    main()
