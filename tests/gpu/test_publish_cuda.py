"""bench.publish_to_ready's data plane on CUDA (what forge's shared-memory weight path does): a model's weights go
device -> host (cast to the generator dtype on the device) -> shared memory -> host -> device and arrive bit-exact."""

from __future__ import annotations

import pytest
import torch

from bench.gpu_checks import publish_round_trip

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("trainer_dtype", [torch.float32, torch.bfloat16])
def test_weights_arrive_on_the_gpu_bit_exact_in_the_generator_dtype(trainer_dtype: torch.dtype) -> None:
    weights = publish_round_trip(device="cuda", trainer_dtype=trainer_dtype, dtype=torch.bfloat16)  # raises unless equal
    assert weights and all(t.device.type == "cuda" and t.dtype == torch.bfloat16 for t in weights.values())


def test_the_publish_command_runs_on_cuda_and_checks_every_way() -> None:
    from bench.publish_to_ready import main

    seconds = main(["--model-shape", "tiny", "--device", "cuda", "--trainer-dtype", "float32"])
    assert {"device->host", "host->device", "load", "raw copy", "torch.save"} <= seconds.keys()
