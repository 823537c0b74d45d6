"""``algorithm="auto"``: pick native, ring, tree or shm per call from the mesh's fitted collective costs.

A ``Mesh`` may carry calibrations (``Mesh(..., calibration=cal)`` or ``mesh.with_calibration(cal)``), one per
group size, as fitted by ``shardwise calibrate`` or ``shardwise bench comm --calibrate``. For a call on an axis
of ``n`` ranks moving a full buffer of ``nbytes`` (the all-reduced tensor, the gathered output, the
un-scattered input, the broadcast tensor), "auto" runs ``calibration.best_algorithm(op, nbytes)`` of the
calibration measured on groups of ``n``. Without one — no calibration attached, none for that group size,
that collective not calibrated, a group of one, or a dtype only the backend handles — it runs ``native``.

``shm`` is a candidate only where it can run: tensors in host memory and every rank of the group on one
host. Where the calibration's cheapest is ``shm``, the first such call on an axis finds out whether its
ranks share a host (``shm_rendezvous.shm_group_for``: collective, once per mesh and axis, cached); if they
do not, the cheapest of the others runs.

The choice is a pure function of (calibration, op, nbytes, dtype, whether shm can run), so every rank of a
group picks the same algorithm as long as they all attached the same calibration (``Mesh(debug=True)``
checks it per call).
"""

from __future__ import annotations

import torch

from ..mesh import Mesh
from .ops import ALGORITHMS, SUPPORTED_DTYPES
from .shm_rendezvous import shm_group_for

__all__ = ["resolve_algorithm", "choose_algorithm"]


def choose_algorithm(calibration: object | None, op: str, nbytes: int, dtype: torch.dtype | None = None, *,
                     shm_ok: bool = True) -> str:
    """The implementation "auto" runs for ``op`` on a full buffer of ``nbytes`` given ``calibration``
    (of the group's size, or ``None``); ``shm_ok=False`` leaves ``shm`` out (ranks on several hosts). Pure."""
    if calibration is None or (dtype is not None and dtype not in SUPPORTED_DTYPES):
        return "native"
    models = getattr(calibration, "models", {})
    known = {a: m for a, m in models.get(op, {}).items() if a in ALGORITHMS and (shm_ok or a != "shm")}
    if not known:
        return "native"
    return min(known, key=lambda a: (known[a].predict_us(nbytes), ALGORITHMS.index(a)))


def resolve_algorithm(algorithm: str, mesh: Mesh, axis: str, op: str, nbytes: int,
                      dtype: torch.dtype | None = None) -> str:
    """``algorithm`` itself, or for ``"auto"`` the implementation chosen from ``mesh``'s calibration for
    groups of ``mesh.size(axis)``."""
    if algorithm != "auto":
        return algorithm
    n = mesh.size(axis)
    if n < 2:
        return "native"
    calibration = mesh.calibration_for(n)
    choice = choose_algorithm(calibration, op, nbytes, dtype, shm_ok=mesh.device.type == "cpu")
    if choice == "shm" and shm_group_for(mesh, axis, required=False) is None:  # collective on first use
        choice = choose_algorithm(calibration, op, nbytes, dtype, shm_ok=False)
    return choice
