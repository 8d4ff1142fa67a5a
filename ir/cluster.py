"""ClusterSpec: the devices a plan may use.

Written three ways:

* ``local`` — this machine's CPU cores (one device per core);
* the shorthand ``NODESxDEVICESxTYPE`` (``16x8xA100-80GB``, ``2x8xH100``) or
  ``DEVICESxTYPE`` for one node (``8xH200``);
* a YAML file with the fields of :class:`ClusterSpec`, e.g.::

      device: A100-80GB
      nodes: 16
      devices_per_node: 8
      inter_node_gb_s: 25     # HybridFlow's testbed: 200 Gb/s per node
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from flowc.errors import SpecError
from flowc.ir.hardware import Efficiency, HardwareProfile, get_profile

_SHORTHAND = re.compile(r"^\s*(?:(\d+)\s*[xX×]\s*)?(\d+)\s*[xX×]\s*([A-Za-z][\w.\-]*)\s*$")


class ClusterSpec(BaseModel):
    """Nodes of identical devices. Unknown keys are errors.

    Attributes:
        device: hardware profile name or alias (``H100``).
        nodes: number of nodes.
        devices_per_node: devices per node.
        intra_node_gb_s: override of the profile's per-device NVLink bandwidth.
        inter_node_gb_s: override of the profile's per-node network bandwidth.
        memory_gb: override of the profile's device memory.
        cores_per_device: CPU clusters: cores each device (worker process)
            uses; its compute, bandwidth and memory scale with them.
        efficiency: override of the profile's achieved fractions of peak (what
            ``flowc calibrate`` fits from measured runs).
        name: how the cluster is shown (defaults to the shorthand).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    device: str
    nodes: int = Field(1, ge=1)
    devices_per_node: int = Field(ge=1)
    intra_node_gb_s: float | None = Field(None, gt=0)
    inter_node_gb_s: float | None = Field(None, gt=0)
    memory_gb: float | None = Field(None, gt=0)
    cores_per_device: int = Field(1, ge=1)
    efficiency: Efficiency | None = None
    name: str = ""

    @model_validator(mode="after")
    def _canonical(self) -> ClusterSpec:
        prof = get_profile(self.device)  # raises SpecError for an unknown type
        object.__setattr__(self, "device", prof.name)
        if not self.name:
            object.__setattr__(self, "name", f"{self.nodes}x{self.devices_per_node}x{prof.name}")
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def profile(self) -> HardwareProfile:
        """The device profile with this cluster's overrides applied."""
        p = get_profile(self.device)
        if p.kind == "cpu" and self.cores_per_device > 1:
            k = self.cores_per_device
            scale = k * p.multicore_efficiency
            p = p.model_copy(
                update={
                    "peak_tflops": p.peak_tflops * scale,
                    "fp32_tflops": p.fp32_tflops * scale if p.fp32_tflops else None,
                    "mem_bw_tb_s": p.mem_bw_tb_s * scale,
                    "memory_gb": p.memory_gb * k,
                    "reserved_gb": p.reserved_gb * k,  # its k cores' share of the controller and Ray
                    "devices_per_node": max(p.devices_per_node // k, 1),
                }
            )
        upd = {
            k: v
            for k, v in {
                "intra_node_gb_s": self.intra_node_gb_s,
                "inter_node_gb_s": self.inter_node_gb_s,
                "memory_gb": self.memory_gb,
                "efficiency": self.efficiency,
            }.items()
            if v is not None
        }
        return p.model_copy(update=upd) if upd else p

    def __str__(self) -> str:
        return self.name

    @classmethod
    def local(cls, devices: int | None = None) -> ClusterSpec:
        """This machine's CPUs as ``devices`` workers (default: one per core),
        each using an equal share of the cores."""
        cores = os.cpu_count() or 1
        n = max(1, min(devices or cores, cores))
        per = cores // n
        name = f"local ({n} CPU workers x {per} cores)" if per > 1 else f"local ({n} CPU cores)"
        return cls(device="cpu", nodes=1, devices_per_node=n, cores_per_device=per, name=name)

    @classmethod
    def parse(cls, text: str) -> ClusterSpec:
        """From ``local``, a shorthand such as ``16x8xA100-80GB``, or a YAML path."""
        t = text.strip()
        if t.lower() == "local":
            return cls.local()
        if t.lower().startswith("local:") and t[6:].isdigit():
            return cls.local(int(t[6:]))
        p = Path(t).expanduser()
        if p.suffix in (".yaml", ".yml", ".json") or p.is_file():
            if not p.is_file():
                raise SpecError(f"cluster file {t} does not exist")
            try:
                data = yaml.safe_load(p.read_text())
                return cls.model_validate(data)
            except yaml.YAMLError as e:
                raise SpecError(f"cluster file {t} is not valid YAML: {e}") from e
            except ValidationError as e:
                err = e.errors()[0]
                loc = ".".join(str(x) for x in err["loc"])
                raise SpecError(
                    f"cluster file {t}: {loc}: {err['msg']}",
                    fix="fields: device, nodes, devices_per_node, intra_node_gb_s, inter_node_gb_s, memory_gb, cores_per_device, efficiency, name",
                ) from e
        m = _SHORTHAND.match(t)
        if not m:
            raise SpecError(
                f"cannot read cluster {text!r}",
                fix="write local (or local:N for N CPU workers), NODESxDEVICESxTYPE (e.g. 16x8xA100-80GB, 2x8xH100), DEVICESxTYPE (8xH200), or a YAML file",
            )
        nodes = int(m.group(1) or 1)
        per = int(m.group(2))
        if nodes < 1 or per < 1:
            raise SpecError(f"cluster {text!r} has no devices", fix="use at least 1 node of 1 device")
        return cls(device=m.group(3), nodes=nodes, devices_per_node=per)
