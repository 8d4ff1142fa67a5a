"""Test-only shim: Megatron-core's model and tensor parallelism on CPU.

Megatron-core asks CUDA for the current device (rotary tables, buffers), moves
the tied embedding of a pipeline's last stage with ``.cuda()``, and
keeps its tensor-parallel RNG states with ``torch.cuda``'s RNG calls. This
shim answers the first with the CPU and keeps the RNG states in a CPU
generator, which is all the model, its tensor-parallel layers and flowc's
weight mapping need. Megatron's optimizer and schedules still allocate CUDA
tensors and do not run under it; those paths are covered by GPU-marked tests.

Never imported by flowc itself: the ``megatron`` backend refuses to start
without CUDA unless this shim marked ``torch.cuda.flowc_cpu_shim``.
"""

from __future__ import annotations

import torch

_GEN = torch.Generator()


def install() -> None:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: _GEN.manual_seed(int(seed))  # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda device=None: _GEN.get_state()  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]  # tied embeddings across stages
    torch.cuda.flowc_cpu_shim = True  # type: ignore[attr-defined]
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._set_cuda_rng_state = lambda state, device=-1, graph_safe=False: _GEN.set_state(state)
    mrandom._get_cuda_rng_state = lambda device=None, clone=False, graph_safe=False: _GEN.get_state()
