"""Tests for forge.distributed: joining a process group whose rendezvous store listens on MASTER_ADDR alone, gathering
a DTensor to rank 0 alone, and splitting a batch over data-parallel ranks."""

from __future__ import annotations

import faulthandler
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from forge.distributed import DataParallel, gather_to_rank0, init_from_environment

WORLD_SIZE = 2


def full_tensors() -> dict[str, torch.Tensor]:
    """Every tensor a rank of the worker gathers, by name; shapes that shard unevenly or leave a rank empty."""
    generator = torch.Generator().manual_seed(0)
    return {
        "uneven_rows": torch.randn(5, 3, generator=generator),
        "one_row": torch.randn(1, 4, generator=generator),
        "columns": torch.randn(3, 7, generator=generator),
        "replicated": torch.randn(6, generator=generator),
        "bf16": torch.randn(9, 2, generator=generator).to(torch.bfloat16),
        "plain": torch.randn(2, 2, generator=generator),
    }


def _worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    faulthandler.enable()  # a rank that crashes prints its Python stack into the fixture's failure message
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))
    init_from_environment("cpu")
    try:
        store_listens_on = sorted(c.laddr.ip for c in psutil.Process().net_connections("tcp")
                                  if c.status == psutil.CONN_LISTEN and c.laddr.port == port)
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        placements = {"uneven_rows": Shard(0), "one_row": Shard(0), "columns": Shard(1), "replicated": Replicate(),
                      "bf16": Shard(0)}
        tensors = {name: distribute_tensor(t, mesh, [placements[name]]) if name in placements else t
                   for name, t in full_tensors().items()}
        gathered = {name: gather_to_rank0(t) for name, t in tensors.items()}
        dp = DataParallel(WORLD_SIZE, rank, None)
        rows = dp.rows(6)
        all_rows = dp.gather_rows(torch.arange(rows[0], rows[1]))
        torch.save({"gathered": gathered, "rows": rows, "all_rows": all_rows, "store_listens_on": store_listens_on},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    # Each rank runs this file as a script (see the bottom): a spawned process could not import this module
    # by name (torchmonarch installs a top-level `tests` package that hides this one).
    out_dir = tmp_path_factory.mktemp("gather")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, str(rank), str(port), str(out_dir)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(WORLD_SIZE)]
    for rank, proc in enumerate(procs):
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{output[-4000:]}"
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]


def test_the_rendezvous_store_listens_on_master_addr_alone_not_on_every_interface(results: list[dict]) -> None:
    assert [r["store_listens_on"] for r in results] == [["127.0.0.1"], []]  # rank 0 serves it; torch's own: "::"


def test_only_rank_0_holds_the_full_tensors(results: list[dict]) -> None:
    rank0, rank1 = results
    assert all(t is None for t in rank1["gathered"].values())
    assert rank0["gathered"].keys() == full_tensors().keys()
    for name, expected in full_tensors().items():
        got = rank0["gathered"][name]
        assert got.dtype == expected.dtype and torch.equal(got, expected), name


def test_data_parallel_ranks_split_rows_and_gather_them_in_order(results: list[dict]) -> None:
    assert [r["rows"] for r in results] == [(0, 3), (3, 6)]
    assert all(torch.equal(r["all_rows"], torch.arange(6)) for r in results)


def test_rows_that_do_not_split_evenly_are_refused() -> None:
    with pytest.raises(ValueError, match="batch of 5 sequences: must be a multiple of the data-parallel degree 2"):
        DataParallel(2, 0, None).rows(5)


if __name__ == "__main__":  # one rank, started by the `results` fixture
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
    # forge.compat 33: a process that joined a gloo group can abort in Python's finalization; its results are saved.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
