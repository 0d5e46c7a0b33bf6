"""Hand-built tiny Kineto traces whose answers are obvious by construction.

``SynthTrace`` collects events; ``kernel(...)`` adds a GPU kernel *and* the
``cudaLaunchKernel`` runtime event that launched it (same correlation id) at
``launch_ts``, so HTA-style step filtering can be exercised. ``write(path)``
writes ``.json`` or ``.json.gz`` (by suffix).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

CPU_PID, CPU_TID = 100, 100


class SynthTrace:
    def __init__(self, rank: int = 0, world_size: int = 1, device_name: str | None = None):
        self.rank = rank
        self.world_size = world_size
        self.device_name = device_name
        self.events: list = []
        self._corr = 1

    def cpu(self, name, ts, dur, cat="cpu_op", tid=CPU_TID, **args):
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": CPU_PID, "tid": tid,
                            "ts": ts, "dur": dur, "args": args})
        return self

    def step(self, n, ts, dur):
        return self.cpu(f"ProfilerStep#{n}", ts, dur, cat="user_annotation")

    def kernel(self, name, ts, dur, stream=7, device=0, launch_ts=None, cat="kernel", **args):
        corr = self._corr
        self._corr += 1
        if launch_ts is None:
            launch_ts = max(ts - 1.0, 0.0)
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel",
                            "pid": CPU_PID, "tid": CPU_TID, "ts": launch_ts, "dur": 0.5,
                            "args": {"correlation": corr}})
        a = {"device": device, "stream": stream, "correlation": corr}
        a.update(args)
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": device, "tid": stream,
                            "ts": ts, "dur": dur, "args": a})
        return self

    def doc(self) -> dict:
        d = {"schemaVersion": 1,
             "distributedInfo": {"backend": "nccl", "rank": self.rank, "world_size": self.world_size},
             "traceEvents": list(self.events)}
        if self.device_name:
            d["deviceProperties"] = [{"id": 0, "name": self.device_name}]
        return d

    def write(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = json.dumps(self.doc()).encode()
        if path.name.endswith(".gz"):
            with gzip.open(path, "wb") as fh:
                fh.write(data)
        else:
            path.write_bytes(data)
        return path


def nccl_args(coll: str, nelems: int, dtype: str = "Float", group: int = 2, pg: str = "0",
              out_nelems: int | None = None) -> dict:
    return {"Collective name": coll, "In msg nelems": nelems,
            "Out msg nelems": nelems if out_nelems is None else out_nelems,
            "Group size": group, "dtype": dtype, "Process Group Name": pg,
            "Process Group Description": "default_pg"}
