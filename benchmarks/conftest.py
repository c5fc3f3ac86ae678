"""Benchmarks record the GPU they ran on next to pytest-benchmark's CPU machine info, so saved
runs compared with ``--benchmark-compare`` say which card, driver and library versions they
came from, and they are saved per GPU: ``.benchmarks/<gpu name>/<machine id>/NNNN_*.json``
(unless ``--benchmark-storage`` names another place), so a gate compares a run only with
baselines of the same card."""

from __future__ import annotations

import platform
import re

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


DEFAULT_STORAGE = "file://./.benchmarks"


def gpu_storage(storage: str, gpu_name: str) -> str:
    """pytest-benchmark's default storage with the GPU's name as one more folder; any other storage as given."""
    if storage != DEFAULT_STORAGE:
        return storage
    return f"{DEFAULT_STORAGE}/{re.sub(r'[^A-Za-z0-9._-]+', '_', gpu_name).strip('_')}"


def pytest_configure(config) -> None:  # before pytest-benchmark's own (trylast) opens the storage
    if torch.cuda.is_available() and hasattr(config.option, "benchmark_storage"):
        config.option.benchmark_storage = gpu_storage(config.option.benchmark_storage, torch.cuda.get_device_name(0))
