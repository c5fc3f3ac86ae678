"""Benchmarks record the GPU they ran on next to pytest-benchmark's CPU machine info, so saved
runs compared with ``--benchmark-compare`` say which card, driver and library versions they
came from."""

from __future__ import annotations

import platform

import torch
import triton


def pytest_benchmark_update_machine_info(config, machine_info: dict) -> None:
    info = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
            cudnn=torch.backends.cudnn.version(),
        )
    machine_info["minference"] = info
