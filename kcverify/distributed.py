"""Fan the independent bound work out on Ray (``kcverify[ray]``; docs/distributed.md).

The work items are runs of the bound engine (``kcverify.bounds.certify_drift``) that share
nothing: the slices of a contract in ``prove`` (one run per slice, exactly the run the serial
planner makes), and the inputs of ``bound`` in the relational domains (one input per run). An
executor maps over them and returns the results in input order, so the certificate and every
bound are the serial run's, byte for byte. The blocks of one slice are not independent (block k
starts from block k-1's out_state), so they stay in one run.

* ``SerialExecutor`` runs the items in this process, in order (the default).
* ``RayExecutor`` runs them as Ray tasks: on a local Ray started for ``workers`` CPUs, or on an
  existing cluster (``address``). The ONNX model goes to the object store once, as its bytes with
  any external weights inlined; each worker process decodes it once and keeps the graph. With a
  CUDA device each task requests one GPU (``num_gpus=1``), otherwise one CPU. Each task runs torch
  with the driver's number of intra-op threads (``threads``): torch's float64 reductions round
  differently with another thread count (measured on the decoder's zonotope: bounds 1e-16 apart),
  and the certificate must be the serial run's. On N cores, N workers then oversubscribe them
  when the driver uses several threads; on a cluster each node's own count applies only if
  ``threads`` is set to it (byte identity then holds per CPU type, soundness always).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kcverify.errors import KcverifyError

Item = dict[str, Any]  # keyword arguments of certify_drift besides the graph and the kernels
_GRAPHS: dict[str, Any] = {}  # per worker process: model digest -> Graph


def model_bytes(path: str | os.PathLike[str]) -> bytes:
    """The ONNX model as one serialized protobuf, external data inlined (what workers decode)."""
    import onnx

    from kcverify.errors import ModelImportError

    try:
        model = onnx.load(os.fspath(path), load_external_data=True)
    except Exception as e:  # noqa: BLE001 - protobuf decode errors have many types
        raise ModelImportError(f"{path}: not a readable ONNX model ({type(e).__name__}: {e})"
                               ) from None
    return model.SerializeToString()


def _graph(data: bytes, name: str) -> Any:
    """The IR graph of ``data`` (decoded once per process and digest)."""
    key = hashlib.sha256(data).hexdigest()
    if key not in _GRAPHS:
        import onnx

        from kcverify.models.ir import from_onnx

        _GRAPHS[key] = from_onnx(onnx.load_from_string(data), name=name)
    return _GRAPHS[key]


def bound_item(data: bytes, name: str, train: Any, inf: Any, item: Item,
               threads: int | None = None) -> Any:
    """One work item: certify_drift on the graph of ``data`` (runs inside a worker), with
    ``threads`` torch intra-op threads (the driver's count: see RayExecutor)."""
    import torch

    from kcverify.bounds import certify_drift

    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return certify_drift(_graph(data, name), train, inf, **item)


class SerialExecutor:
    """Run the bound work items here, one after another."""

    workers = 1

    def map_drift(self, graph: Any, model: str | os.PathLike[str], train: Any, inf: Any,
                  items: Sequence[Item],
                  done: Callable[[int, Any], None] | None = None) -> list[Any]:
        """certify_drift(graph, train, inf, **item) for each item, in order; ``done(i, result)``
        after each."""
        from kcverify.bounds import certify_drift

        out = []
        for i, item in enumerate(items):
            out.append(certify_drift(graph, train, inf, **item))
            if done is not None:
                done(i, out[-1])
        return out


class RayExecutor:
    """Run the bound work items as Ray tasks (see the module docstring).

    ``workers``: start a local Ray with this many CPUs (loopback only, no dashboard);
    ``address``: connect to an existing cluster instead ("auto", "ray://host:10001", ...).
    A Ray already initialised in this process is used as it is."""

    def __init__(self, workers: int | None = None, address: str | None = None,
                 device: str = "cpu", threads: int | None = None) -> None:
        if address is None:
            # a local Ray on loopback only (Ray otherwise binds its node to the host's address);
            # read when ray is first imported
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        try:
            import ray
        except ImportError:
            raise KcverifyError("--workers / --ray-address need Ray: pip install "
                                "'kcverify[ray]'") from None
        if workers is not None and workers < 1:
            raise KcverifyError(f"--workers {workers}: expected a number of workers >= 1")
        self.ray = ray
        self.device = device
        if threads is None:
            import torch

            threads = torch.get_num_threads()
        self.threads = threads
        self.started = False
        if not ray.is_initialized():
            try:
                if address is not None:
                    ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
                else:
                    ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False,
                             logging_level=logging.ERROR)
            except (ConnectionError, RuntimeError, ValueError) as e:
                where = f"the Ray cluster at {address}" if address else "a local Ray"
                raise KcverifyError(f"--ray-address {address}: cannot connect to {where} ({e})"
                                    if address else f"--workers: cannot start {where} ({e})"
                                    ) from None
            self.started = True
        self.workers = workers or int(ray.cluster_resources().get("CPU", 1))
        self._task = ray.remote(bound_item)
        self._refs: dict[str, Any] = {}

    def _model_ref(self, model: str | os.PathLike[str]) -> Any:
        key = os.fspath(model)
        if key not in self._refs:  # the ONNX bytes go to the object store once per model
            self._refs[key] = self.ray.put(model_bytes(model))
        return self._refs[key]

    def map_drift(self, graph: Any, model: str | os.PathLike[str], train: Any, inf: Any,
                  items: Sequence[Item],
                  done: Callable[[int, Any], None] | None = None) -> list[Any]:
        """The serial executor's results, computed by Ray tasks; in input order."""
        gpus = 1 if str(self.device).startswith("cuda") else 0
        if gpus and self.ray.cluster_resources().get("GPU", 0) < 1:
            raise KcverifyError(f"--device {self.device}: the Ray cluster has no GPU for the "
                                f"bound tasks (resources: {self._resources()})")
        ref = self._model_ref(model)
        task = self._task.options(num_cpus=0 if gpus else 1, num_gpus=gpus)
        pending = {task.remote(ref, os.fspath(model), train, inf, item, self.threads): i
                   for i, item in enumerate(items)}
        out: list[Any] = [None] * len(items)
        while pending:
            ready, _ = self.ray.wait(list(pending), num_returns=1)
            for r in ready:
                i = pending.pop(r)
                try:
                    out[i] = self.ray.get(r)
                except self.ray.exceptions.RayTaskError as e:
                    from kcverify.errors import InternalError

                    cause = getattr(e, "cause", None)  # the task's own exception, re-raised here
                    if isinstance(cause, KcverifyError | InternalError):
                        raise cause from None
                    raise
                if done is not None:
                    done(i, out[i])
        return out

    def _resources(self) -> str:
        res = self.ray.cluster_resources()
        return ", ".join(f"{k} {res[k]:g}" for k in ("CPU", "GPU") if k in res) or "none"

    def close(self) -> None:
        """Shut down the Ray this executor started (a cluster it connected to stays up)."""
        if self.started and self.ray.is_initialized():
            self.ray.shutdown()
        self.started = False


@contextmanager
def executor_for(workers: int | None = None, address: str | None = None,
                 device: str = "cpu") -> Iterator[RayExecutor | None]:
    """The executor for ``--workers`` / ``--ray-address`` (None when neither is given: the
    planner then bounds each slice when a clause first needs it); a Ray it started is shut down
    on exit."""
    if workers is None and address is None:
        yield None
        return
    ex = RayExecutor(workers=workers, address=address, device=device)
    try:
        yield ex
    finally:
        ex.close()
