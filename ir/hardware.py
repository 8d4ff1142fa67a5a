"""Hardware profiles: the devices flowc plans for, as data files.

Each profile (``ir/hardware/<name>.yaml``) holds the published peak figures
of one device type, the links of a typical node built from it, and the
efficiency factors the cost model multiplies them by. Every number cites its
source in the file (``sources``); efficiency factors say how they were
calibrated. Names are matched case-insensitively, with aliases (``H100`` is
``H100-80GB``).
"""

from __future__ import annotations

from importlib import resources
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from flowc.errors import SpecError


class Efficiency(BaseModel):
    """Achieved fractions of peak (all in (0, 1]).

    Attributes:
        matmul: large dense GEMMs (a rollout engine's prefill and decode FLOPs).
        forward: a training framework's forward-only passes (log-probs, values, scores): the
            same model code and kernels as the training pass, so not a bare GEMM's rate; a
            profile that leaves it out uses ``matmul``.
        train: dense training steps (forward + backward + optimizer), the MFU
            a well-tuned single-node run reaches before communication costs.
        decode_bw: HBM bandwidth reached by the memory-bound decode loop.
        intra_node: collective bus bandwidth over NVLink (or shared memory).
        inter_node: collective bus bandwidth over the network.
        moe_train: extra factor on MoE training (routing, all-to-all,
            small expert GEMMs) relative to ``train``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    matmul: float = Field(gt=0, le=1)
    forward: float = Field(gt=0, le=1)
    train: float = Field(gt=0, le=1)
    decode_bw: float = Field(gt=0, le=1)
    intra_node: float = Field(gt=0, le=1)
    inter_node: float = Field(gt=0, le=1)
    moe_train: float = Field(1.0, gt=0, le=1)

    @model_validator(mode="before")
    @classmethod
    def _forward_defaults_to_matmul(cls, data: Any) -> Any:
        if isinstance(data, dict) and "forward" not in data and "matmul" in data:
            return {**data, "forward": data["matmul"]}
        return data


class RolloutCost(BaseModel):
    """What one rollout backend costs on a device type beyond the FLOPs and bytes that the
    cost model prices for every backend alike (docs/planner.md, "Rollout backends").

    Attributes:
        start_s: building the engine, once per run (not part of a step; ``why`` shows it).
        request_ms: host-side work per request (scheduling, input and output processing).
        step_ms: fixed host-side work per decode step (the scheduler, the sampler).
        layer_overhead_us: per layer of one decode step (kernel launches, Python dispatch);
            None: the profile's ``layer_overhead_us``.
        decode_scale: the rate of the decode loop's matmuls and weight reads relative to
            the profile's calibrated ``matmul`` and ``decode_bw`` (its kernels' speed).
        resident_gb: memory the engine holds beyond its weights and KV cache (its libraries,
            scheduler and workspaces), per device; counted where it runs.
        max_seqs: the most sequences a continuously batching engine decodes at once (vLLM's
            ``max_num_seqs`` default on the device); None: as many as the KV cache holds.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    start_s: float = Field(0.0, ge=0)
    request_ms: float = Field(0.0, ge=0)
    step_ms: float = Field(0.0, ge=0)
    layer_overhead_us: float | None = Field(None, ge=0)
    decode_scale: float = Field(1.0, gt=0)
    resident_gb: float = Field(0.0, ge=0)
    max_seqs: int | None = Field(None, ge=1)


class HardwareProfile(BaseModel):
    """One device type. Unknown keys are errors.

    Attributes:
        name: canonical name (``H100-80GB``).
        aliases: other names users type (``H100``, ``H100-SXM``).
        kind: ``gpu`` or ``cpu``.
        peak_tflops: dense bf16 peak per device (TFLOP/s).
        fp32_tflops: dense fp32 matmul rate per device (TFLOP/s), what a plan in float32 is
            priced at; None: half the bf16 peak (GPUs: TF32 tensor cores).
        memory_gb: device memory (GB, 1e9 bytes).
        reserved_gb: memory not available to tensors (runtime context,
            allocator fragmentation, communication buffers; on CPUs each core's share of the
            controller's and Ray's own processes).
        process_gb: resident memory of one worker process before any model state (the
            interpreter, torch, transformers, Ray's worker core), counted in every phase's
            buffers; CPUs, where the device memory is the host's (0 on GPUs).
        mem_bw_tb_s: memory bandwidth per device (TB/s).
        intra_node_gb_s: device-to-device bandwidth inside a node, per device
            and direction (GB/s).
        inter_node_gb_s: network bandwidth per node and direction (GB/s).
        devices_per_node: devices in a typical node.
        latency_us: fixed latency of one collective (µs).
        layer_overhead_us: fixed cost per layer of one decode step (kernel
            launches; CUDA graphs keep it small) (µs).
        gemm_half_width, gemm_half_tokens: a matmul whose per-device width (or
            token count) equals these runs at half the calibrated rate — GPUs
            need wide, tall GEMMs; CPUs saturate much sooner.
        host_link_gb_s: host↔device bandwidth per device (offload; GB/s).
        comm_overlap: the fraction of data-parallel communication (FSDP's
            gathers, gradient reduction) hidden under compute — GPUs run
            NCCL on their own engines; on CPUs the two compete for the cores.
        multicore_efficiency: CPU devices of several cores: the fraction of
            linear scaling each added core brings.
        host_memory_gb: host memory per node that offloaded states may use
            (GB); 0 disables offload (CPU devices: the host is the device).
        engine_reload_ms, engine_reload_gb_s: what loading synced weights into
            a live vLLM engine costs beyond moving them: a fixed part per sync
            and a rate (vLLM fuses, shards and, on CPU, re-packs every weight).
            0 and unset (free) where not measured.
        rollout: per rollout backend (``vllm``, ``hf``), what it costs beyond the shared
            model (:class:`RolloutCost`); a backend not listed costs nothing extra.
        efficiency: achieved fractions (see :class:`Efficiency`).
        sources: where each figure comes from.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    aliases: tuple[str, ...] = ()
    kind: Literal["gpu", "cpu"] = "gpu"
    peak_tflops: float = Field(gt=0)
    fp32_tflops: float | None = Field(None, gt=0)
    memory_gb: float = Field(gt=0)
    reserved_gb: float = Field(0.0, ge=0)
    process_gb: float = Field(0.0, ge=0)
    mem_bw_tb_s: float = Field(gt=0)
    intra_node_gb_s: float = Field(gt=0)
    inter_node_gb_s: float = Field(gt=0)
    devices_per_node: int = Field(8, gt=0)
    latency_us: float = Field(10.0, ge=0)
    layer_overhead_us: float = Field(5.0, ge=0)
    gemm_half_width: float = Field(256.0, gt=0)
    gemm_half_tokens: float = Field(64.0, gt=0)
    host_link_gb_s: float = Field(25.0, gt=0)
    host_memory_gb: float = Field(0.0, ge=0)
    multicore_efficiency: float = Field(1.0, gt=0, le=1)
    comm_overlap: float = Field(0.8, ge=0, le=1)
    engine_reload_ms: float = Field(0.0, ge=0)
    engine_reload_gb_s: float | None = Field(None, gt=0)
    rollout: dict[Literal["vllm", "hf"], RolloutCost] = {}
    efficiency: Efficiency
    sources: dict[str, str] = {}

    def tflops(self, dtype: str) -> float:
        """The dense matmul rate in ``dtype`` (``float32``, ``bfloat16``)."""
        if dtype == "float32":
            return self.fp32_tflops or self.peak_tflops / 2
        return self.peak_tflops

    @property
    def usable_bytes(self) -> float:
        return (self.memory_gb - self.reserved_gb) * 1e9


_PROFILES: dict[str, HardwareProfile] | None = None


def profiles() -> dict[str, HardwareProfile]:
    """All built-in profiles by canonical name."""
    global _PROFILES
    if _PROFILES is None:
        out: dict[str, HardwareProfile] = {}
        for f in sorted(resources.files("flowc.ir").joinpath("hardware").iterdir(), key=lambda f: f.name):
            if not f.name.endswith(".yaml"):
                continue
            try:
                p = HardwareProfile.model_validate(yaml.safe_load(f.read_text()))
            except ValidationError as e:
                raise SpecError(f"hardware profile {f.name} is invalid: {e}") from e
            out[p.name] = p
        _PROFILES = out
    return _PROFILES


def get_profile(name: str) -> HardwareProfile:
    """The profile called ``name`` or one of its aliases (case-insensitive)."""
    key = name.strip().lower()
    for p in profiles().values():
        if key == p.name.lower() or key in (a.lower() for a in p.aliases):
            return p
    names = ", ".join(f"{p.name} ({', '.join(p.aliases)})" if p.aliases else p.name for p in profiles().values())
    raise SpecError(f"unknown device type {name!r}", fix=f"use one of: {names}")
